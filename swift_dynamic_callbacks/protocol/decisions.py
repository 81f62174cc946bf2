"""What a callback decides besides requests: the decision records it queues (drained by the integration at every step
boundary, log and save), the numbers it publishes into the training log, and the controls it claims (one callback a
control, the last request would otherwise silently win).

The flags and when each is cleared: ``docs/control-flags.md``.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..errors import ConfigError
from .flags import DYNAMIC_DECISIONS, DYNAMIC_METRICS
from .requests import CONTROLS

__all__ = ['record_decision', 'drain_decisions', 'publish_metrics', 'current_metrics', 'controls_conflict',
           'claim_controls']


def record_decision(control: Any, record: Any) -> None:
    """Queue a :class:`~swift_dynamic_callbacks.records.DecisionRecord` for the decision log."""
    queue = getattr(control, DYNAMIC_DECISIONS, None)
    if queue is None:
        queue = []
        setattr(control, DYNAMIC_DECISIONS, queue)
    queue.append(record)


def drain_decisions(control: Any) -> list:
    """Take and empty the queue of decision records."""
    queue = getattr(control, DYNAMIC_DECISIONS, None) or []
    setattr(control, DYNAMIC_DECISIONS, [])
    return list(queue)


def publish_metrics(control: Any, values: Mapping[str, float]) -> None:
    """Set numbers that the integration merges into every training log line (``logging.jsonl``, TensorBoard)."""
    board = getattr(control, DYNAMIC_METRICS, None)
    if board is None:
        board = {}
        setattr(control, DYNAMIC_METRICS, board)
    for key, value in values.items():
        board[key] = float(value)


def current_metrics(control: Any) -> dict[str, float]:
    return dict(getattr(control, DYNAMIC_METRICS, None) or {})


def controls_conflict(first: str, second: str, controls: Iterable[str], remedy: str) -> str:
    """The message for two callbacks requesting the same ``controls`` (at configuration time and at train begin)."""
    texts = []
    for control in controls:
        what, flags = CONTROLS.get(control, (control, ()))
        texts.append(f'{what} ({", ".join(f"control.{f}" for f in flags)})')
    return (f'callbacks: {first} and {second} both request {" and ".join(texts)}; a request holds one value per step, '
            f'so the last one would silently win. {remedy}')


def claim_controls(owner: Any, name: str, controls: Any, claims_on: Any) -> None:
    """Record that callback ``name`` (object ``owner``) requests ``controls`` during this training run; a second
    callback claiming one of them raises ``ConfigError`` naming both. The claims live on ``claims_on`` (HF's
    ``TrainerState``, which is new for every ``train()``), so a later run starts with none."""
    claims = getattr(claims_on, '_sdc_controls', None)
    if claims is None:
        claims = {}
        setattr(claims_on, '_sdc_controls', claims)
    for control in controls:
        holder = claims.get(control)
        if holder is not None and holder[0] is not owner:
            raise ConfigError(controls_conflict(holder[1], name, [control], 'Add only one of them to the trainer'))
        claims[control] = (owner, name)

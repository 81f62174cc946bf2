"""The interface every growth policy of ``batch_growth`` meets (one strategy a module, Composer's algorithms' shape).

A strategy turns what the callback observes into the per-device batch size it wants; it never sees the trainer or
the control flags. The callback (:class:`~..batch_growth.BatchGrowthCallback`) calls, in this order:

- :meth:`GrowthStrategy.begin` at train start (refuse what this run cannot measure);
- :meth:`GrowthStrategy.observe_log` with every logged training loss;
- :meth:`GrowthStrategy.observe_step` at every step end, with :class:`StepView` (returns numbers to publish in the
  log line), then :meth:`GrowthStrategy.target`;
- :meth:`GrowthStrategy.record_values` when it requests a size (added to the ``batch_size`` record), then
  :meth:`GrowthStrategy.resized` with the size and the LR scale it requested.

State: each strategy's own typed state, saved under its own key(s) by :meth:`state_dict` (the keys the callback
used before the strategies existed, so older checkpoints load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from ...config.batch_growth import BatchGrowthConfig


@dataclass(frozen=True)
class StepView:
    """What a strategy may read at a step end.

    Attributes:
        step: optimizer steps done (``state.global_step``).
        max_steps: the run's optimizer steps (0 when unknown).
        lr: the LR the scheduler reports now (the next step's), or ``None`` without a scheduler.
        base_lr: the configured ``learning_rate``.
        noise: the step's gradient-noise measurement (``protocol.GradNoiseSample``) when one was asked for.
        passes_per_step: forward/backward passes of a step over all ranks (``GA x processes``).
        samples: samples consumed by the steps done, all ranks together (the batch sizes in effect x
            ``passes_per_step``, summed by the callback; saved with its state).
    """

    step: int
    max_steps: int
    lr: float | None
    base_lr: float
    noise: Any = None
    passes_per_step: int = 1
    samples: int = 0


class GrowthStrategy:
    """One growth policy (see the module docstring). Subclasses set ``name`` and override what they use."""

    name: ClassVar[str] = ''
    #: whether it asks the integration for gradient-noise measurements (``control.measure_grad_noise``)
    measures_grad_noise: ClassVar[bool] = False

    def __init__(self, config: BatchGrowthConfig) -> None:
        self.config = config

    @property
    def rank_local(self) -> bool:
        """Whether it decides from values of this rank (losses, gradients, a user function): rank 0's size is
        used on every rank."""
        return False

    def begin(self, gradient_accumulation_steps: int) -> None:
        """At train start: raise a ``ConfigError`` naming the setting when this run cannot feed the policy."""

    def observe_log(self, loss: float) -> None:
        """A logged training loss (finite or not; NaN for HF's substitute of a NaN step)."""

    def observe_step(self, view: StepView) -> dict[str, float]:
        """A step ended; returns ``dynamic/*`` numbers for the log line."""
        return {}

    def target(self, step: int, current: int) -> int:
        """The per-device batch size wanted from 0-based optimizer step ``step`` on (``current``: in effect)."""
        raise NotImplementedError

    def record_values(self, reason: str, per_step: int) -> dict[str, Any]:
        """Extra values of the ``batch_size`` record (``per_step``: passes a step over all ranks)."""
        return {}

    def resized(self, old: int | None, new: int, lr_scale: float) -> None:
        """The callback requested ``new`` (from ``old``) with the LR scale ``lr_scale``."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from the callback's state (its own keys; missing keys keep the initial values)."""

"""Early-stopping decision (pure function).

One monitored value at a time (an evaluation metric, or a logged training value) goes through
:func:`stop_decision` with the state kept so far (best value, evaluations without improvement). Checks, in order:

1. ``non_finite``: the value is NaN or infinite -> stop (best and wait unchanged). With
   ``stop_on_non_finite=False`` it is a check without improvement instead (``wait += 1``; only rule 5 applies):
   a non-finite value is never an improvement, never reaches a threshold and never counts as a divergence.
2. improvement: ``value < best - min_delta`` (mode ``min``) or ``value > best + min_delta`` (mode ``max``); the
   first value always improves. An improvement sets ``best = value, wait = 0``; otherwise ``wait += 1``.
3. ``threshold``: the value reached the goal (``value <= threshold`` in mode ``min``, ``>=`` in ``max``) -> stop.
4. ``divergence``: the value is past the bound the other way (``value > divergence`` in mode ``min``,
   ``<`` in ``max``) -> stop.
5. ``patience``: ``wait >= patience`` -> stop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

MODES = ('min', 'max')


class StopReason(str, Enum):
    """Why early stopping ended a run (the ``reason`` of its decision record)."""

    PATIENCE = 'patience'
    THRESHOLD = 'threshold'
    DIVERGENCE = 'divergence'
    NON_FINITE = 'non_finite'


@dataclass(frozen=True)
class StopDecision:
    """Outcome of one check.

    Attributes:
        stop: end training now.
        reason: why, when ``stop``.
        best: best value so far (after this one).
        wait: checks in a row without improvement (after this one).
        improved: this value became the new best.
    """

    stop: bool
    reason: StopReason | None
    best: float | None
    wait: int
    improved: bool


def improves(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """True when ``value`` beats ``best`` by more than ``min_delta`` in direction ``mode`` (always, without a best)."""
    if mode not in MODES:
        raise ValueError(f'mode: must be min or max, got {mode!r}')
    if best is None:
        return True
    return value < best - min_delta if mode == 'min' else value > best + min_delta


def stop_decision(value: float, best: float | None, wait: int, *, mode: str, patience: int, min_delta: float = 0.0,
                  threshold: float | None = None, divergence: float | None = None,
                  stop_on_non_finite: bool = True) -> StopDecision:
    """Check one monitored value (see the module docstring for the rules and their order)."""
    if mode not in MODES:
        raise ValueError(f'mode: must be min or max, got {mode!r}')
    if patience < 1:
        raise ValueError(f'patience: must be >= 1, got {patience}')
    if not math.isfinite(value):
        if stop_on_non_finite:
            return StopDecision(True, StopReason.NON_FINITE, best, wait, False)
        wait += 1
        return StopDecision(wait >= patience, StopReason.PATIENCE if wait >= patience else None, best, wait, False)
    improved = improves(value, best, mode, min_delta)
    if improved:
        best, wait = value, 0
    else:
        wait += 1
    sign = 1.0 if mode == 'min' else -1.0
    if threshold is not None and sign * value <= sign * threshold:
        return StopDecision(True, StopReason.THRESHOLD, best, wait, improved)
    if divergence is not None and sign * value > sign * divergence:
        return StopDecision(True, StopReason.DIVERGENCE, best, wait, improved)
    if wait >= patience:
        return StopDecision(True, StopReason.PATIENCE, best, wait, improved)
    return StopDecision(False, None, best, wait, improved)

"""Learning-rate schedule shapes, plateau detection and the grad-norm guard (pure functions).

A schedule is a JSON-able mapping (it travels in ``control.new_lr_schedule`` and is saved in ``scheduler.pt``)::

    {'warmup': W, 'hold': H, 'min_ratio': m, 'total': T, 'guard': g,
     'restarts': [[step, peak, rewarmup], ...]}

or, for a step decay (``lr_schedule`` ``decay: steps``), ``{'decay': 'steps', 'warmup': W, 'steps': [[at, factor],
...], 'total': T, 'guard': g}``. ``W``/``H``/``at`` are steps (int) or fractions of ``T`` (float < 1); ``T`` is the
schedule's horizon in optimizer steps (filled in by the integration). :func:`schedule_factor` gives the factor on the
configured LR at a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence


def resolve_steps(value: int | float, total: int) -> int:
    """Steps from an int (steps) or a float fraction of ``total`` (rounded)."""
    if isinstance(value, float):
        return int(round(value * total))
    return int(value)


def cosine(progress: float, start: float, end: float) -> float:
    """Half-cosine from ``start`` (progress 0) to ``end`` (progress 1): ``end + (start - end) (1 + cos(pi p)) / 2``."""
    progress = min(max(progress, 0.0), 1.0)
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_hold_cosine(step: float, *, total: int, warmup: int, hold: int, min_ratio: float) -> float:
    """Factor on the base LR at optimizer step ``step`` (0-based; the LR of step ``k`` is ``factor(k)``)::

        step < W:              step / W                                   (linear warmup 0 -> 1)
        W <= step < W + H:     1                                          (hold)
        W + H <= step:         m + (1 - m) (1 + cos(pi (step - W - H) / (T - W - H))) / 2   (cosine to m at T)

    and ``m`` from ``T`` on. ``W + H >= T``: no decay phase (the factor stays 1 after warmup).
    """
    if step < warmup:
        return step / warmup
    decay_start = warmup + hold
    if step < decay_start or decay_start >= total:
        return 1.0
    return cosine((step - decay_start) / (total - decay_start), 1.0, min_ratio)


def step_decay(step: float, *, total: int, warmup: int, stages: Sequence[Sequence[Any]]) -> float:
    """Factor on the base LR at ``step`` of a warmup then a step decay: ``step / W`` during warmup, then the factor
    of the last stage ``[at, factor]`` that has begun (``at`` in steps or a fraction of ``total``; 1 before the
    first). The stages' steps are on the same time axis as the cosine's, so a run whose batch grows reaches each
    stage after the same samples (the integration stretches the axis)."""
    if step < warmup:
        return step / warmup
    factor = 1.0
    for at, value in sorted((resolve_steps(a, total), float(v)) for a, v in stages):
        if step >= at:
            factor = value
    return factor


def schedule_factor(schedule: Mapping[str, Any], step: float) -> float:
    """Factor on the configured LR at ``step`` for a schedule mapping (see the module docstring).

    Restart ``k`` at step ``s`` with peak ``p`` and re-warmup ``r``: from ``s`` on, the factor ramps linearly from
    the value the schedule had at ``s`` to ``p`` over ``r`` steps (``r = 0``: jumps to ``p``), then decays on a
    cosine from ``p`` to ``min_ratio`` at ``total``. The guard factor ``g`` multiplies everything.
    """
    total = int(schedule['total'])
    guard = float(schedule.get('guard', 1.0))
    if schedule.get('decay', 'cosine') == 'steps':
        return guard * step_decay(step, total=total, warmup=resolve_steps(schedule['warmup'], total),
                                  stages=schedule['steps'])
    m = float(schedule['min_ratio'])
    restarts = [tuple(r) for r in schedule.get('restarts', ())]
    return guard * _factor(step, total, resolve_steps(schedule['warmup'], total),
                           resolve_steps(schedule['hold'], total), m, restarts)


def _factor(step: float, total: int, warmup: int, hold: int, m: float, restarts: Sequence[tuple]) -> float:
    active = [r for r in restarts if r[0] <= step]
    if not active:
        return warmup_hold_cosine(step, total=total, warmup=warmup, hold=hold, min_ratio=m)
    start, peak, rewarmup = active[-1][0], float(active[-1][1]), int(active[-1][2])
    if step < start + rewarmup:
        before = _factor(start, total, warmup, hold, m, [r for r in restarts if r[0] < start])
        return before + (peak - before) * (step - start) / rewarmup
    decay_start = start + rewarmup
    if decay_start >= total:
        return max(peak, m)
    return cosine((step - decay_start) / (total - decay_start), peak, m)


@dataclass(frozen=True)
class PlateauState:
    """What plateau detection keeps between values: the best (smoothed) value, values since it, cooldown left."""

    best: float | None = None
    wait: int = 0
    cooldown: int = 0


def improved(value: float, best: float | None, mode: str, min_delta: float) -> bool:
    """``value`` beats ``best`` by more than ``min_delta`` (``mode`` min: lower is better; max: higher)."""
    if best is None:
        return True
    return value < best - min_delta if mode == 'min' else value > best + min_delta


def plateau_step(state: PlateauState, value: float, *, mode: str, min_delta: float, patience: int,
                 cooldown: int) -> tuple[PlateauState, bool]:
    """Fold one (smoothed) value in; returns the new state and whether a plateau is declared now.

    During ``cooldown`` values (after a restart) nothing counts. Otherwise an improvement by more than
    ``min_delta`` resets the wait; ``patience`` values in a row without one are a plateau, after which the wait
    restarts, the cooldown begins and the best value is the current one (the restarted run is judged afresh).
    A non-finite value changes nothing: it is neither an improvement nor a value without one (a NaN step says
    nothing about a plateau), and it does not use up the cooldown.
    """
    if not math.isfinite(value):
        return state, False
    if state.cooldown > 0:
        best = value if state.best is None else state.best
        return replace(state, cooldown=state.cooldown - 1, best=best), False
    if improved(value, state.best, mode, min_delta):
        return PlateauState(best=value, wait=0, cooldown=0), False
    wait = state.wait + 1
    if wait >= patience:
        return PlateauState(best=value, wait=0, cooldown=cooldown), True
    return replace(state, wait=wait), False


def smoothed(values: Sequence[float], window: int) -> float:
    """Median of the finite values among the last ``window`` values (fewer at the start; NaN when none).

    A median, not a mean: one outlier (a loss spike, or the 0.0 HF logs for a NaN step) moves it by one rank at
    most, where it would move a mean of ``window`` values by ``outlier / window`` for ``window`` values in a row.
    """
    recent = sorted(v for v in list(values)[-window:] if math.isfinite(v))
    if not recent:
        return math.nan
    middle = len(recent) // 2
    return recent[middle] if len(recent) % 2 else (recent[middle - 1] + recent[middle]) / 2


@dataclass(frozen=True)
class GuardState:
    """Consecutive logged grad norms above the high / below the low threshold."""

    high: int = 0
    low: int = 0


def guard_step(state: GuardState, grad_norm: float, scale: float, *, high: float, low: float, patience: int,
               down: float, up: float, min_scale: float, max_scale: float) -> tuple[GuardState, float]:
    """Grad-norm guard: ``patience`` norms in a row above ``high`` (or non-finite) multiply the scale by ``down``;
    ``patience`` in a row below ``low`` multiply it by ``up``; always within ``[min_scale, max_scale]``.
    Returns the new state and the (possibly unchanged) scale."""
    if not math.isfinite(grad_norm) or grad_norm > high:
        state = GuardState(high=state.high + 1, low=0)
    elif grad_norm < low:
        state = GuardState(high=0, low=state.low + 1)
    else:
        return GuardState(), scale
    if state.high >= patience:
        return GuardState(), max(min_scale, scale * down)
    if state.low >= patience:
        return GuardState(), min(max_scale, scale * up)
    return state, scale

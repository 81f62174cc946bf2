"""Batch-growth policies and LR scaling rules (pure functions)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Sequence


def grow_once(size: int, factor: float, maximum: int) -> int:
    """One growth step: ``min(maximum, max(size + 1, ceil(size * factor)))``.

    Fractional factors round up, and every growth adds at least one sample, so 1.5x from 1 gives 1, 2, 3, 5, 8
    (never stuck at a size because of rounding).
    """
    return min(maximum, max(size + 1, math.ceil(size * factor)))


def interval_size(step: int, *, initial: int, factor: float, interval: int, maximum: int, delay: int = 0) -> int:
    """Per-device batch size at 0-based optimizer step ``step`` under interval growth.

    The size starts at ``initial`` and grows (:func:`grow_once`) after every ``interval`` optimizer steps that
    follow the first ``delay`` steps: growth number ``k`` applies from step ``delay + k * interval`` on.
    """
    growths = max(0, (step - delay) // interval)
    size = initial
    for _ in range(growths):
        if size >= maximum:
            break
        size = grow_once(size, factor, maximum)
    return size


def seesaw_cuts(lr_factor: float, peak_factor: float, alpha: float) -> int:
    """How many times the LR schedule has cut the LR by ``alpha`` since its peak.

    ``k = floor(log(peak / f) / log(alpha))`` (with a 1e-9 tolerance, so a factor exactly at ``peak / alpha^k``
    counts), 0 while the schedule is at or above its peak (warmup, hold) or before it has a positive peak.
    """
    if not (peak_factor > 0 and lr_factor > 0) or lr_factor >= peak_factor:
        return 0
    return max(0, math.floor(math.log(peak_factor / lr_factor) / math.log(alpha) + 1e-9))


def seesaw_size(cuts: int, *, initial: int, factor: float, maximum: int) -> int:
    """Seesaw (Meterez et al. 2025, arXiv 2510.14717): each LR cut by ``alpha`` becomes a batch growth by ``alpha``.

    With a base schedule ``eta(t)`` (e.g. ``lr_schedule``'s cosine) that has fallen ``k`` times by ``alpha`` from
    its peak (:func:`seesaw_cuts`), the batch is ``B_k = B_0 alpha^k`` (here ``k`` steps of :func:`grow_once`
    from ``initial``, clamped to ``maximum``) and the LR used is::

        eta_seesaw(t) = eta(t) * sqrt(B_k / B_0)

    so each cut of the LR by ``alpha`` is a cut by ``sqrt(alpha)`` plus a batch ``x alpha`` (the paper's
    equivalence for Adam-family optimizers: ``eta / sqrt(B)`` is what the noise level follows). Once ``maximum``
    is reached the batch stays and the schedule's further cuts apply in full. The LR factor is
    :func:`lr_scale` ``(B_k, B_0, 'sqrt')``.
    """
    size = initial
    for _ in range(max(0, cuts)):
        if size >= maximum:
            break
        size = grow_once(size, factor, maximum)
    return min(size, maximum)


def pieces_for_cap(batch_size: int, micro_batch_cap: int | None) -> int:
    """Forward/backward passes per micro-batch so that none is larger than ``micro_batch_cap`` samples."""
    if micro_batch_cap is None:
        return 1
    return max(1, -(-batch_size // micro_batch_cap))


def late_switch_size(done: float, *, initial: int, maximum: int, switch_at: float, plateaued: bool = False) -> int:
    """Late switching (arXiv 2602.14208): the small batch for most of the run, the large one after a late switch.

    ``done`` is the fraction of the run's optimizer steps behind (``global_step / max_steps``; before the switch
    the batch is constant, so this is also the fraction of its samples). Below ``switch_at`` the batch is
    ``initial``; from it on, ``maximum``. ``plateaued``: the small batch's loss has stopped improving (the loss
    plateau trigger, judged as ``lr_schedule`` judges a plateau: :func:`~.lr.plateau_step` on the median of recent
    logged losses; sticky once true), which switches earlier. On hard tasks the small batch keeps the gradient noise
    that helps most of training, and the loss catches up with the large-batch trajectory quickly after the switch.
    """
    if not 0 < switch_at < 1:
        raise ValueError(f'late_switch_size: switch_at must be in (0, 1), got {switch_at}')
    return maximum if plateaued or done >= switch_at else initial


def optimizer_scale(ratio: float, lr_factor: float, *, weight_decay: str, beta2: str) -> dict[str, float]:
    """Factors on AdamW's weight decay and power on Adam's beta2 for a batch ``ratio`` times the reference one
    (``{}``: nothing to scale).

    - ``weight_decay: power_lines`` (Bergsma et al. 2025, arXiv 2505.13738): keep the timescale
      ``tau = B / (eta * lambda * D)`` constant, so ``lambda' = lambda * ratio / lr_factor`` (``lr_factor``: the LR
      scale applied for the same batch; with the sqrt rule the decay grows by ``sqrt(ratio)``).
    - ``beta2: half_life`` (Marek et al. 2025, arXiv 2507.07101): keep beta2's half-life fixed in samples, so
      ``beta2' = beta2 ** ratio``.
    """
    if ratio <= 0 or lr_factor <= 0:
        raise ValueError(f'optimizer_scale: ratio and lr_factor must be > 0, got {ratio}, {lr_factor}')
    out = {}
    if weight_decay == 'power_lines':
        out['weight_decay'] = ratio / lr_factor
    elif weight_decay != 'none':
        raise ValueError(f'optimizer_scale: weight_decay must be power_lines or none, got {weight_decay!r}')
    if beta2 == 'half_life':
        out['beta2_power'] = float(ratio)
    elif beta2 != 'none':
        raise ValueError(f'optimizer_scale: beta2 must be half_life or none, got {beta2!r}')
    return out


def rewarm_scale(before: float, after: float, step: int, steps: int) -> float:
    """The LR scale ``step`` optimizer steps into a re-warm of ``steps`` (``1 <= step``) from ``before`` (the scale
    before a growth) to ``after`` (the growth's): linear, ``after`` from ``step == steps`` on (and when ``steps`` is
    0)."""
    if steps <= 0 or step >= steps:
        return after
    return before + (after - before) * step / steps


def lr_scale(global_batch: int, reference_batch: int, rule: str) -> float:
    """LR factor for a global batch relative to the one the configured LR is meant for.

    ``linear``: ``global / reference`` (Goyal et al. 2017, SGD); ``sqrt``: ``sqrt(global / reference)``
    (Malladi et al. 2022: the square-root rule keeps Adam-family dynamics, HF's default AdamW among them);
    ``none``: 1.
    """
    ratio = global_batch / reference_batch
    if rule == 'linear':
        return ratio
    if rule == 'sqrt':
        return math.sqrt(ratio)
    if rule == 'none':
        return 1.0
    raise ValueError(f'lr_scale: rule must be linear, sqrt or none, got {rule!r}')


def loss_variability_size(losses: Sequence[float], current: int, *, window: int, threshold: float, factor: float,
                          maximum: int) -> int:
    """Grow while the recent training loss is noisy, hold while it is stable.

    With the last ``window`` logged losses, the coefficient of variation ``cv = pstdev / mean``. When
    ``cv > threshold`` the gradient estimate is still noisy, and a larger batch averages that noise away: grow once
    (:func:`grow_once`). Otherwise hold. Fewer than ``window`` values (e.g. just after a growth, when the window is
    cleared because the noise level changes with the batch): hold.
    """
    recent = list(losses)[-window:]
    if len(recent) < window:
        return current
    mean = statistics.fmean(recent)
    if mean <= 0 or not math.isfinite(mean):
        return current
    cv = statistics.pstdev(recent) / mean
    return grow_once(current, factor, maximum) if cv > threshold else current


def noise_scale_terms(small_sqnorm: float, small_batch: float, big_sqnorm: float,
                      big_batch: float) -> tuple[float, float]:
    """Unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` from mean-gradient norms at two batch sizes.

    McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", appendix A.1): with ``|g_b|^2`` the
    squared norm of a mean gradient over a batch of ``b`` (here in loss tokens),
    ``E|g_b|^2 = |G|^2 + tr(Sigma) / b``, so for ``b < B``::

        |G|^2    ~ (B |g_B|^2 - b |g_b|^2) / (B - b)
        tr(Sigma) ~ (|g_b|^2 - |g_B|^2) / (1 / b - 1 / B)

    One step's pair is very noisy (either term can be negative); smooth both (:func:`ema`) before dividing.
    """
    if not 0 < small_batch < big_batch:
        raise ValueError(f'noise_scale_terms: need 0 < small_batch < big_batch, got {small_batch}, {big_batch}')
    g2 = (big_batch * big_sqnorm - small_batch * small_sqnorm) / (big_batch - small_batch)
    trace = (small_sqnorm - big_sqnorm) / (1 / small_batch - 1 / big_batch)
    return g2, trace


def ema(previous: float | None, value: float, decay: float) -> float:
    """Exponential moving average ``decay * previous + (1 - decay) * value`` (``value`` when there is none yet)."""
    return value if previous is None else decay * previous + (1 - decay) * value


def critical_batch(g2: float, trace: float) -> float | None:
    """The simple noise scale ``B_simple = tr(Sigma) / |G|^2`` (the batch size, in the units the terms were
    measured in, past which a larger batch stops paying off); ``None`` while the estimate is not positive."""
    if g2 <= 0 or trace <= 0 or not math.isfinite(g2) or not math.isfinite(trace):
        return None
    return trace / g2


@dataclass(frozen=True)
class NoiseState:
    """EMAs of ``|G|^2`` and ``tr(Sigma)`` (token units) and of tokens per sample, and how many steps were measured."""

    g2: float | None = None
    trace: float | None = None
    tokens_per_sample: float | None = None
    count: int = 0


def fold_noise(state: NoiseState, small_sqnorm: float, small_tokens: float, big_sqnorm: float, big_tokens: float,
               samples: float, decay: float) -> NoiseState:
    """``state`` with one optimizer step's mean-gradient norms folded in (a step whose first pass is not a strict
    part of it, or without samples, leaves it unchanged)."""
    if not (0 < small_tokens < big_tokens and samples > 0):
        return state
    g2, trace = noise_scale_terms(small_sqnorm, small_tokens, big_sqnorm, big_tokens)
    return replace(state, g2=ema(state.g2, g2, decay), trace=ema(state.trace, trace, decay),
                   tokens_per_sample=ema(state.tokens_per_sample, big_tokens / samples, decay), count=state.count + 1)


def critical_samples(state: NoiseState) -> float | None:
    """B_simple in samples (:func:`critical_batch` in tokens over the tokens a sample); ``None`` while not positive."""
    if state.g2 is None or state.trace is None or not state.tokens_per_sample:
        return None
    tokens = critical_batch(state.g2, state.trace)
    return None if tokens is None else tokens / state.tokens_per_sample


def noise_scale_size(critical_per_device: float | None, current: int, *, factor: float, maximum: int) -> int:
    """Grow toward the critical batch: one :func:`grow_once` step, but not past ``floor(critical)``; never shrink.

    ``critical_per_device`` is the critical global batch (samples) divided by passes-per-step times ranks, i.e.
    the per-device micro-batch size that would reach it. ``None`` (no estimate yet): hold.
    """
    if critical_per_device is None:
        return current
    target = min(maximum, math.floor(critical_per_device))
    if target <= current:
        return current
    return min(grow_once(current, factor, maximum), target)

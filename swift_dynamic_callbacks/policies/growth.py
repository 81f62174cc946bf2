"""Batch-growth policies and LR scaling rules (pure functions)."""

from __future__ import annotations

import math
import statistics
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


def pieces_for_cap(batch_size: int, micro_batch_cap: int | None) -> int:
    """Forward/backward passes per micro-batch so that none is larger than ``micro_batch_cap`` samples."""
    if micro_batch_cap is None:
        return 1
    return max(1, -(-batch_size // micro_batch_cap))


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

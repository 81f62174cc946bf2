"""What the integration measures and hands callbacks through ``control``: a step's gradient-noise sample (on a
standing request), an out-of-memory error it recovered from, and the count of non-finite losses in a log line.

The flags and when each is cleared: ``docs/control-flags.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .flags import GRAD_NOISE_SAMPLE, LOSS_NONFINITE, MEASURE_GRAD_NOISE, NONFINITE_LOG_KEY

__all__ = ['GradNoiseSample', 'OomEvent', 'request_grad_noise', 'grad_noise_requested', 'grad_noise_sample',
           'loss_nonfinite', 'true_training_value']


@dataclass(frozen=True)
class GradNoiseSample:
    """Gradient norms of one optimizer step, measured by the integration for ``measure_grad_noise``.

    Both norms are of *mean* gradients (per loss token), so they are comparable whatever the loss normalisation:
    ``small_sqnorm`` is ``|g|^2`` of the step's first forward/backward pass alone (``small_tokens`` loss tokens),
    ``big_sqnorm`` that of the whole step's accumulated gradient (``big_tokens`` loss tokens over all ranks,
    ``samples`` samples over all ranks), before clipping.
    """

    small_sqnorm: float
    small_tokens: int
    big_sqnorm: float
    big_tokens: int
    samples: int


@dataclass(frozen=True)
class OomEvent:
    """An out-of-memory error the integration recovered from during the step that just ended.

    Attributes:
        pass_size: samples in the pass that failed.
        new_cap: the samples-a-pass cap the step was retried and finished with (now the integration's limit);
            ``None`` when a one-sample pass was run again as it was (the cap did not change).
        retries: how many times the step's passes were run again.
        memory: device figures (GiB) read after freeing memory.
        pass_tokens: the failed pass's cost in tokens (:func:`~swift_dynamic_callbacks.policies.pass_cost.pass_cost`).
        new_tokens: under ``pass_tokens`` (passes cut by a token budget) the token cap the step was retried and
            finished with (``new_cap`` is then ``None``: rows are not capped); at the next step boundary the
            integration agrees the token budget later passes are planned at (a ``pass_budget`` record).
    """

    pass_size: int
    new_cap: int | None
    retries: int
    memory: Mapping[str, Any]
    pass_tokens: int | None = None
    new_tokens: int | None = None


def request_grad_noise(control: Any, enabled: bool = True) -> None:
    """Ask the integration for a :class:`GradNoiseSample` after every optimizer step (standing request)."""
    setattr(control, MEASURE_GRAD_NOISE, bool(enabled))


def grad_noise_requested(control: Any) -> bool:
    return bool(getattr(control, MEASURE_GRAD_NOISE, False))


def grad_noise_sample(control: Any) -> GradNoiseSample | None:
    """The sample of the step that just ended (``None`` when the step had a single pass or none was asked)."""
    return getattr(control, GRAD_NOISE_SAMPLE, None)


def loss_nonfinite(control: Any) -> int:
    """Steps with a non-finite loss since the previous training log line (:data:`LOSS_NONFINITE`; 0 without an
    integration)."""
    value = getattr(control, LOSS_NONFINITE, 0)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def true_training_value(control: Any, logs: Mapping[str, Any], key: str) -> Any:
    """``logs[key]`` as a decision should see it: ``loss`` of a line whose steps had a non-finite loss is NaN (HF's
    ``logging_nan_inf_filter`` logged a finite substitute). Other keys, and eval metrics, are returned as logged
    (``None`` when missing)."""
    value = logs.get(key)
    if key == 'loss' and value is not None:
        count = max(loss_nonfinite(control), int(logs.get(NONFINITE_LOG_KEY, 0) or 0))
        if count > 0:
            return math.nan
    return value

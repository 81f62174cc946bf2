"""The control flags' names and the checks of their values.

Who sets each flag, who reads it, when it is cleared and what a value asks for: the table in
``docs/control-flags.md``. A check returns the value normalised, or raises a ``ValueError`` naming
``control.<flag>`` (callbacks get it at the call site, the integration again when it reads the flags).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = [
    'SHOULD_UPDATE_DATALOADER', 'NEW_DATALOADER', 'NEW_BATCH_SIZE', 'NEW_NUM_PIECES', 'NEW_LR_SCALE',
    'NEW_LR_SCHEDULE', 'NEW_BATCH_PLAN', 'NEW_PASS_LIMIT', 'NEW_OPTIMIZER_SCALE', 'PASS_SIZE', 'PASS_COST',
    'OOM_EVENT', 'DYNAMIC_DECISIONS', 'DYNAMIC_METRICS', 'MEASURE_GRAD_NOISE', 'GRAD_NOISE_SAMPLE', 'FAIL_FAST',
    'DISABLED', 'LOSS_NONFINITE', 'NONFINITE_LOG_KEY', 'SCHEDULE_KEYS', 'STEP_SCHEDULE_KEYS', 'OPTIMIZER_SCALE_KEYS',
    'check_batch_size', 'check_num_pieces', 'check_lr_scale', 'check_lr_schedule', 'check_pass_limit',
    'check_optimizer_scale', 'check_batch_plan', 'dataloader_batch_size',
]

# ---- requests: set by callbacks, cleared by the integration once applied -----------------------------------
SHOULD_UPDATE_DATALOADER = 'should_update_dataloader'
NEW_DATALOADER = 'new_dataloader'
NEW_BATCH_SIZE = 'new_batch_size'
NEW_NUM_PIECES = 'new_num_pieces'
NEW_LR_SCALE = 'new_lr_scale'
NEW_LR_SCHEDULE = 'new_lr_schedule'
NEW_BATCH_PLAN = 'new_batch_plan'
NEW_PASS_LIMIT = 'new_pass_limit'
NEW_OPTIMIZER_SCALE = 'new_optimizer_scale'
# ---- what callbacks hand the integration ------------------------------------------------------------------
DYNAMIC_DECISIONS = 'dynamic_decisions'
DYNAMIC_METRICS = 'dynamic_metrics'
MEASURE_GRAD_NOISE = 'measure_grad_noise'
# ---- what the integration hands callbacks -----------------------------------------------------------------
PASS_SIZE = 'pass_size'
PASS_COST = 'pass_cost'
OOM_EVENT = 'oom_event'
GRAD_NOISE_SAMPLE = 'grad_noise_sample'
FAIL_FAST = 'dynamic_fail_fast'
DISABLED = 'dynamic_disabled'
LOSS_NONFINITE = 'dynamic_loss_nonfinite'
#: The key of :data:`LOSS_NONFINITE`'s count in the training log lines.
NONFINITE_LOG_KEY = 'dynamic/nonfinite_steps'

#: the keys of a ``new_lr_schedule`` (cosine) and of a step decay (``decay: 'steps'``)
SCHEDULE_KEYS = ('warmup', 'hold', 'min_ratio')
STEP_SCHEDULE_KEYS = ('warmup', 'steps')
#: the keys of ``new_optimizer_scale``
OPTIMIZER_SCALE_KEYS = ('weight_decay', 'beta2_power')


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'control.{name} must be an int >= 1, got {value!r}')
    return value


def _positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f'control.{name} must be a finite number > 0, got {value!r}')
    return float(value)


def check_batch_size(value: Any) -> int:
    """A per-device micro-batch size: an int >= 1."""
    return _positive_int(NEW_BATCH_SIZE, value)


def check_num_pieces(value: Any) -> int:
    """Passes a micro-batch runs as: an int >= 1."""
    return _positive_int(NEW_NUM_PIECES, value)


def check_lr_scale(value: Any) -> float:
    """A factor on the configured LR: a finite number > 0."""
    return _positive_float(NEW_LR_SCALE, value)


def _steps_or_fraction(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
            isinstance(value, float) and value >= 1):
        raise ValueError(f'control.{NEW_LR_SCHEDULE}[{key!r}] must be steps (int >= 0) or a fraction '
                         f'(float in [0, 1)), got {value!r}')


def check_lr_schedule(schedule: Any) -> dict[str, Any]:
    """Validate an LR schedule mapping (keys ``warmup``, ``hold``, ``min_ratio``; optional ``restarts``,
    ``guard``; or ``decay: 'steps'`` with ``warmup`` and ``steps``, ``[[start, factor], ...]``); returns a
    plain-dict copy."""
    steps = isinstance(schedule, Mapping) and schedule.get('decay', 'cosine') == 'steps'
    keys = STEP_SCHEDULE_KEYS if steps else SCHEDULE_KEYS
    if not isinstance(schedule, Mapping) or any(k not in schedule for k in keys) or schedule.get(
            'decay', 'cosine') not in ('cosine', 'steps'):
        raise ValueError(f'control.{NEW_LR_SCHEDULE} must be a mapping with keys {", ".join(SCHEDULE_KEYS)} '
                         f'(or decay: "steps" with {", ".join(STEP_SCHEDULE_KEYS)}), got {schedule!r}')
    out = dict(schedule)
    for key in ('warmup', ) if steps else ('warmup', 'hold'):
        _steps_or_fraction(key, out[key])
    out['guard'] = _positive_float(f'{NEW_LR_SCHEDULE}["guard"]', out.get('guard', 1.0))
    if steps:
        stages = []
        for stage in out['steps']:
            start, factor = stage
            _steps_or_fraction('steps', start)
            if not 0 < float(factor) <= 1:
                raise ValueError(f'control.{NEW_LR_SCHEDULE}["steps"] factors must be in (0, 1], got {factor!r}')
            stages.append([start, float(factor)])
        out['steps'] = stages
        return out
    if not 0 <= out['min_ratio'] <= 1:
        raise ValueError(f'control.{NEW_LR_SCHEDULE}["min_ratio"] must be in [0, 1], got {out["min_ratio"]!r}')
    out['restarts'] = [[int(r[0]), float(r[1]), int(r[2])] for r in out.get('restarts', ())]
    return out


def check_pass_limit(limit: Any) -> dict[str, Any]:
    """Validate a pass limit mapping (keys ``samples``, ``tokens``, ``rules``, each optional); returns a copy."""
    if not isinstance(limit, Mapping) or set(limit) - {'samples', 'tokens', 'rules'}:
        raise ValueError(f'control.{NEW_PASS_LIMIT} must be a mapping with keys samples, tokens, rules; got {limit!r}')
    out: dict[str, Any] = {'samples': None, 'tokens': None, 'rules': []}
    for key in ('samples', 'tokens'):
        if limit.get(key) is not None:
            out[key] = _positive_int(f'{NEW_PASS_LIMIT}[{key!r}]', limit[key])
    for rule in limit.get('rules') or ():
        if not isinstance(rule, (list, tuple)) or len(rule) != 2:
            raise ValueError(f'control.{NEW_PASS_LIMIT}["rules"]: each rule is [longer_than, samples], got {rule!r}')
        out['rules'].append([_positive_int(f'{NEW_PASS_LIMIT} rule length', rule[0]),
                             _positive_int(f'{NEW_PASS_LIMIT} rule samples', rule[1])])
    return out


def check_optimizer_scale(scale: Any) -> dict[str, float]:
    """Validate an optimizer scale mapping (keys :data:`OPTIMIZER_SCALE_KEYS`, finite values > 0); returns it."""
    if not isinstance(scale, Mapping) or not scale or set(scale) - set(OPTIMIZER_SCALE_KEYS):
        raise ValueError(f'control.{NEW_OPTIMIZER_SCALE} must be a mapping with keys among '
                         f'{", ".join(OPTIMIZER_SCALE_KEYS)}; got {scale!r}')
    return {k: _positive_float(f'{NEW_OPTIMIZER_SCALE}[{k!r}]', scale[k]) for k in OPTIMIZER_SCALE_KEYS if k in scale}


def check_batch_plan(plan: Any) -> dict[str, Any]:
    """Validate a batch plan mapping (:class:`~swift_dynamic_callbacks.policies.length.BatchPlan`); returns it
    complete (defaults filled in)."""
    from ..policies.length import BatchPlan
    try:
        return BatchPlan.from_json(plan).to_json()
    except (TypeError, ValueError) as e:
        raise ValueError(f'control.{NEW_BATCH_PLAN}: {e}') from None


def dataloader_batch_size(dataloader: Any) -> int:
    """Per-device batch size of a DataLoader given in ``control.new_dataloader``.

    Raises:
        ValueError: the loader has no readable batch size (e.g. a custom batch sampler without ``batch_size``).
    """
    size = getattr(dataloader, 'batch_size', None)
    if size is None:
        size = getattr(getattr(dataloader, 'batch_sampler', None), 'batch_size', None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f'control.new_dataloader: cannot read a batch size >= 1 from {type(dataloader).__name__} (got {size!r}); '
            'build it as DataLoader(dataset, batch_size=N, ...) or use control.new_batch_size = N instead')
    return size

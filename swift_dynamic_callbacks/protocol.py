"""The control-flag protocol: every attribute a pack callback may set on HF's ``TrainerControl``.

Callbacks never call the trainer. They *request* changes by setting attributes on the ``control`` object
that every HF callback event receives; one trainer-side integration (``integrations.trainer``) reads the
requests at the next optimizer-step boundary, acts on them and clears them. HF itself neither reads, clears
nor checkpoints these attributes, so their whole lifetime is defined here.

==========================  ===================  ===========================  ====================================
flag                        set by               read by                      cleared
==========================  ===================  ===========================  ====================================
``should_update_dataloader``  any callback       integration, before the      by the integration when it applies
``new_dataloader``            (seed form)        next optimizer step's        the request (next step boundary)
                                                 micro-batches are drawn
``new_batch_size``          any callback         same                         same
``new_num_pieces``          any callback         same                         same
``new_lr_scale``            any callback         same                         same
``new_lr_schedule``         any callback         same                         same
``new_batch_plan``          any callback         same                         same
``new_pass_limit``          any callback         same                         same
``new_optimizer_scale``     any callback         same                         same
``dynamic_decisions``       any callback         integration: written to the  drained (emptied) at every step
                            (append only)        decision log (rank 0)        boundary, log and save
``dynamic_metrics``         any callback         integration: merged into     never; a key keeps its last value
                            (per-key overwrite)  every training log line      until its owner overwrites it
``measure_grad_noise``      any callback         integration, at every step   never (a standing request: set it
                            (``True``)           boundary                     back to ``False`` to stop)
``grad_noise_sample``       the integration      callbacks, in                by the integration at the next step
                            (after a step's      ``on_step_end``              boundary
                            last backward)
``pass_size``               the integration      callbacks, in                overwritten every step
                            (after each step)    ``on_step_end``
``pass_cost``               the integration      callbacks, in                overwritten every step
                            (after each step,    ``on_step_end``
                            ``pass_tokens``)
``oom_event``               the integration      callbacks, in                by the integration at the next step
                            (after recovering)   ``on_step_end``              boundary
``dynamic_fail_fast``       the integration, at  the hook wrapper of every    never (the integration setting
                            train begin          pack callback                ``fail_fast`` holds for the run)
``dynamic_disabled``        the pack-off         every pack callback's hook   never (the pack is off for the run)
                            callback, at train   wrapper: every hook does
                            begin                nothing
``dynamic_loss_nonfinite``  the integration, in  callbacks, in ``on_log``:    overwritten at every training log
                            ``log``, before the  when > 0 the line's          line (the count since the previous
                            callbacks' on_log    ``loss`` is not the true     one)
                            (all ranks summed)   one
==========================  ===================  ===========================  ====================================

Semantics:

- ``should_update_dataloader = True`` with ``new_dataloader = DataLoader(same_dataset, batch_size=b)`` (the
  seed article's form) asks for per-device batch size ``b``. The integration reads the loader's batch size and
  checks that it iterates the trainer's training dataset; it never iterates that loader itself, because a fresh
  loader restarts the epoch (repeating samples). Order, position and worker settings stay the integration's.
- ``new_batch_size = b`` is the same request without building a DataLoader. ``b`` samples go into each
  micro-batch that the HF loop hands to ``training_step`` (``gradient_accumulation_steps`` of them per
  optimizer step, per device).
- ``new_num_pieces = k`` splits every micro-batch into ``k`` forward/backward passes of about ``b / k``
  samples with the same loss normalisation, so the optimizer step sees the same gradient with less memory.
- ``new_lr_scale = s`` multiplies the LR schedule (every param group, keeping their ratios) by ``s`` relative to
  the configured schedule, from the next optimizer step on. It is absolute, not cumulative (``1.0`` restores
  the configured LR). The integration scales the scheduler itself, so the LR the optimizer uses, the LR in the
  logs and the LR after a resume are the same; a scheduler it cannot scale fails with a clear error.
- ``new_lr_schedule = {...}`` replaces the *shape* of the LR schedule (the function of the step that HF's
  ``lr_scheduler_type`` gave) by a JSON-able schedule mapping evaluated by
  :func:`~swift_dynamic_callbacks.policies.lr.schedule_factor`: ``warmup``, ``hold``, ``min_ratio``, optional
  ``restarts`` (``[[step, peak, rewarmup], ...]``, steps are the trainer's optimizer steps) and ``guard``; or a
  step decay, ``decay: 'steps'`` with ``warmup``, ``steps`` (``[[start, factor], ...]``) and ``guard``. The
  integration fills in ``total`` (the schedule's horizon), puts it inside the scheduler (saved in
  ``scheduler.pt``) and sets the optimizer's LR at once; ``new_lr_scale`` still multiplies it. Each request
  replaces the previous schedule whole.
- ``new_pass_limit = {'samples': s, 'tokens': t, 'rules': [[longer_than, samples], ...]}`` caps the samples of
  one forward/backward pass (:mod:`~swift_dynamic_callbacks.policies.memory`): a micro-batch above the cap runs
  as more pieces (same gradient), whatever ``new_num_pieces`` asked. Each request replaces the previous limit
  whole; all values ``None`` removes it. After an out-of-memory error inside a step the integration retries the
  step's passes at half the pass size, lowers the limit itself and reports it in ``oom_event`` (an
  :class:`OomEvent`); ``pass_size`` is the largest pass (samples) of the step that just ended. Under
  ``pass_tokens`` (passes cut by a token budget) memory follows a pass's tokens, not its rows: an OOM lowers a
  *token* budget instead (``oom_event.new_tokens``; the integration plans later steps at it and raises it again after
  clean steps, a ``pass_budget`` record each time), ``pass_cost`` is the largest pass's cost in tokens
  (:func:`~swift_dynamic_callbacks.policies.pass_cost.pass_cost`; 0 when passes are not cut by tokens) and a
  ``tokens`` cap in ``new_pass_limit`` also lowers the budget the passes are planned at.
- ``new_optimizer_scale = {'weight_decay': w, 'beta2_power': p}`` sets every optimizer param group's weight decay
  to ``w`` times its configured value and Adam's ``beta2`` to its configured value to the power ``p`` (either key may
  be left out: that setting stays as configured). Absolute, not cumulative, like ``new_lr_scale``; the values live
  in the optimizer's param groups, so ``optimizer.pt`` saves them and a resume restores them.
- ``new_batch_plan = {...}`` (a :class:`~swift_dynamic_callbacks.policies.length.BatchPlan` as a mapping:
  ``mode`` ``token_budget``/``rules``/``balanced``, ``max_tokens``, ``rules``, ``bucketing``, ``bucket_width``,
  ``bucket_fill``, ``seed``, ``padding_free``, ``pass_tokens``) asks for length-aware batching: from the next step
  on, each micro-batch's size is decided from its samples' lengths before it is collated (at most the current batch
  size), and from the next epoch start on (at once when no sample of the epoch has been drawn) the epoch order is
  bucketed by length (``balanced``: laid out in balanced global steps, :mod:`.policies.balance`). ``padding_free``
  runs every micro-batch as one packed row; ``pass_tokens`` (balanced only) runs each rank's share of a step in as
  few passes as fit that many tokens, in the step's ``gradient_accumulation_steps`` slots (empty ones run nothing).
  Each request replaces the previous plan whole.
- A request made during step ``N`` (``on_step_end``, ``on_log``, ``on_save``, ``on_evaluate`` ...) takes effect
  from optimizer step ``N + 1``. Requests made in ``on_step_begin`` apply one step later (the micro-batches of
  the running step are already drawn).
- ``measure_grad_noise = True`` asks the integration to measure, in every optimizer step with at least two
  forward/backward passes, the squared gradient norm after the first pass and after the last one, and to hand
  them over as ``grad_noise_sample`` (a :class:`GradNoiseSample`) for the step's ``on_step_end``. It costs one
  sum of squares over the trainable parameters' gradients twice a step; no extra forward/backward pass.
- ``dynamic_fail_fast = True`` (integration setting ``fail_fast``) makes an unexpected exception inside a pack
  callback's hook end the run. Without it the hook wrapper of ``callbacks.base.DynamicCallback`` queues one
  ``fault`` decision record (callback, hook, traceback), disables that callback for the rest of the run and
  training goes on. ``ConfigError``, ``StateError`` and ``SampleTooLargeError`` (configuration
  and integrity failures) always end the run.
- ``dynamic_disabled = True`` is set when the whole pack is switched off (integration setting ``enabled: false`` or
  the environment variable ``SWIFT_DYNAMIC_CALLBACKS_DISABLE=1``) on a hand-built trainer: pack callbacks then do
  nothing at all, so the run is the plain trainer's.
- ``dynamic_loss_nonfinite = n``: ``n`` optimizer steps since the previous training log line had a non-finite
  loss (NaN / inf, any micro-batch, any rank), as ``training_step`` returned it. HF's default
  ``logging_nan_inf_filter: true`` logs such a step's loss as a finite substitute (the mean of the steps logged so
  far in the line; 0.0 with ``logging_steps: 1``), so a callback deciding from ``logs['loss']`` must treat that
  value as not finite when ``n > 0`` (:func:`true_training_value` does). The same count is in the log line as
  ``dynamic/nonfinite_steps`` (always when ``n > 0``; also ``0`` with the integration setting ``log_values``), which
  is how ``checkpoint_rotation`` recognises such a line in a checkpoint's ``trainer_state.json``.
- Two requests for the same flag before a boundary: the last one wins. So two callbacks must not request the same
  *control* (:data:`CONTROLS`): each pack callback declares the controls it requests (``DynamicCallback.controls``),
  and two listed callbacks sharing one are refused at configuration time (``config.pack.check_controls``) and, for
  hand-built trainers, at train begin (:func:`claim_controls`). Different sizes through both forms
  (``new_batch_size`` and ``new_dataloader``) at the same boundary are a conflict and raise.

Use the helpers below rather than raw ``setattr``: they validate values at the call site and keep the
unhonoured-request watchdog informed.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Callable, Iterable, Mapping

from .errors import ConfigError

logger = logging.getLogger(__name__)

SHOULD_UPDATE_DATALOADER = 'should_update_dataloader'
NEW_DATALOADER = 'new_dataloader'
NEW_BATCH_SIZE = 'new_batch_size'
NEW_NUM_PIECES = 'new_num_pieces'
NEW_LR_SCALE = 'new_lr_scale'
NEW_LR_SCHEDULE = 'new_lr_schedule'
NEW_BATCH_PLAN = 'new_batch_plan'
NEW_PASS_LIMIT = 'new_pass_limit'
NEW_OPTIMIZER_SCALE = 'new_optimizer_scale'
PASS_SIZE = 'pass_size'
PASS_COST = 'pass_cost'
OOM_EVENT = 'oom_event'
DYNAMIC_DECISIONS = 'dynamic_decisions'
DYNAMIC_METRICS = 'dynamic_metrics'
MEASURE_GRAD_NOISE = 'measure_grad_noise'
GRAD_NOISE_SAMPLE = 'grad_noise_sample'
FAIL_FAST = 'dynamic_fail_fast'
DISABLED = 'dynamic_disabled'
LOSS_NONFINITE = 'dynamic_loss_nonfinite'
#: The key of :data:`LOSS_NONFINITE`'s count in the training log lines.
NONFINITE_LOG_KEY = 'dynamic/nonfinite_steps'

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


def request_grad_noise(control: Any, enabled: bool = True) -> None:
    """Ask the integration for a :class:`GradNoiseSample` after every optimizer step (standing request)."""
    setattr(control, MEASURE_GRAD_NOISE, bool(enabled))


def grad_noise_requested(control: Any) -> bool:
    return bool(getattr(control, MEASURE_GRAD_NOISE, False))


def grad_noise_sample(control: Any) -> GradNoiseSample | None:
    """The sample of the step that just ended (``None`` when the step had a single pass or none was asked)."""
    return getattr(control, GRAD_NOISE_SAMPLE, None)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'control.{name} must be an int >= 1, got {value!r}')
    return value


def request_batch_size(control: Any, batch_size: int) -> None:
    """Ask for a new per-device micro-batch size from the next optimizer step on."""
    request(control, 'batch_size', batch_size)


def request_num_pieces(control: Any, num_pieces: int) -> None:
    """Ask for every micro-batch to be run as ``num_pieces`` forward/backward passes."""
    request(control, 'num_pieces', num_pieces)


def _positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f'control.{name} must be a finite number > 0, got {value!r}')
    return float(value)


def request_lr_scale(control: Any, scale: float) -> None:
    """Ask for the LR schedule times ``scale`` (relative to the configured LR) from the next optimizer step on."""
    request(control, 'lr_scale', scale)


SCHEDULE_KEYS = ('warmup', 'hold', 'min_ratio')
STEP_SCHEDULE_KEYS = ('warmup', 'steps')


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


@dataclass(frozen=True)
class OomEvent:
    """An out-of-memory error the integration recovered from during the step that just ended.

    Attributes:
        pass_size: samples in the pass that failed.
        new_cap: the samples-a-pass cap the step was retried and finished with (now the integration's limit);
            ``None`` when a one-sample pass was run again as it was (the cap did not change).
        retries: how many times the step's passes were run again.
        memory: device figures (GiB) read after freeing memory.
        pass_tokens: the failed pass's cost in tokens (:func:`~.policies.pass_cost.pass_cost`).
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


def request_pass_limit(control: Any, limit: Mapping[str, Any]) -> None:
    """Ask for a cap on the samples of one forward/backward pass from the next optimizer step on."""
    request(control, 'pass_limit', limit)


#: the keys of ``new_optimizer_scale``
OPTIMIZER_SCALE_KEYS = ('weight_decay', 'beta2_power')


def check_optimizer_scale(scale: Any) -> dict[str, float]:
    """Validate an optimizer scale mapping (keys :data:`OPTIMIZER_SCALE_KEYS`, finite values > 0); returns it."""
    if not isinstance(scale, Mapping) or not scale or set(scale) - set(OPTIMIZER_SCALE_KEYS):
        raise ValueError(f'control.{NEW_OPTIMIZER_SCALE} must be a mapping with keys among '
                         f'{", ".join(OPTIMIZER_SCALE_KEYS)}; got {scale!r}')
    return {k: _positive_float(f'{NEW_OPTIMIZER_SCALE}[{k!r}]', scale[k]) for k in OPTIMIZER_SCALE_KEYS if k in scale}


def request_optimizer_scale(control: Any, scale: Mapping[str, float]) -> None:
    """Ask for the optimizer's weight decay and beta2 relative to their configured values from the next step on."""
    request(control, 'optimizer_scale', scale)


def check_batch_plan(plan: Any) -> dict[str, Any]:
    """Validate a batch plan mapping (:class:`~swift_dynamic_callbacks.policies.length.BatchPlan`); returns it
    complete (defaults filled in)."""
    from .policies.length import BatchPlan
    try:
        return BatchPlan.from_json(plan).to_json()
    except (TypeError, ValueError) as e:
        raise ValueError(f'control.{NEW_BATCH_PLAN}: {e}') from None


def request_batch_plan(control: Any, plan: Mapping[str, Any]) -> None:
    """Ask for length-aware micro-batches (and bucketed epochs) from the next optimizer step on."""
    request(control, 'batch_plan', plan)


def request_lr_schedule(control: Any, schedule: Mapping[str, Any]) -> None:
    """Ask for the LR schedule's shape to be ``schedule`` from the next optimizer step on."""
    request(control, 'lr_schedule', schedule)


def _smallest(values: list[Any]) -> Any:
    return min(values)


def _largest(values: list[Any]) -> Any:
    return max(values)


def _lowest_rank(values: list[Any]) -> Any:
    return values[0]


def merge_limits(limits: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The tightest of several pass limits: the smallest samples and tokens caps, the lowest rank's rules."""
    merged: dict[str, Any] = {'rules': list(limits[0].get('rules') or [])}
    for key in ('samples', 'tokens'):
        values = [lim[key] for lim in limits if lim.get(key) is not None]
        merged[key] = min(values) if values else None
    return merged


#: decision-record kinds that change the LR schedule (``lr_schedule``'s callback writes them)
LR_RECORD_KINDS = ('lr_schedule', 'lr_restart', 'lr_guard')


@dataclass(frozen=True)
class RequestKind:
    """One kind of request, declared once in :data:`REQUESTS`; everything else derives from the declarations
    (:class:`BatchRequest`, :func:`pending_request`, :func:`clear_requests`, :data:`CONTROLS`, the requests as JSON
    and their cross-rank merge, which records tell a change, the order the integration applies them).

    Attributes:
        field: its field in :class:`BatchRequest` (and its key in a request as JSON).
        flag: the ``TrainerControl`` attribute a callback sets.
        check: validates a requested value and returns it normalised (``ValueError`` naming ``control.<flag>``).
        merge: the value every rank applies, from the ranks' values (non-``None``, in rank order).
        what: what it controls, for messages (the control's name is ``field``: two callbacks may not drive one).
        records: decision-record kinds a callback writes with this request (they go with the request: pending at the
            end, left out in replay), and with ``value_keys`` (keys in a record's values) they tell its change, so
            the integration then writes no ``control_flags`` record of its own.
        value_keys: see ``records``.
        covered_also: other record kinds that tell its change (an OOM record names the new pass cap).
        applier: the step of :class:`~.integrations.apply.RequestApplier` that applies it (``_<applier>``; the LR
            schedule and scale are applied together).
        extra_flags: other flags of the same control (the seed form of the batch size).
    """

    field: str
    flag: str
    check: Callable[[Any], Any]
    merge: Callable[[list[Any]], Any]
    what: str
    records: tuple[str, ...]
    value_keys: tuple[str, ...] = ()
    covered_also: tuple[str, ...] = ()
    applier: str = ''
    extra_flags: tuple[str, ...] = ()


#: Every request kind, in the order the integration applies them (the batch before the plan cut from it; the LR
#: after both; the optimizer's settings last). A new kind is one entry here and its ``_<applier>`` method.
REQUESTS: tuple[RequestKind, ...] = (
    RequestKind('batch_size', NEW_BATCH_SIZE, lambda v: _positive_int(NEW_BATCH_SIZE, v), _smallest,
                'the per-device batch size', ('batch_size', ), applier='batch_size',
                extra_flags=(SHOULD_UPDATE_DATALOADER, NEW_DATALOADER)),
    RequestKind('batch_plan', NEW_BATCH_PLAN, lambda v: check_batch_plan(v), _lowest_rank, 'the batch plan',
                ('batch_plan', ), applier='batch_plan'),
    RequestKind('num_pieces', NEW_NUM_PIECES, lambda v: _positive_int(NEW_NUM_PIECES, v), _largest,
                'the pieces per micro-batch', ('num_pieces', ), ('num_pieces', ), applier='num_pieces'),
    RequestKind('pass_limit', NEW_PASS_LIMIT, lambda v: check_pass_limit(v), merge_limits, 'the pass limit',
                ('pass_limit', ), covered_also=('oom', ), applier='pass_limit'),
    RequestKind('lr_schedule', NEW_LR_SCHEDULE, lambda v: check_lr_schedule(v), _lowest_rank, 'the LR schedule',
                LR_RECORD_KINDS, applier='lr'),
    RequestKind('lr_scale', NEW_LR_SCALE, lambda v: _positive_float(NEW_LR_SCALE, v), _smallest, 'the LR scale',
                ('lr_scale', ), ('lr_scale', ), applier='lr'),
    RequestKind('optimizer_scale', NEW_OPTIMIZER_SCALE, lambda v: check_optimizer_scale(v), _lowest_rank,
                'the optimizer\'s weight decay and beta2', ('optimizer_scale', ), ('optimizer_scale', ),
                applier='optimizer_scale'),
)
KINDS: dict[str, RequestKind] = {kind.field: kind for kind in REQUESTS}

#: Flags that request a change and are cleared once the integration applied them.
REQUEST_FLAGS = (SHOULD_UPDATE_DATALOADER, NEW_DATALOADER) + tuple(kind.flag for kind in REQUESTS)
#: Every attribute this protocol defines on ``TrainerControl``.
ALL_FLAGS = REQUEST_FLAGS + (DYNAMIC_DECISIONS, DYNAMIC_METRICS, MEASURE_GRAD_NOISE, GRAD_NOISE_SAMPLE, PASS_SIZE,
                             PASS_COST, OOM_EVENT, FAIL_FAST, DISABLED, LOSS_NONFINITE)

#: Controls: what a callback drives through request flags that hold one value per step boundary (the last request
#: wins). ``control -> (what it is, the flags)``. A callback declares the controls it requests (``controls``); two
#: callbacks of one run declaring the same control are refused.
CONTROLS: dict[str, tuple[str, tuple[str, ...]]] = {
    kind.field: (kind.what, (kind.flag, ) + kind.extra_flags) for kind in REQUESTS}


def _empty(self: Any) -> bool:
    return all(getattr(self, kind.field) is None for kind in REQUESTS)


#: What the pending flags ask for, read in one place: one field per :data:`REQUESTS` entry (``None``: not asked),
#: and ``via_dataloader`` (the size came from the seed form, ``new_dataloader``); ``empty``: nothing asked.
BatchRequest = make_dataclass(
    'BatchRequest', [(kind.field, Any, field(default=None)) for kind in REQUESTS]
    + [('via_dataloader', bool, field(default=False))], frozen=True,
    namespace={'empty': property(_empty), '__module__': __name__,
               '__doc__': 'What the pending request flags ask for: one field per request kind (protocol.REQUESTS), '
                          'None when not asked, and via_dataloader (the seed form).'})


def request(control: Any, field_name: str, value: Any) -> None:
    """Set request ``field_name`` (a :data:`REQUESTS` field) on ``control``, validated now, at the call site."""
    kind = KINDS[field_name]
    setattr(control, kind.flag, kind.check(value))


def merge_requests(requests: Iterable[Any]) -> Any:
    """The one request every rank applies: each kind's ``merge`` over the ranks' values (identical requests pass;
    otherwise the smallest batch and LR scale, most pieces, the tightest pass limit, the lowest rank's LR schedule,
    plan and optimizer scale)."""
    requests = list(requests)
    values = {}
    for kind in REQUESTS:
        asked = [getattr(r, kind.field) for r in requests if getattr(r, kind.field) is not None]
        values[kind.field] = kind.merge(asked) if asked else None
    return BatchRequest(**values, via_dataloader=any(r.via_dataloader for r in requests))


def is_request_record(record: Any) -> bool:
    """A decision record that goes with a request (applied at the next step boundary): one of the kinds a request
    kind declares, or one holding one of their value keys."""
    return any(record.kind in kind.records or any(k in record.values for k in kind.value_keys) for kind in REQUESTS)


def covering(field_name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(record kinds, value keys)`` of held records that already tell a change of request ``field_name``."""
    kind = KINDS[field_name]
    return kind.records + kind.covered_also, kind.value_keys


def request_dataloader(control: Any, dataloader: Any) -> None:
    """The seed article's form: ``should_update_dataloader = True`` and ``new_dataloader = dataloader``."""
    dataloader_batch_size(dataloader)  # validates now, at the call site
    control.should_update_dataloader = True
    control.new_dataloader = dataloader


def record_decision(control: Any, record: Any) -> None:
    """Queue a :class:`~swift_dynamic_callbacks.records.DecisionRecord` for the decision log."""
    queue = getattr(control, DYNAMIC_DECISIONS, None)
    if queue is None:
        queue = []
        setattr(control, DYNAMIC_DECISIONS, queue)
    queue.append(record)


def publish_metrics(control: Any, values: Mapping[str, float]) -> None:
    """Set numbers that the integration merges into every training log line (``logging.jsonl``, TensorBoard)."""
    board = getattr(control, DYNAMIC_METRICS, None)
    if board is None:
        board = {}
        setattr(control, DYNAMIC_METRICS, board)
    for key, value in values.items():
        board[key] = float(value)


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


def pending_request(control: Any) -> BatchRequest:
    """Read (without clearing) what the request flags ask for."""
    via_dataloader = bool(getattr(control, SHOULD_UPDATE_DATALOADER, False))
    batch_size = getattr(control, NEW_BATCH_SIZE, None)
    if via_dataloader:
        loader = getattr(control, NEW_DATALOADER, None)
        if loader is None:
            raise ValueError('control.should_update_dataloader is True but control.new_dataloader is None; '
                             'set both (seed form) or set control.new_batch_size instead')
        loader_size = dataloader_batch_size(loader)
        if batch_size is not None and batch_size != loader_size:
            raise ValueError(f'conflicting requests: control.new_batch_size={batch_size} but '
                             f'control.new_dataloader has batch_size={loader_size}')
        batch_size = loader_size
    elif getattr(control, NEW_DATALOADER, None) is not None:
        raise ValueError('control.new_dataloader is set but control.should_update_dataloader is not True; '
                         'set control.should_update_dataloader = True to request the change')
    values = {kind.field: getattr(control, kind.flag, None) for kind in REQUESTS}
    values['batch_size'] = batch_size
    return BatchRequest(**{k: None if v is None else KINDS[k].check(v) for k, v in values.items()},
                        via_dataloader=via_dataloader)


def has_pending_request(control: Any) -> bool:
    """Whether any request flag (:data:`REQUEST_FLAGS`) is set."""
    return bool(getattr(control, SHOULD_UPDATE_DATALOADER, False)) or any(
        getattr(control, flag, None) is not None for flag in REQUEST_FLAGS if flag != SHOULD_UPDATE_DATALOADER)


def clear_requests(control: Any) -> None:
    """Reset the request flags (the integration calls this once it has applied them)."""
    for flag in REQUEST_FLAGS:
        setattr(control, flag, False if flag == SHOULD_UPDATE_DATALOADER else None)


def drain_decisions(control: Any) -> list:
    """Take and empty the queue of decision records."""
    queue = getattr(control, DYNAMIC_DECISIONS, None) or []
    setattr(control, DYNAMIC_DECISIONS, [])
    return list(queue)


def current_metrics(control: Any) -> dict[str, float]:
    return dict(getattr(control, DYNAMIC_METRICS, None) or {})


_warned_unhonoured = False


def warn_if_unhonoured(control: Any, where: str) -> bool:
    """Warn once, loudly, when a request flag is still set at a point where an integration would have cleared it.

    Pack callbacks call this from ``on_step_begin``: with an integration installed, requests made up to the
    previous ``on_step_end`` are cleared before the next step begins. Returns True when it warned.
    """
    global _warned_unhonoured
    if not has_pending_request(control) or getattr(control, '_sdc_integration', False):
        return False
    if not _warned_unhonoured:
        _warned_unhonoured = True
        message = (f'swift-dynamic-callbacks: a batch-size request on the trainer control was not honoured ({where}). '
                   'No integration is installed on this trainer, so the request does nothing. With ms-swift, list the '
                   'pack callbacks in `callbacks:`; with a hand-built trainer call '
                   '`swift_dynamic_callbacks.install(trainer)` before train().')
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return True


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

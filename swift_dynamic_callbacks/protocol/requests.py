"""Request kinds: what a callback may ask the integration to change at the next optimizer-step boundary.

Each kind is declared once, in :data:`REQUESTS` (a :class:`RequestKind`); :class:`BatchRequest`, reading
(:func:`pending_request`) and clearing (:func:`clear_requests`) the flags, :data:`CONTROLS`, the cross-rank merge
(:func:`merge_requests`) and the records that tell a change all derive from the declarations. Callbacks set a request
with :func:`request` or a ``request_<field>`` helper (validated at the call site) rather than a raw ``setattr``; a
request nobody honours is warned about once (:func:`warn_if_unhonoured`).

What each request asks for, and when it takes effect: ``docs/control-flags.md``.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Callable, Iterable, Mapping

from .flags import (DISABLED, DYNAMIC_DECISIONS, DYNAMIC_METRICS, FAIL_FAST, GRAD_NOISE_SAMPLE, LOSS_NONFINITE,
                    MEASURE_GRAD_NOISE, NEW_BATCH_PLAN, NEW_BATCH_SIZE, NEW_DATALOADER, NEW_LR_SCALE, NEW_LR_SCHEDULE,
                    NEW_NUM_PIECES, NEW_OPTIMIZER_SCALE, NEW_PASS_LIMIT, OOM_EVENT, PASS_COST, PASS_SIZE,
                    SHOULD_UPDATE_DATALOADER, check_batch_plan, check_batch_size, check_lr_scale, check_lr_schedule,
                    check_num_pieces, check_optimizer_scale, check_pass_limit, dataloader_batch_size)

__all__ = ['LR_RECORD_KINDS', 'RequestKind', 'REQUESTS', 'KINDS', 'REQUEST_FLAGS', 'ALL_FLAGS', 'CONTROLS',
           'BatchRequest', 'request', 'request_batch_size', 'request_num_pieces', 'request_lr_scale',
           'request_lr_schedule', 'request_batch_plan', 'request_pass_limit', 'request_optimizer_scale',
           'request_dataloader', 'pending_request', 'has_pending_request', 'clear_requests', 'merge_requests',
           'merge_limits', 'is_request_record', 'covering', 'warn_if_unhonoured']

logger = logging.getLogger(__name__)


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
        applier: the step of :class:`~swift_dynamic_callbacks.integrations.apply.RequestApplier` that applies it
            (``_<applier>``; the LR schedule and scale are applied together).
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
    RequestKind('batch_size', NEW_BATCH_SIZE, check_batch_size, _smallest, 'the per-device batch size',
                ('batch_size', ), applier='batch_size', extra_flags=(SHOULD_UPDATE_DATALOADER, NEW_DATALOADER)),
    RequestKind('batch_plan', NEW_BATCH_PLAN, check_batch_plan, _lowest_rank, 'the batch plan', ('batch_plan', ),
                applier='batch_plan'),
    RequestKind('num_pieces', NEW_NUM_PIECES, check_num_pieces, _largest, 'the pieces per micro-batch',
                ('num_pieces', ), ('num_pieces', ), applier='num_pieces'),
    RequestKind('pass_limit', NEW_PASS_LIMIT, check_pass_limit, merge_limits, 'the pass limit', ('pass_limit', ),
                covered_also=('oom', ), applier='pass_limit'),
    RequestKind('lr_schedule', NEW_LR_SCHEDULE, check_lr_schedule, _lowest_rank, 'the LR schedule', LR_RECORD_KINDS,
                applier='lr'),
    RequestKind('lr_scale', NEW_LR_SCALE, check_lr_scale, _smallest, 'the LR scale', ('lr_scale', ), ('lr_scale', ),
                applier='lr'),
    RequestKind('optimizer_scale', NEW_OPTIMIZER_SCALE, check_optimizer_scale, _lowest_rank,
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


def request_batch_size(control: Any, batch_size: int) -> None:
    """Ask for a new per-device micro-batch size from the next optimizer step on."""
    request(control, 'batch_size', batch_size)


def request_num_pieces(control: Any, num_pieces: int) -> None:
    """Ask for every micro-batch to be run as ``num_pieces`` forward/backward passes."""
    request(control, 'num_pieces', num_pieces)


def request_lr_scale(control: Any, scale: float) -> None:
    """Ask for the LR schedule times ``scale`` (relative to the configured LR) from the next optimizer step on."""
    request(control, 'lr_scale', scale)


def request_lr_schedule(control: Any, schedule: Mapping[str, Any]) -> None:
    """Ask for the LR schedule's shape to be ``schedule`` from the next optimizer step on."""
    request(control, 'lr_schedule', schedule)


def request_batch_plan(control: Any, plan: Mapping[str, Any]) -> None:
    """Ask for length-aware micro-batches (and bucketed epochs) from the next optimizer step on."""
    request(control, 'batch_plan', plan)


def request_pass_limit(control: Any, limit: Mapping[str, Any]) -> None:
    """Ask for a cap on the samples of one forward/backward pass from the next optimizer step on."""
    request(control, 'pass_limit', limit)


def request_optimizer_scale(control: Any, scale: Mapping[str, float]) -> None:
    """Ask for the optimizer's weight decay and beta2 relative to their configured values from the next step on."""
    request(control, 'optimizer_scale', scale)


def request_dataloader(control: Any, dataloader: Any) -> None:
    """The seed article's form: ``should_update_dataloader = True`` and ``new_dataloader = dataloader``."""
    dataloader_batch_size(dataloader)  # validates now, at the call site
    control.should_update_dataloader = True
    control.new_dataloader = dataloader


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

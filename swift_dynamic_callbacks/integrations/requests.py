"""Requests at the step boundary: agreeing the ranks' requests on one, and the ``applied_request`` records that
replay reads back. No trainer code."""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from typing import Any, Iterable, Mapping

from .. import distributed, protocol
from ..config import ConfigError
from ..records import DECISIONS_FILE, DecisionRecord
from ..state import StateError

LR_RECORD_KINDS = ('lr_schedule', 'lr_restart', 'lr_guard')


def changes_lr(record: DecisionRecord) -> bool:
    return 'lr_scale' in record.values or record.kind in LR_RECORD_KINDS


def is_request_record(record: DecisionRecord) -> bool:
    """A record that goes with a batch-size / pieces / LR request (applied at the next step boundary)."""
    return record.kind in ('batch_size', 'num_pieces', 'lr_scale', 'pass_limit') + LR_RECORD_KINDS or any(
        k in record.values for k in ('num_pieces', 'lr_scale'))


def request_to_json(request: protocol.BatchRequest) -> dict[str, Any]:
    """The ``values`` of an ``applied_request`` record: the request's set fields (JSON-able)."""
    return {k: v for k, v in asdict(request).items() if v is not None and not (k == 'via_dataloader' and not v)}


_SETTERS = {
    'batch_size': protocol.request_batch_size,
    'num_pieces': protocol.request_num_pieces,
    'lr_scale': protocol.request_lr_scale,
    'lr_schedule': protocol.request_lr_schedule,
    'batch_plan': protocol.request_batch_plan,
    'pass_limit': protocol.request_pass_limit,
    'optimizer_scale': protocol.request_optimizer_scale,
}


def set_request(control: Any, values: Mapping[str, Any]) -> None:
    """Set the request flags on ``control`` from a request's fields (``None`` fields are left alone), validated like
    a callback's request.

    Raises:
        ValueError: an unknown field or a value the protocol rejects.
    """
    unknown = sorted(set(values) - set(_SETTERS) - {'via_dataloader'})
    if unknown:
        raise ValueError(f'unknown request field(s) {", ".join(unknown)}')
    for key, setter in _SETTERS.items():
        if values.get(key) is not None:
            setter(control, values[key])


def request_from_json(values: Mapping[str, Any]) -> protocol.BatchRequest:
    """A request from an ``applied_request`` record's ``values``, validated like a callback's request."""
    from types import SimpleNamespace
    box = SimpleNamespace()
    protocol.clear_requests(box)
    set_request(box, values)
    return replace(protocol.pending_request(box), via_dataloader=bool(values.get('via_dataloader', False)))


def load_replay(path: str) -> dict[int, protocol.BatchRequest]:
    """``step -> request`` from the ``applied_request`` records of a decision log (a later record for the same step,
    e.g. from a resumed run appending to the same log, replaces an earlier one).

    Raises:
        ConfigError: the file does not exist.
        StateError: a record cannot be read back as a request.
    """
    from ..records import read_decisions
    file = os.path.join(path, DECISIONS_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ConfigError(f'dynamic_callbacks.integration.replay: {path!r} is not a decision log (no such file)')
    out: dict[int, protocol.BatchRequest] = {}
    try:
        rows = read_decisions(file)
    except (OSError, ValueError) as e:
        raise StateError(f'replay: cannot read {file}: {e}') from e
    for row in rows:
        if row.get('kind') != 'applied_request':
            continue
        try:
            out[int(row['step'])] = request_from_json(row.get('values') or {})
        except (KeyError, TypeError, ValueError) as e:
            raise StateError(f'replay: {file}: bad applied_request record at step {row.get("step")}: {e}') from e
    return out


def agree_step(request: protocol.BatchRequest, oom: DecisionRecord | None
               ) -> tuple[protocol.BatchRequest, list[DecisionRecord]]:
    """The request every rank applies at this boundary (:func:`merge_requests`) and every rank's OOM record of the
    last step, in rank order. Collective: one small all-reduce decides whether any rank has something to agree on
    (most boundaries: nothing); only then are the requests and OOM records gathered."""
    if distributed.sum_ints([int(not request.empty or oom is not None)])[0]:
        return distributed.agree((request, oom), merge_step)
    return request, []


def merge_step(votes: Iterable[tuple[protocol.BatchRequest, DecisionRecord | None]]
                ) -> tuple[protocol.BatchRequest, list[DecisionRecord]]:
    """The merged request (:func:`merge_requests`) and the OOM records of all ranks, in rank order."""
    votes = list(votes)
    return merge_requests(v[0] for v in votes), [v[1] for v in votes if v[1] is not None]


def merge_requests(requests: Iterable[protocol.BatchRequest]) -> protocol.BatchRequest:
    """The one request all ranks apply: identical requests pass; otherwise the smallest batch and LR scale, most
    pieces, and the lowest rank's LR schedule, plan and optimizer scale."""
    requests = list(requests)
    sizes = [r.batch_size for r in requests if r.batch_size is not None]
    pieces = [r.num_pieces for r in requests if r.num_pieces is not None]
    scales = [r.lr_scale for r in requests if r.lr_scale is not None]
    schedules = [r.lr_schedule for r in requests if r.lr_schedule is not None]
    limits = [r.pass_limit for r in requests if r.pass_limit is not None]
    return protocol.BatchRequest(
        batch_size=min(sizes) if sizes else None,
        num_pieces=max(pieces) if pieces else None,
        lr_scale=min(scales) if scales else None,
        lr_schedule=schedules[0] if schedules else None,
        pass_limit=merge_limits(limits) if limits else None,
        batch_plan=next((r.batch_plan for r in requests if r.batch_plan is not None), None),
        optimizer_scale=next((r.optimizer_scale for r in requests if r.optimizer_scale is not None), None),
        via_dataloader=any(r.via_dataloader for r in requests))


def merge_limits(limits: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The tightest of several pass limits: the smallest samples and tokens caps, the lowest rank's rules."""
    merged: dict[str, Any] = {'rules': list(limits[0].get('rules') or [])}
    for key in ('samples', 'tokens'):
        values = [lim[key] for lim in limits if lim.get(key) is not None]
        merged[key] = min(values) if values else None
    return merged

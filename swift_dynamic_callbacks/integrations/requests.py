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

def changes_lr(record: DecisionRecord) -> bool:
    """A record whose request changes the LR (a scale, or an LR schedule's)."""
    return 'lr_scale' in record.values or record.kind in protocol.LR_RECORD_KINDS


def request_to_json(request: protocol.BatchRequest) -> dict[str, Any]:
    """The ``values`` of an ``applied_request`` record: the request's set fields (JSON-able)."""
    return {k: v for k, v in asdict(request).items() if v is not None and not (k == 'via_dataloader' and not v)}


def set_request(control: Any, values: Mapping[str, Any]) -> None:
    """Set the request flags on ``control`` from a request's fields (``None`` fields are left alone), validated like
    a callback's request (``protocol.REQUESTS``).

    Raises:
        ValueError: an unknown field or a value the protocol rejects.
    """
    unknown = sorted(set(values) - set(protocol.KINDS) - {'via_dataloader'})
    if unknown:
        raise ValueError(f'unknown request field(s) {", ".join(unknown)}')
    for kind in protocol.REQUESTS:
        if values.get(kind.field) is not None:
            protocol.request(control, kind.field, values[kind.field])


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


def agree_step(request: protocol.BatchRequest, records: list[DecisionRecord], fitted: int = 0
               ) -> tuple[protocol.BatchRequest, list[DecisionRecord], int]:
    """The request every rank applies at this boundary (``protocol.merge_requests``), every rank's records of the
    last step that the others must know (its OOM, its packed-attention fallback), in rank order, and the largest of
    the ranks' ``fitted`` (the largest pass that ran clean in the step). Collective: one small all-reduce decides
    whether any rank has something to agree on (most boundaries: nothing) and takes the largest ``fitted``; only then
    are the requests and records gathered."""
    anything, fitted = distributed.max_ints([int(not request.empty or bool(records)), fitted])
    if anything:
        request, shared = distributed.agree((request, list(records)), merge_step)
        return request, shared, fitted
    return request, [], fitted


def merge_step(votes: Iterable[tuple[protocol.BatchRequest, list[DecisionRecord]]]
                ) -> tuple[protocol.BatchRequest, list[DecisionRecord]]:
    """The merged request (``protocol.merge_requests``) and the records of all ranks, in rank order."""
    votes = list(votes)
    return protocol.merge_requests(v[0] for v in votes), [r for v in votes for r in v[1]]

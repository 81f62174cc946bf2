"""Which decision record is written, once, and when.

Callbacks queue their records on ``control`` (``protocol.record_decision``); the integration's parts hold theirs
here (:meth:`Decisions.hold`). Held records are written at the next step boundary (:meth:`Decisions.flush`), after the
boundary's request is applied, so that the LR change a request caused can be added to the record that asked for it.
Records that need no such completion are written at once (:meth:`Decisions.write`). Every record is stamped with
where training was (step, epoch, samples seen) and written on rank 0 only (:class:`~..records.DecisionLog`).

The de-duplication rule is declared with each request kind (``protocol.RequestKind``: ``records``, ``value_keys``,
``covered_also``): the integration writes its own ``control_flags`` record for an applied request field only when no
held record already says it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping

from .. import protocol
from ..records import DecisionLog, DecisionRecord

#: ``() -> (step, epoch, samples seen on this rank)``: where training is, for the stamp of a record
Where = Callable[[], tuple[int, float, int]]


class Decisions:
    """The decision log of one run and the records held for the next step boundary.

    Args:
        where: the stamp of a record written now.

    State: the held records (saved with the integration's state, so a resume writes them exactly once).
    """

    def __init__(self, where: Where) -> None:
        self.log = DecisionLog(None, enabled=False)
        self.held: list[DecisionRecord] = []
        self._where = where

    def open(self, path: str, *, enabled: bool) -> None:
        """Write to ``path`` from now on (``enabled``: this is rank 0)."""
        self.log = DecisionLog(path, enabled=enabled)

    @property
    def records(self) -> list[DecisionRecord]:
        """Every record written in this process (on every rank), in order."""
        return self.log.records

    def write(self, record: DecisionRecord) -> None:
        """Stamp ``record`` with where training is (fields it sets itself are kept) and write it now."""
        step, epoch, samples = self._where()
        self.log.write(record.stamped(step=step, epoch=epoch, samples_seen=samples))

    def hold(self, record: DecisionRecord) -> None:
        """Write ``record`` at the next step boundary (after the boundary's request is applied)."""
        self.held.append(record)

    def hold_all(self, records: Iterable[DecisionRecord]) -> None:
        self.held.extend(records)

    def drain(self, control: Any) -> None:
        """Hold the records the callbacks queued on ``control``."""
        self.held.extend(protocol.drain_decisions(control))

    def flush(self) -> None:
        """Write every held record, in order."""
        held, self.held = self.held, []
        for record in held:
            self.write(record)

    # ---- the rules ----------------------------------------------------------------------------------------
    def holds(self, kind: str) -> bool:
        return any(r.kind == kind for r in self.held)

    def covers(self, field: str) -> bool:
        """Whether a held record already tells the change of request field ``field`` (``protocol.covering``)."""
        kinds, keys = protocol.covering(field)
        return any(r.kind in kinds or any(k in r.values for k in keys) for r in self.held)

    def complete(self, match: Callable[[DecisionRecord], bool], values: Mapping[str, Any], note: str = '') -> None:
        """Add ``values`` (and ``note`` to the message) to every held record that ``match`` selects."""
        self.held = [replace(r, values={**r.values, **values},
                             message=f'{r.message}; {note}'.lstrip('; ') if note else r.message) if match(r) else r
                     for r in self.held]

    def mark_pending(self) -> None:
        """Training ends with a request not applied: its records say it is pending (a resumed run applies it)."""
        self.complete(protocol.is_request_record, {'pending': True},
                      'pending at the end of training (a resumed run applies it)')

    def drop_callback_requests(self) -> None:
        """Replay: the callbacks' request records are not written (the recorded requests are applied)."""
        self.held = [r for r in self.held if r.source == 'integration' or not protocol.is_request_record(r)]

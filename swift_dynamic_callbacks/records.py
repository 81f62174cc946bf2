"""Decision records: one structured record per dynamic decision, one JSON Lines sink.

Every change the pack makes (batch size, pieces, and later LR, stop, deletion ...) is a
:class:`DecisionRecord`. Callbacks queue them on ``control`` (``protocol.record_decision``); the integration
stamps step/epoch/samples, writes them to ``<output_dir>/dynamic_decisions.jsonl`` on rank 0 only and logs a
one-line summary.

Format (one JSON object per line)::

    {"step": 12, "epoch": 0.48, "samples_seen": 48, "source": "batch_schedule", "kind": "batch_size",
     "reason": "schedule", "values": {"old": 2, "new": 4}, "message": "...", "rank": 0, "time": 1732290000.0}
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

logger = logging.getLogger(__name__)

DECISIONS_FILE = 'dynamic_decisions.jsonl'


@dataclass(frozen=True)
class DecisionRecord:
    """One dynamic decision.

    Attributes:
        source: who decided (callback ``state_key`` or ``"integration"``).
        kind: what changed, e.g. ``"batch_size"``, ``"num_pieces"``, ``"resume"``.
        reason: why, a short machine-readable word (``"schedule"``, ``"request"``, ...).
        values: the numbers of the decision (``old``/``new`` and anything else useful), JSON-serialisable.
        message: optional human sentence.
        step: optimizer step the decision takes effect at (stamped by the integration when left ``None``).
        epoch, samples_seen: where training was (stamped by the integration).
        time: wall-clock seconds since the epoch.
    """

    source: str
    kind: str
    reason: str
    values: dict[str, Any] = field(default_factory=dict)
    message: str = ''
    step: int | None = None
    epoch: float | None = None
    samples_seen: int | None = None
    time: float = field(default_factory=time.time)

    def stamped(self, *, step: int, epoch: float, samples_seen: int) -> 'DecisionRecord':
        return replace(
            self,
            step=self.step if self.step is not None else step,
            epoch=self.epoch if self.epoch is not None else epoch,
            samples_seen=self.samples_seen if self.samples_seen is not None else samples_seen)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        values = ', '.join(f'{k}={v}' for k, v in self.values.items())
        text = f'step {self.step}: {self.source} {self.kind} ({self.reason}) {values}'
        return f'{text} - {self.message}' if self.message else text


class DecisionLog:
    """Append-only JSON Lines sink for :class:`DecisionRecord` (writes only where ``enabled``, i.e. rank 0).

    Records are also kept in memory (``records``) on every rank so tests and reports can read them.
    A file that cannot be written (full disk, no permission: ``OSError``) does not stop training: one warning names
    the error (``write_error``), writing to the file stops for the rest of the run, the records stay in memory and
    in the console log.
    """

    def __init__(self, path: str | os.PathLike | None, *, enabled: bool = True) -> None:
        self.path = None if path is None else os.fspath(path)
        self.enabled = enabled and path is not None
        self.records: list[DecisionRecord] = []
        self.write_error: str | None = None

    def write(self, record: DecisionRecord) -> None:
        self.records.append(record)
        logger.info('[dynamic] %s', record.summary())
        if not self.enabled:
            return
        line = json.dumps(record.to_json(), ensure_ascii=False, default=str) + '\n'
        try:
            os.makedirs(os.path.dirname(self.path) or '.', exist_ok=True)
            with open(self.path, 'a', encoding='utf-8') as f:
                f.write(line)
        except OSError as e:
            self.enabled = False
            self.write_error = f'{type(e).__name__}: {e}'
            logger.warning('[dynamic] cannot write the decision log %s (%s); it is not written for the rest of the '
                           'run (training goes on; decisions stay in the console log)', self.path, self.write_error)


def read_decisions(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a decision log (a file or an output directory)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, DECISIONS_FILE)
    with open(path, encoding='utf-8') as f:
        return [json.loads(line) for line in f if line.strip()]

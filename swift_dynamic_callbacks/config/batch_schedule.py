"""Settings of the ``batch_schedule`` callback (YAML key ``dynamic_callbacks.batch_schedule``); no torch imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from . import Choice, ConfigError, IntTable, Settings, setting


@dataclass(frozen=True)
class BatchScheduleConfig(Settings):
    """Settings of :class:`BatchScheduleCallback` (YAML key ``dynamic_callbacks.batch_schedule``).

    Attributes:
        schedule: ``{step: per-device batch size}``; the size holds from that 0-based optimizer step on
            (``{0: 2, 10: 4}``: 2 for the first 10 steps, then 4). Keys >= 0, sizes >= 1.
        pieces: ``{step: pieces per micro-batch}``, same convention (optional).
        via: ``"batch_size"`` sets ``control.new_batch_size``; ``"dataloader"`` uses the seed article's form
            (``should_update_dataloader`` + ``new_dataloader``).
    """

    schedule: Mapping[int, int] = setting(IntTable(1, what='step: batch_size'), default_factory=dict)
    pieces: Mapping[int, int] = setting(IntTable(1, what='step: pieces'), default_factory=dict)
    via: str = setting(Choice(('batch_size', 'dataloader')), 'batch_size')

    controls = ('batch_size', 'num_pieces')

    def cross_checks(self) -> None:
        if not self.schedule and not self.pieces:
            raise ConfigError('schedule: give at least one {step: batch_size} entry (or pieces), got none')

    @property
    def splits_micro_batches(self) -> bool:
        """Whether the pieces table ever asks for more than one pass a micro-batch."""
        return any(p > 1 for p in self.pieces.values())

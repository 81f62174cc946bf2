"""Batch size (and pieces) from an explicit step table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from torch.utils.data import DataLoader

from .. import protocol
from ..config import ConfigError, check_choice, check_int
from ..policies.schedule import changes_at, scheduled_value
from ..records import DecisionRecord
from .base import DynamicCallback


def _int_table(name: str, table: Any, minimum_value: int) -> dict[int, int]:
    if not isinstance(table, Mapping):
        raise ConfigError(f'{name}: expected a mapping {{step: value}}, got {table!r}')
    out: dict[int, int] = {}
    for key, value in table.items():
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        check_int(f'{name} key {key!r}', key, minimum=0)
        check_int(f'{name}[{key}]', value, minimum=minimum_value)
        out[key] = value
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class BatchScheduleConfig:
    """Settings of :class:`BatchScheduleCallback` (YAML key ``dynamic_callbacks.batch_schedule``).

    Attributes:
        schedule: ``{step: per-device batch size}``; the size holds from that 0-based optimizer step on
            (``{0: 2, 10: 4}``: 2 for the first 10 steps, then 4). Keys >= 0, sizes >= 1.
        pieces: ``{step: pieces per micro-batch}``, same convention (optional).
        via: ``"batch_size"`` sets ``control.new_batch_size``; ``"dataloader"`` uses the seed article's form
            (``should_update_dataloader`` + ``new_dataloader``).
    """

    schedule: Mapping[int, int] = field(default_factory=dict)
    pieces: Mapping[int, int] = field(default_factory=dict)
    via: str = 'batch_size'

    def __post_init__(self) -> None:
        object.__setattr__(self, 'schedule', _int_table('schedule', self.schedule, 1))
        object.__setattr__(self, 'pieces', _int_table('pieces', self.pieces, 1))
        if not self.schedule and not self.pieces:
            raise ConfigError('schedule: give at least one {step: batch_size} entry (or pieces), got none')
        check_choice('via', self.via, ('batch_size', 'dataloader'))


class BatchScheduleCallback(DynamicCallback):
    """Requests the batch size (and pieces) that a step table gives.

    Hooks: ``on_train_begin`` (requests the size in effect at the start or resume step), ``on_step_end``
    (requests the next size when the table changes at the next step).
    Flags set: ``new_batch_size`` or ``should_update_dataloader`` + ``new_dataloader``; ``new_num_pieces``;
    ``dynamic_decisions``. State: none (the table is a pure function of the step, so resume needs nothing).
    """

    name = 'batch_schedule'
    config_class = BatchScheduleConfig

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self._request(state.global_step, control, train_dataloader, force=True)

    def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
        self._request(state.global_step, control, train_dataloader, force=False)

    def _request(self, step: int, control: Any, train_dataloader: Any, *, force: bool) -> None:
        """Request each table's value when it changes at ``step`` (every value when ``force``)."""

        def request_size(size: int) -> None:
            if self.config.via == 'dataloader':
                if train_dataloader is None:
                    raise RuntimeError('batch_schedule via=dataloader needs the train_dataloader callback argument')
                protocol.request_dataloader(control, DataLoader(train_dataloader.dataset, batch_size=size))
            else:
                protocol.request_batch_size(control, size)

        tables = (('batch_size', self.config.schedule, request_size),
                  ('num_pieces', self.config.pieces, lambda pieces: protocol.request_num_pieces(control, pieces)))
        for kind, table, request in tables:
            value = scheduled_value(table, step)
            if value is None or not (force or changes_at(table, step)):
                continue
            request(value)
            if not force:  # at the start the integration records whether anything changed
                protocol.record_decision(
                    control,
                    DecisionRecord(self.name, kind, 'schedule', {
                        'old': scheduled_value(table, step - 1),
                        'new': value
                    }, step=step))

"""Batch size (and pieces) from an explicit step table."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from .. import protocol
from ..config.batch_schedule import BatchScheduleConfig
from ..policies.schedule import changes_at, scheduled_value
from ..records import DecisionRecord
from .base import DynamicCallback


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

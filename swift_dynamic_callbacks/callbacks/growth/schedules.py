"""Growth by the step alone: ``interval`` (by ``factor`` every ``interval`` steps), ``table`` (``{step: size}``) and
``callable`` (a user function of ``(step, current size)``). No state."""

from __future__ import annotations

from ...config.batch_growth import BatchGrowthConfig, checked_size
from ...policies.growth import interval_size
from ...policies.schedule import scheduled_value
from .base import GrowthStrategy, StepView


class IntervalGrowth(GrowthStrategy):
    """``initial x factor^k`` after ``k`` intervals (``policies.growth.interval_size``)."""

    name = 'interval'

    def target(self, step: int, current: int) -> int:
        c = self.config
        return interval_size(step, initial=c.initial, factor=c.factor, interval=c.interval, maximum=c.maximum,
                             delay=c.delay)


class TableGrowth(GrowthStrategy):
    """The table's size at the last step it names (``initial`` before the first); with ``table_unit: samples`` at the
    last number of samples consumed it names (the count of the last step seen, :class:`StepView`)."""

    name = 'table'

    def __init__(self, config: BatchGrowthConfig) -> None:
        super().__init__(config)
        self.samples = 0

    def observe_step(self, view: StepView) -> dict[str, float]:
        self.samples = view.samples
        return {}

    def target(self, step: int, current: int) -> int:
        at = self.samples if self.config.table_unit == 'samples' else step
        return scheduled_value(self.config.table, at) or self.config.initial


class CallableGrowth(GrowthStrategy):
    """``function(step, current)``; rank 0's answer is used on every rank (the function may read local values)."""

    name = 'callable'

    def __init__(self, config: BatchGrowthConfig) -> None:
        super().__init__(config)
        self.fn = config.resolved_function()

    @property
    def rank_local(self) -> bool:
        return True

    def target(self, step: int, current: int) -> int:
        return checked_size(self.fn(step, current), f'for (step={step}, batch_size={current})')

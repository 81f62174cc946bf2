"""``loss_variability``: grow by ``factor`` when the last ``window`` logged losses vary more than ``threshold``."""

from __future__ import annotations

import math
from typing import Any, Mapping

from ...policies.growth import loss_variability_size
from .base import GrowthStrategy


class LossVariabilityGrowth(GrowthStrategy):
    """Checks every ``interval`` steps after ``delay`` (``policies.growth.loss_variability_size``); judged on this
    rank's losses (rank 0's size is used).

    State: ``losses`` (the window of finite logged losses since the last size change).
    """

    name = 'loss_variability'

    def __init__(self, config) -> None:
        super().__init__(config)
        self.losses: list[float] = []

    @property
    def rank_local(self) -> bool:
        return True

    def observe_log(self, loss: float) -> None:
        if math.isfinite(loss):
            self.losses = (self.losses + [float(loss)])[-self.config.window:]

    def target(self, step: int, current: int) -> int:
        c = self.config
        due = step >= c.delay + c.interval and (step - c.delay) % c.interval == 0
        if not due:
            return current
        return loss_variability_size(self.losses, current, window=c.window, threshold=c.threshold, factor=c.factor,
                                     maximum=c.maximum)

    def resized(self, old: int | None, new: int, lr_scale: float) -> None:
        if old is not None and new != old:
            self.losses = []  # the loss noise changes with the batch: judge the new size on its own losses

    def state_dict(self) -> dict[str, Any]:
        return {'losses': list(self.losses)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.losses = [float(x) for x in state.get('losses', [])]

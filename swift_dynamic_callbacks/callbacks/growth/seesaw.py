"""``seesaw`` (Meterez et al. 2025): every cut of the LR schedule by ``factor`` becomes a batch growth by ``factor``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from ...policies.growth import seesaw_cuts, seesaw_size
from .base import GrowthStrategy, StepView


@dataclass
class SeesawState:
    """The schedule's peak factor, the cuts by ``factor`` since it, the LR scale requested last (in effect from the
    next step: the scheduler's LR divided by it is the schedule's own factor), the last factor seen."""

    peak: float = 0.0
    cuts: int = 0
    scale: float = 1.0
    factor: float | None = None


class SeesawGrowth(GrowthStrategy):
    """Reads the next step's LR at every step end; the schedule's factor is that LR over ``learning_rate`` and the LR
    scale this callback requested; grows once per cut (``policies.growth.seesaw_size``).

    State: ``seesaw`` (:class:`SeesawState`).
    """

    name = 'seesaw'

    def __init__(self, config) -> None:
        super().__init__(config)
        self.state = SeesawState()

    def observe_step(self, view: StepView) -> dict[str, float]:
        if view.lr is not None:
            self.observe_lr(view.lr, view.base_lr)
        return {}

    def observe_lr(self, lr: float, base_lr: float) -> None:
        """Fold the next step's LR in (its schedule factor, the peak so far, the cuts since; never fewer)."""
        s = self.state
        if not (base_lr > 0 and s.scale > 0 and math.isfinite(lr)):
            return
        s.factor = lr / (base_lr * s.scale)
        s.peak = max(s.peak, s.factor)
        s.cuts = max(s.cuts, seesaw_cuts(s.factor, s.peak, self.config.factor))

    def target(self, step: int, current: int) -> int:
        c = self.config
        return seesaw_size(self.state.cuts, initial=c.initial, factor=c.factor, maximum=c.maximum)

    def record_values(self, reason: str, per_step: int) -> dict[str, Any]:
        s = self.state
        return {'lr_cuts': s.cuts,
                'schedule_factor': None if s.factor is None else round(s.factor / (s.peak or 1.0), 6)}

    def resized(self, old: int | None, new: int, lr_scale: float) -> None:
        self.state.scale = lr_scale  # whatever else is requested with it: the scale the schedule is divided by

    def state_dict(self) -> dict[str, Any]:
        return {'seesaw': asdict(self.state)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state = SeesawState(**{**asdict(SeesawState()), **state.get('seesaw', {})})

"""``late_switch`` (arXiv 2602.14208): ``initial`` until ``switch_at`` of the run, or until the loss plateaus, then
``maximum``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from ...policies.growth import late_switch_size
from ...policies.lr import PlateauState, plateau_step, smoothed
from .base import GrowthStrategy, StepView


@dataclass
class SwitchState:
    """The recent logged losses (``switch_smooth`` of them), the plateau judgement over their median, and whether
    it fired (sticky)."""

    losses: list[float] = field(default_factory=list)
    plateau: PlateauState = field(default_factory=PlateauState)
    plateaued: bool = False


class LateSwitchGrowth(GrowthStrategy):
    """Reads ``global_step / max_steps`` at every step end; with ``switch_patience`` also judges the smoothed
    training loss for a plateau (``policies.lr.plateau_step``, rank 0's verdict) and publishes
    ``dynamic/late_switch_wait``.

    State: ``switch`` (:class:`SwitchState`); the fraction of the run done is derived from the trainer's state.
    """

    name = 'late_switch'

    def __init__(self, config) -> None:
        super().__init__(config)
        self.switch = SwitchState()
        self.done = 0.0

    @property
    def rank_local(self) -> bool:
        return self.config.switch_patience is not None

    def observe_log(self, loss: float) -> None:
        if self.config.switch_patience is not None:
            self.observe_loss(loss)

    def observe_loss(self, loss: float) -> bool:
        """Fold one logged training loss into the plateau judgement (the median of the last ``switch_smooth``);
        returns whether the loss has plateaued (sticky: once true, it stays)."""
        c, sw = self.config, self.switch
        if sw.plateaued or not math.isfinite(loss):
            return sw.plateaued
        sw.losses = (sw.losses + [float(loss)])[-c.switch_smooth:]
        if len(sw.losses) >= c.switch_smooth:
            sw.plateau, sw.plateaued = plateau_step(sw.plateau, smoothed(sw.losses, c.switch_smooth), mode='min',
                                                    min_delta=c.switch_min_delta, patience=c.switch_patience,
                                                    cooldown=0)
        return sw.plateaued

    def observe_step(self, view: StepView) -> dict[str, float]:
        self.done = view.step / view.max_steps if view.max_steps else 0.0
        if self.config.switch_patience is None:
            return {}
        return {'dynamic/late_switch_wait': self.switch.plateau.wait}

    def target(self, step: int, current: int) -> int:
        c = self.config
        return late_switch_size(self.done, initial=c.initial, maximum=c.maximum, switch_at=c.switch_at,
                                plateaued=self.switch.plateaued)

    def record_values(self, reason: str, per_step: int) -> dict[str, Any]:
        if reason != 'late_switch':
            return {}
        early = self.switch.plateaued and self.done < self.config.switch_at
        values: dict[str, Any] = {'trigger': 'loss_plateau' if early else 'switch_at', 'done': round(self.done, 6)}
        if early:
            values['smoothed_loss'] = self.switch.plateau.best
        return values

    def state_dict(self) -> dict[str, Any]:
        sw = self.switch
        return {'switch': {'losses': list(sw.losses), 'plateau': asdict(sw.plateau), 'plateaued': sw.plateaued}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get('switch', {})
        self.switch = SwitchState([float(x) for x in saved.get('losses', [])],
                                  PlateauState(**{**asdict(PlateauState()), **saved.get('plateau', {})}),
                                  bool(saved.get('plateaued', False)))

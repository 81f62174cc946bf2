"""``noise_scale``: grow toward the critical batch estimated from the gradient noise scale (McCandlish et al. 2018)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping

from ...config import ConfigError
from ...config.rules import noise_scale_passes
from ...policies.growth import NoiseState, critical_samples, fold_noise, noise_scale_size
from .base import GrowthStrategy, StepView


class NoiseScaleGrowth(GrowthStrategy):
    """Every ``interval`` steps after ``delay`` and ``window`` measured steps, one growth by ``factor`` toward the
    critical per-device batch (``policies.growth.noise_scale_size``); measured on this rank (rank 0's size is used).
    Needs two passes a step (``gradient_accumulation_steps >= 2`` or a ``micro_batch_cap`` below ``maximum``).

    State: ``noise`` (:class:`NoiseState`), ``critical_per_device`` (the last estimate, samples a pass).
    """

    name = 'noise_scale'
    measures_grad_noise = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.noise = NoiseState()
        self.critical_per_device: float | None = None

    @property
    def rank_local(self) -> bool:
        return True

    def begin(self, gradient_accumulation_steps: int) -> None:
        message = noise_scale_passes('dynamic_callbacks.batch_growth.policy: noise_scale', gradient_accumulation_steps,
                                     self.config.micro_batch_cap, self.config.maximum)
        if message is not None:
            raise ConfigError(message)

    def observe_step(self, view: StepView) -> dict[str, float]:
        if view.noise is None:
            return {}
        critical = self.observe_noise(view.noise, view.passes_per_step)
        return {} if critical is None else {'dynamic/grad_noise_scale': round(critical, 3)}

    def observe_noise(self, sample: Any, passes_per_step: int) -> float | None:
        """Fold one step's gradient norms into the EMAs; returns the critical global batch in samples."""
        self.noise = fold_noise(self.noise, sample.small_sqnorm, sample.small_tokens, sample.big_sqnorm,
                                sample.big_tokens, sample.samples, self.config.noise_decay)
        samples = critical_samples(self.noise)
        self.critical_per_device = None if samples is None else samples / passes_per_step
        return samples

    def target(self, step: int, current: int) -> int:
        c = self.config
        due = step >= c.delay + c.interval and (step - c.delay) % c.interval == 0
        if not (due and self.noise.count >= c.window):
            return current
        return noise_scale_size(self.critical_per_device, current, factor=c.factor, maximum=c.maximum)

    def record_values(self, reason: str, per_step: int) -> dict[str, Any]:
        if self.critical_per_device is None:
            return {}
        return {'critical_global_batch': round(self.critical_per_device * per_step, 3)}

    def state_dict(self) -> dict[str, Any]:
        return {'noise': asdict(self.noise), 'critical_per_device': self.critical_per_device}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.noise = NoiseState(**{**asdict(NoiseState()), **state.get('noise', {})})
        self.critical_per_device = state.get('critical_per_device')

"""The optimizer's weight decay and Adam beta2 as a function of the batch (``control.new_optimizer_scale``).

The configured values of every param group are read once, when the first scale is applied; each request sets
``weight_decay = configured × weight_decay factor`` and ``beta2 = configured ** beta2_power`` (absolute, like the LR
scale). The values live in the optimizer's param groups, so HF's ``optimizer.pt`` saves them and a resume restores
them; the configured values and the scale are in the integration's state.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..config import ConfigError


class OptimizerScale:
    """Scales the live optimizer's weight decay and beta2.

    Args:
        trainer: the HF / ms-swift trainer (its ``optimizer`` when a scale is applied).

    State (under the integration's, key ``optimizer``): the configured values per param group and the scale in
    effect.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.configured: list[dict[str, Any]] | None = None  # per param group: weight_decay, beta2
        self.scale: dict[str, float] = {}

    def current(self) -> dict[str, Any]:
        """The first param group's weight decay and beta2 now (for the records)."""
        group = self._groups()[0]
        betas = group.get('betas')
        return {'weight_decay': group.get('weight_decay'), 'beta2': None if betas is None else betas[1]}

    def set_scale(self, scale: Mapping[str, float]) -> None:
        """Apply ``scale`` (``weight_decay`` factor, ``beta2_power``) to every param group.

        Raises:
            ConfigError: the optimizer has no such hyperparameter (naming the setting that asked for it)."""
        groups = self._groups()
        for key, field, setting in (('weight_decay', 'weight_decay', 'weight_decay_scaling'),
                                    ('beta2_power', 'betas', 'beta2_scaling')):
            if key in scale and any(field not in g for g in groups):
                raise ConfigError(f'dynamic_callbacks.batch_growth.{setting}: the optimizer '
                                  f'{type(self.trainer.optimizer).__name__} has no {field!r} in its param groups; '
                                  'use an Adam-family optimizer (optim: adamw_torch), or leave the setting at none')
        if self.configured is None:
            self.configured = [{'weight_decay': g.get('weight_decay'),
                                'beta2': g['betas'][1] if 'betas' in g else None} for g in groups]
        for group, base in zip(groups, self.configured):
            if base['weight_decay'] is not None:
                group['weight_decay'] = base['weight_decay'] * scale.get('weight_decay', 1.0)
            if base['beta2'] is not None:
                group['betas'] = (group['betas'][0], base['beta2'] ** scale.get('beta2_power', 1.0))
        self.scale = dict(scale)

    def _groups(self) -> list[dict[str, Any]]:
        optimizer = getattr(self.trainer, 'optimizer', None)
        if optimizer is None:
            raise RuntimeError('swift-dynamic-callbacks: an optimizer scale was requested before the optimizer exists')
        return optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return {'configured': self.configured, 'scale': dict(self.scale)}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if state:
            self.configured = [dict(g) for g in state['configured']] if state.get('configured') else None
            self.scale = {k: float(v) for k, v in (state.get('scale') or {}).items()}

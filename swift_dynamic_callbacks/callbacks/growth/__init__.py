"""The growth policies of ``batch_growth``, one strategy a module (:mod:`.base` says what each meets).

Adding a policy: a module with a :class:`~.base.GrowthStrategy` subclass, a line in :data:`STRATEGIES`, and its name
and settings in ``config/batch_growth.py`` (``POLICIES`` and the ``reads`` table; the config stays torch-free).
"""

from __future__ import annotations

from ...config.batch_growth import POLICIES, BatchGrowthConfig
from .base import GrowthStrategy, StepView
from .late_switch import LateSwitchGrowth
from .loss_variability import LossVariabilityGrowth
from .noise_scale import NoiseScaleGrowth
from .schedules import CallableGrowth, IntervalGrowth, TableGrowth
from .seesaw import SeesawGrowth

STRATEGIES: dict[str, type[GrowthStrategy]] = {cls.name: cls for cls in (
    IntervalGrowth, TableGrowth, CallableGrowth, LossVariabilityGrowth, NoiseScaleGrowth, SeesawGrowth,
    LateSwitchGrowth)}
if tuple(sorted(STRATEGIES)) != tuple(sorted(POLICIES)):
    raise ImportError(f'batch_growth: strategies {sorted(STRATEGIES)} differ from the settings\' policies '
                      f'{sorted(POLICIES)}')  # a bug in the package, caught on import


def strategy_for(config: BatchGrowthConfig) -> GrowthStrategy:
    """The strategy of ``config.policy``."""
    return STRATEGIES[config.policy](config)


__all__ = ['STRATEGIES', 'GrowthStrategy', 'StepView', 'strategy_for']

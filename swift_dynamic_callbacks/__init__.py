"""swift-dynamic-callbacks: batch size and learning rate that adapt while an ms-swift / HF training runs.

Callbacks only set control flags (:mod:`swift_dynamic_callbacks.protocol`); one trainer-side integration
(:func:`install`) honours them at the next optimizer step.
"""

from .callbacks import (BatchGrowthCallback, BatchGrowthConfig, BatchScheduleCallback, BatchScheduleConfig,
                        DynamicCallback)
from .config import ConfigError
from .integrations.trainer import IntegrationConfig, install
from .records import DecisionRecord

__version__ = '0.1.0'


def register(settings=None, **by_name):
    """Register the pack's callbacks in ms-swift by name, with their settings; see ``integrations.swift``."""
    from .integrations.swift import register as _register
    return _register(settings, **by_name)


__all__ = [
    'BatchGrowthCallback', 'BatchGrowthConfig', 'BatchScheduleCallback', 'BatchScheduleConfig', 'ConfigError', 'DecisionRecord', 'DynamicCallback', 'IntegrationConfig', 'install',
    'register', '__version__'
]

"""swift-dynamic-callbacks: batch size and learning rate that adapt while an ms-swift / HF training runs.

Callbacks only set control flags (:mod:`swift_dynamic_callbacks.protocol`); one trainer-side integration
(:func:`install`) honours them at the next optimizer step.

The names below are imported on first use (PEP 562), so ``import swift_dynamic_callbacks`` and the command line
(``swift_dynamic_callbacks.cli``, ``swift_dynamic_callbacks.config``) import no torch, transformers or swift;
``swift_dynamic_callbacks.BatchGrowthCallback`` (or ``install``) imports them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = '0.1.0'

#: public name -> the module that defines it
_LAZY = {
    'BatchGrowthCallback': '.callbacks',
    'BatchScheduleCallback': '.callbacks',
    'CheckpointRotationCallback': '.callbacks',
    'DynamicCallback': '.callbacks',
    'EarlyStoppingCallback': '.callbacks',
    'LengthBatchingCallback': '.callbacks',
    'LRScheduleCallback': '.callbacks',
    'MemoryBackoffCallback': '.callbacks',
    'TrainingLogCallback': '.callbacks',
    'BatchGrowthConfig': '.config.batch_growth',
    'BatchScheduleConfig': '.config.batch_schedule',
    'CheckpointRotationConfig': '.config.checkpoint_rotation',
    'EarlyStoppingConfig': '.config.early_stopping',
    'LengthBatchingConfig': '.config.length_batching',
    'LRScheduleConfig': '.config.lr_schedule',
    'MemoryBackoffConfig': '.config.memory_backoff',
    'TrainingLogConfig': '.config.training_log',
    'ConfigError': '.config',
    'IntegrationConfig': '.config.integration',
    'PackConfig': '.config.pack',
    'install': '.integrations.hooks',
    'mark_token_sum_loss': '.config.rules',
    'DecisionRecord': '.records',
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def register(settings=None, **by_name):
    """Register the pack's callbacks in ms-swift by name, with their settings; see ``integrations.swift``."""
    from .integrations.swift import register as _register
    return _register(settings, **by_name)


def unregister():
    """Forget the settings :func:`register` took; see ``integrations.swift``."""
    from .integrations.swift import unregister as _unregister
    return _unregister()


__all__ = sorted(_LAZY) + ['register', 'unregister', '__version__']

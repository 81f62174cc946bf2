"""The pack's callbacks, one a module. Each only sets control flags (see ``protocol``)."""

from .base import DynamicCallback
from .batch_growth import BatchGrowthCallback, BatchGrowthConfig
from .batch_schedule import BatchScheduleCallback, BatchScheduleConfig
from .training_log import TrainingLogCallback, TrainingLogConfig
from .checkpoint_rotation import CheckpointRotationCallback, CheckpointRotationConfig
from .early_stopping import EarlyStoppingCallback, EarlyStoppingConfig
from .length_batching import LengthBatchingCallback, LengthBatchingConfig
from .lr_schedule import LRScheduleCallback, LRScheduleConfig
from .memory_backoff import MemoryBackoffCallback, MemoryBackoffConfig

__all__ = [
    'BatchGrowthCallback', 'BatchGrowthConfig', 'DynamicCallback', 'BatchScheduleCallback', 'BatchScheduleConfig',
    'CheckpointRotationCallback', 'CheckpointRotationConfig', 'EarlyStoppingCallback', 'EarlyStoppingConfig',
    'LengthBatchingCallback', 'LengthBatchingConfig', 'LRScheduleCallback', 'LRScheduleConfig',
    'MemoryBackoffCallback', 'MemoryBackoffConfig',
    'TrainingLogCallback', 'TrainingLogConfig'
]

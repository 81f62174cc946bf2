"""The pack's callbacks, one a module. Each only sets control flags (see ``protocol``)."""

from .base import DynamicCallback
from .batch_growth import BatchGrowthCallback, BatchGrowthConfig
from .batch_schedule import BatchScheduleCallback, BatchScheduleConfig
from .training_log import TrainingLogCallback, TrainingLogConfig

__all__ = [
    'BatchGrowthCallback', 'BatchGrowthConfig', 'DynamicCallback', 'BatchScheduleCallback', 'BatchScheduleConfig',
    'TrainingLogCallback', 'TrainingLogConfig'
]

"""Settings of the ``training_log`` callback (YAML key ``dynamic_callbacks.training_log``); no torch imported."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import Check, ConfigError, Flag, Int, Settings, setting

LOG_FILE = 'dynamic_training_log.jsonl'


@dataclass(frozen=True)
class FileName(Check):
    """A file path (not a directory: no trailing separator)."""

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, str) or not value.strip() or value.endswith(('/', os.sep)):
            raise ConfigError(f'{name}: expected a file name such as {LOG_FILE!r}, got {value!r}')
        return value


@dataclass(frozen=True)
class TrainingLogConfig(Settings):
    """Settings of :class:`TrainingLogCallback` (YAML key ``dynamic_callbacks.training_log``).

    Attributes:
        every: write a step line every ``every``-th training log event (so every ``every * logging_steps``
            optimizer steps); epoch summaries count every logged loss regardless.
        memory: measure device memory after each optimizer step (CUDA: peak allocated and reserved since the
            start; CPU: the process's resident and peak resident memory) and put it into the training logs.
        file: the JSON Lines file, relative to ``output_dir`` (an absolute path is used as is).
    """

    every: int = setting(Int(1), 1)
    memory: bool = setting(Flag(), True)
    file: str = setting(FileName(), LOG_FILE)

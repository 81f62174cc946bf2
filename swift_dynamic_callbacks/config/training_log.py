"""Settings of the ``training_log`` callback (YAML key ``dynamic_callbacks.training_log``); no torch imported."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import Check, ConfigError, Flag, Int, Number, Reads, Settings, setting

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
        noise_scale: measure the gradient noise scale B_simple (McCandlish et al. 2018: the batch in samples past
            which a larger batch stops saving steps) from each step's first pass and the whole step, and put it
            into the training logs (``dynamic/b_simple``, an EMA over steps). Needs two passes a step
            (``gradient_accumulation_steps >= 2``, not ``length_batching.pass_tokens``); refused under FSDP2 and
            DeepSpeed. Costs two sums of squares over the trainable gradients a step (each reads one number
            from the device).
        noise_decay: the EMA's decay over steps (default 0.95: about 20 steps of memory; one step's estimate is
            very noisy).
    """

    every: int = setting(Int(1), 1)
    memory: bool = setting(Flag(), True)
    file: str = setting(FileName(), LOG_FILE)
    noise_scale: bool = setting(Flag(), False)
    noise_decay: float = setting(Number(0, 1, high_open=True), 0.95)

    reads = (Reads('noise_scale', {True: ('noise_decay',), False: ()}),)

"""Training log (seed 002): per-step metrics with device memory, and epoch summaries, as JSON Lines on rank 0.

ms-swift already writes every log event to ``logging.jsonl`` (and TensorBoard). This callback adds what those
lack: device memory, epoch summaries, throughput over the dynamic batch, and one stable schema with a ``type``
field, in ``<output_dir>/dynamic_training_log.jsonl``::

    {"type": "step", "step": 12, "epoch": 0.19, "time": ..., "loss": 2.1, "grad_norm": 0.8, "learning_rate": 1e-3,
     "samples_seen": 48, "samples_per_s": 3.9, "tokens_seen": 9120, "tokens_per_s": 741.2,
     "dynamic": {"dynamic/batch_size": 2, ...}, "memory": {"dynamic/memory_peak_gib": 1.2, ...}}
    {"type": "epoch", "epoch_index": 0, "epoch": 1.0, "step": 26, "steps": 26, "samples": 128, "mean_loss": 2.3,
     "logged_losses": 26, "runtime_s": 34.5, "samples_per_s": 3.7, "memory": {...}}

Tokens seen and tokens/s are the integration's count (``dynamic/tokens_seen``: non-padding input tokens of every
micro-batch drawn, all ranks, kept across a resume), whatever HF's ``include_num_input_tokens_seen``; without the
integration, HF's ``num_input_tokens_seen`` when it counts.

The memory figures are also put into every training log line (``dynamic/memory_*`` keys, through
``protocol.publish_metrics``), so they reach ``logging.jsonl``, TensorBoard and ``swift-dynamic report``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict
from typing import Any, Mapping

from .. import protocol
from ..config import ConfigError
from ..config.rules import noise_scale_passes
from ..config.training_log import LOG_FILE, TrainingLogConfig  # noqa: F401 - LOG_FILE re-exported
from ..device_memory import GIB
from ..policies.growth import NoiseState, critical_samples, fold_noise
from .base import DynamicCallback

_STEP_KEYS = ('loss', 'grad_norm', 'learning_rate')


_process: Any = None


def _rss_bytes() -> int | None:
    """Resident memory of this process now (psutil when installed, else ``/proc/self/statm``)."""
    global _process
    try:
        import psutil
        if _process is None:
            _process = psutil.Process()
        return int(_process.memory_info().rss)
    except Exception:  # psutil missing or failing: fall back to procfs (Linux)
        try:
            with open('/proc/self/statm', encoding='ascii') as f:
                return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
        except (OSError, ValueError, IndexError):
            return None


def memory_figures() -> dict[str, float]:
    """Device memory now, in GiB, under the ``dynamic/memory_*`` keys.

    CUDA (when this process has initialised it): ``memory_peak_gib`` (``max_memory_allocated``),
    ``memory_reserved_gib`` (``max_memory_reserved``) and ``memory_allocated_gib`` (now), on the current device.
    Otherwise: ``memory_rss_gib`` (process resident memory now) and ``memory_peak_gib`` (peak resident memory).
    """
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        return {
            'dynamic/memory_peak_gib': round(torch.cuda.max_memory_allocated(device) / GIB, 4),
            'dynamic/memory_reserved_gib': round(torch.cuda.max_memory_reserved(device) / GIB, 4),
            'dynamic/memory_allocated_gib': round(torch.cuda.memory_allocated(device) / GIB, 4),
        }
    figures: dict[str, float] = {}
    rss = _rss_bytes()
    if rss is not None:
        figures['dynamic/memory_rss_gib'] = round(rss / GIB, 4)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    figures['dynamic/memory_peak_gib'] = round(peak * (1 if sys.platform == 'darwin' else 1024) / GIB, 4)
    return figures


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class TrainingLogCallback(DynamicCallback):
    """Writes step metrics, device memory and epoch summaries to a JSON Lines file (rank 0 only).

    Hooks: ``on_train_begin`` (throughput reference point; the gradient-noise request), ``on_step_end`` (memory
    probe and the step's gradient-noise sample, published), ``on_log`` (a step line every ``every``-th training log
    event; losses for the epoch summary), ``on_epoch_end`` (the epoch summary line).
    Flags set: ``dynamic_metrics`` (``dynamic/memory_*`` when ``memory`` is on, ``dynamic/b_simple`` when
    ``noise_scale`` is), ``measure_grad_noise`` (when ``noise_scale`` is on: a standing request for each step's
    gradient norms, :class:`..protocol.GradNoiseSample`). No batch or LR requests, no decisions.
    State: ``events`` (training log events so far), ``epoch`` (the running epoch's first step, samples at its start,
    loss sum and count), so ``every`` and the epoch summary continue across a resume; ``noise`` (the noise scale's
    EMAs, :class:`..policies.growth.NoiseState`).
    Reads ``dynamic/*`` values (the integration's batch size and samples seen) from the logs, and
    ``samples_seen`` from the integration's loader when a summary falls between log events; without the
    integration, samples are estimated as steps x per-device batch x accumulation x world size.
    """

    name = 'training_log'
    config_class = TrainingLogConfig

    def __init__(self, config: TrainingLogConfig | None = None) -> None:
        super().__init__(config)
        self.events = 0
        self.epoch_start_step: int | None = None
        self.epoch_start_samples: int | None = None
        self.epoch_loss_sum = 0.0
        self.epoch_loss_count = 0
        self.memory: dict[str, float] = {}
        self._last_samples: tuple[int, int] | None = None  # (step, dynamic/samples_seen) of the last log event
        self._mark: tuple[float, int, int | None] | None = None  # (time, samples, tokens) of the last step line
        self._epoch_time: float | None = None
        self.noise = NoiseState()

    # ---- helpers ---------------------------------------------------------------------------------------
    def path(self, args: Any) -> str:
        return os.path.join(args.output_dir, self.config.file)

    def _write(self, args: Any, state: Any, line: Mapping[str, Any]) -> None:
        if not getattr(state, 'is_world_process_zero', True):
            return
        path = self.path(args)
        os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
        with open(path, 'a', encoding='utf-8') as f:
            f.write(json.dumps(line, ensure_ascii=False, default=str) + '\n')

    def samples_seen(self, args: Any, state: Any, train_dataloader: Any = None) -> int:
        """Samples used so far, all ranks: logged by the integration, else its loader's count, else estimated."""
        if self._last_samples is not None and self._last_samples[0] == state.global_step:
            return self._last_samples[1]
        world = max(int(getattr(args, 'world_size', 1) or 1), 1)
        local = getattr(train_dataloader, 'samples_seen', None)
        if isinstance(local, int) and not isinstance(local, bool):
            return local * world
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
        return state.global_step * per_step

    # ---- hooks -----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        if self.config.noise_scale:
            message = noise_scale_passes('dynamic_callbacks.training_log.noise_scale', args.gradient_accumulation_steps)
            if message is not None:
                raise ConfigError(message)
            protocol.request_grad_noise(control)
        now = time.time()
        # with the integration, tokens are its count (restored on resume): the first line takes its own rate
        hf_tokens = None if getattr(control, '_sdc_integration', False) else int(
            getattr(state, 'num_input_tokens_seen', 0) or 0)
        samples = self.samples_seen(args, state, train_dataloader)
        if self.epoch_start_step is None:  # fresh start (a resume restores the running epoch)
            self.epoch_start_step = state.global_step
            self.epoch_start_samples = samples
        self._epoch_time = now
        self._mark = (now, samples, hf_tokens)

    def on_step_end(self, args, state, control, **kwargs):
        if self.config.memory:
            self.memory = memory_figures()
            protocol.publish_metrics(control, self.memory)
        sample = protocol.grad_noise_sample(control) if self.config.noise_scale else None
        if sample is not None:
            self.noise = fold_noise(self.noise, sample.small_sqnorm, sample.small_tokens, sample.big_sqnorm,
                                    sample.big_tokens, sample.samples, self.config.noise_decay)
            b_simple = critical_samples(self.noise)
            if b_simple is not None:
                protocol.publish_metrics(control, {'dynamic/b_simple': round(b_simple, 3)})

    def on_log(self, args, state, control, logs=None, train_dataloader=None, **kwargs):
        logs = logs or {}
        loss = _number(logs.get('loss'))
        if loss is None:  # eval, runtime and summary events
            return
        self.events += 1
        self.epoch_loss_sum += loss
        self.epoch_loss_count += 1
        logged_samples = _number(logs.get('dynamic/samples_seen'))
        if logged_samples is not None:
            self._last_samples = (state.global_step, int(round(logged_samples)))
        if self.events % self.config.every or not getattr(state, 'is_world_process_zero', True):
            return
        now = time.time()
        samples = self.samples_seen(args, state, train_dataloader)
        pack_tokens = _number(logs.get('dynamic/tokens_seen'))  # counted by the integration, always
        tokens = int(pack_tokens) if pack_tokens is not None else int(getattr(state, 'num_input_tokens_seen', 0) or 0)
        line: dict[str, Any] = {'type': 'step', 'step': state.global_step, 'epoch': state.epoch, 'time': now}
        line.update({key: _number(logs.get(key)) for key in _STEP_KEYS})
        line['samples_seen'] = samples
        line['samples_per_s'] = line['tokens_seen'] = line['tokens_per_s'] = None
        if tokens > 0:  # the pack's count; without the integration, HF's (include_num_input_tokens_seen)
            line['tokens_seen'] = tokens
        if self._mark is not None and now > self._mark[0]:
            elapsed = now - self._mark[0]
            line['samples_per_s'] = round((samples - self._mark[1]) / elapsed, 4)
            if tokens > 0 and self._mark[2] is not None:
                line['tokens_per_s'] = round((tokens - self._mark[2]) / elapsed, 2)
            elif tokens > 0:  # first line after the start: the integration's rate since its previous log line
                line['tokens_per_s'] = _number(logs.get('dynamic/tokens_per_s'))
        line['dynamic'] = {k: v for k, v in logs.items() if k.startswith('dynamic/')
                           and not k.startswith('dynamic/memory_') and _number(v) is not None}
        line['memory'] = dict(self.memory)
        self._mark = (now, samples, tokens)
        self._write(args, state, line)

    def on_epoch_end(self, args, state, control, train_dataloader=None, **kwargs):
        now = time.time()
        samples = self.samples_seen(args, state, train_dataloader)
        start_step = self.epoch_start_step if self.epoch_start_step is not None else 0
        start_samples = self.epoch_start_samples if self.epoch_start_samples is not None else 0
        runtime = now - self._epoch_time if self._epoch_time is not None else None
        epoch = float(state.epoch or 0.0)
        line = {
            'type': 'epoch',
            'epoch_index': max(math.ceil(round(epoch, 6)) - 1, 0),
            'epoch': epoch,
            'step': state.global_step,
            'steps': state.global_step - start_step,
            'samples': samples - start_samples,
            'mean_loss': self.epoch_loss_sum / self.epoch_loss_count if self.epoch_loss_count else None,
            'logged_losses': self.epoch_loss_count,
            'runtime_s': None if runtime is None else round(runtime, 3),
            'samples_per_s': round((samples - start_samples) / runtime, 4) if runtime else None,
            'memory': dict(self.memory),
        }
        self._write(args, state, line)
        self.epoch_start_step, self.epoch_start_samples = state.global_step, samples
        self.epoch_loss_sum, self.epoch_loss_count = 0.0, 0
        self._epoch_time = now

    # ---- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            'events': self.events,
            'epoch': {
                'start_step': self.epoch_start_step,
                'start_samples': self.epoch_start_samples,
                'loss_sum': self.epoch_loss_sum,
                'loss_count': self.epoch_loss_count,
            },
            'noise': asdict(self.noise),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.events = int(state.get('events', 0))
        epoch = state.get('epoch') or {}
        self.epoch_start_step = epoch.get('start_step')
        start_samples = epoch.get('start_samples')
        self.epoch_start_samples = None if start_samples is None else int(start_samples)
        self.epoch_loss_sum = float(epoch.get('loss_sum', 0.0))
        self.epoch_loss_count = int(epoch.get('loss_count', 0))
        self.noise = NoiseState(**{**asdict(NoiseState()), **(state.get('noise') or {})})

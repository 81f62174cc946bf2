"""The numbers merged into every training log line: batch size, samples and tokens seen, tokens/s, padding, LR
scale, pass size, OOMs, non-finite steps, and the callbacks' ``dynamic_metrics``; the honest samples/s at the end.

Every figure that spans ranks is summed with a collective here, in the same order on every rank (HF logs on every
rank at the same step).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping

import torch

from .. import distributed, protocol
from ..config.integration import IntegrationConfig
from ..policies.length import padding_fraction
from .losses import LossWatch


def count_tokens(batch: Any, *, padded: bool = False) -> int:
    """Input tokens of one collated micro-batch without padding: ``attention_mask``'s ones, else every
    ``input_ids`` entry (packed / padding-free rows have no padding), else 0. ``padded``: every position."""
    if not isinstance(batch, Mapping):
        return 0
    mask = batch.get('attention_mask')
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not padded:
        return int(mask.sum().item())
    ids = batch.get('input_ids')
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0


def allocator_figures(caught_ooms: int) -> dict[str, int]:
    """``dynamic/alloc_retries`` and ``dynamic/ooms`` (torchtitan logs both): on CUDA the caching allocator's counts
    since the process started (``num_alloc_retries``: a cache flush and retry before an allocation succeeded, the
    sign of a fragmented pool; ``num_ooms``: allocations that failed, the caught ones included); elsewhere no
    allocator keeps them: 0 retries and the OOMs the pack caught (``caught_ooms``). Host-side counters: no device
    synchronisation."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        return {'dynamic/alloc_retries': int(stats.get('num_alloc_retries', 0)),
                'dynamic/ooms': int(stats.get('num_ooms', 0))}
    return {'dynamic/alloc_retries': 0, 'dynamic/ooms': int(caught_ooms)}


def global_batch_size(loader: Any) -> int:
    """Samples per optimizer step over all ranks at the loader's current batch size."""
    return loader.batch_size * loader.entries_per_step * distributed.data_world()


class Metrics:
    """Counts what was trained and turns it into log values.

    Args:
        config: the integration settings (``log_values``).

    State: ``tokens_seen`` / ``padded_tokens_seen`` (this rank's input tokens of the micro-batches drawn so far,
    without / with padding; saved with the integration's state). Not saved: the tokens/s mark and the loss watch
    (a resumed run starts a new log line).
    """

    def __init__(self, config: IntegrationConfig) -> None:
        self.config = config
        self.tokens_seen = 0
        self.padded_tokens_seen = 0
        self.samples_at_start = 0  # the loader's samples seen when this run started (resumed runs: not zero)
        self.losses = LossWatch()
        self._token_mark: tuple[float, int] | None = None  # (time, all ranks' tokens) at the last log line

    def start_clock(self) -> None:
        """At every step boundary: the first step of this run (or of a resumed one) starts the tokens/s clock.
        Collective the first time."""
        if self._token_mark is None:
            self._token_mark = (time.monotonic(), distributed.sum_data_ints([self.tokens_seen])[0])

    def count(self, batches: Iterable[Any], *, padding_free: bool = False) -> None:
        """Add the tokens of a step's real micro-batches (without and with padding; ``padding_free``: they run as
        packed rows, so without)."""
        batches = list(batches)
        tokens = sum(count_tokens(batch) for batch in batches)
        self.tokens_seen += tokens
        self.padded_tokens_seen += tokens if padding_free else sum(count_tokens(b, padded=True) for b in batches)

    def update_logs(self, logs: dict[str, Any], control: Any, loader: Any, parts: Mapping[str, float],
                    *, step_lr: float | None, estimate_overruns: int,
                    pass_stats: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0),
                    rank_counts: Mapping[str, int] | None = None) -> None:
        """HF's ``log``: merge the pack's values into a training log line (``parts``: the integration parts' own
        values, e.g. the LR scale; ``rank_counts``: this rank's counters, logged summed over ranks, e.g. its OOMs) and
        log the LR the step used. Collective on lines with a loss, and at the end."""
        if 'loss' in logs and loader is not None:
            nonfinite = sum(distributed.gather_objects(self.losses.take()))  # HF may log a NaN as finite
            setattr(control, protocol.LOSS_NONFINITE, nonfinite)
            if nonfinite or self.config.log_values:
                logs[protocol.NONFINITE_LOG_KEY] = nonfinite
            logs.update(self.log_values(control, loader, parts, estimate_overruns, pass_stats(), rank_counts))
            if 'learning_rate' in logs and step_lr is not None:
                # ms-swift reads the LR after the scheduler stepped (the next step's); log the one this step used
                logs['learning_rate'] = step_lr
        if 'train_runtime' in logs and loader is not None:
            logs.update(self.speed_values(loader, float(logs['train_runtime'])))

    def log_values(self, control: Any, loader: Any, parts: Mapping[str, float], estimate_overruns: int,
                   pass_stats: tuple[int, int, int] = (0, 0, 0),
                   rank_counts: Mapping[str, int] | None = None) -> dict[str, float]:
        """The ``dynamic/*`` values of a training log line; ``pass_stats``: this rank's ``(passes, steps, padding
        passes)`` since the last line (``dynamic/passes_per_step``, the mean over ranks and steps;
        ``dynamic/padding_passes``: every rank's zero-weight passes that made the ranks' pass counts equal);
        ``rank_counts``: this rank's counters (``dynamic/oom_count``), each logged as its sum over ranks."""
        values: dict[str, float] = {}
        if self.config.log_values:
            counts = dict(rank_counts or {})
            data = [loader.samples_seen, self.tokens_seen, self.padded_tokens_seen, *pass_stats]
            own = distributed.first_of_group()  # a sequence-parallel group's ranks hold the same data: counted once
            samples, tokens, padded, passes, steps, padding, *summed = distributed.sum_ints(
                [v if own else 0 for v in data] + list(counts.values()))
            values['dynamic/padding_passes'] = padding
            values.update(zip(counts, summed))
            values.update(self.throughput_values(tokens))
            values['dynamic/padded_tokens_seen'] = padded
            values.update({
                'dynamic/batch_size': loader.batch_size,
                'dynamic/num_pieces': loader.num_pieces,
                'dynamic/global_batch_size': global_batch_size(loader),
                'dynamic/samples_seen': samples,
                'dynamic/epoch_coverage': round(loader.position / max(loader.epoch_size, 1), 6),
                **parts,
            })
            if steps:
                values['dynamic/passes_per_step'] = round(passes / steps, 4)
            if not loader.has_length:  # a stream: no coverage, the rows of the epoch so far instead
                del values['dynamic/epoch_coverage']
                values['dynamic/stream_position'] = distributed.sum_data_ints([loader.position])[0]
            if loader.plan is not None:
                values.update(self.token_values(loader))
                if loader.lengths_estimated:
                    values['dynamic/estimate_overruns'] = estimate_overruns
        values.update(protocol.current_metrics(control))
        return values

    def throughput_values(self, tokens: int) -> dict[str, float]:
        """``dynamic/tokens_seen`` (all ranks, non-padding input tokens, counted by the pack whatever HF's
        ``include_num_input_tokens_seen``) and ``dynamic/tokens_per_s`` since the previous log line."""
        now = time.monotonic()
        values: dict[str, float] = {'dynamic/tokens_seen': tokens}
        if self._token_mark is not None and now > self._token_mark[0]:
            values['dynamic/tokens_per_s'] = round((tokens - self._token_mark[1]) / (now - self._token_mark[0]), 2)
        self._token_mark = (now, tokens)
        return values

    @staticmethod
    def token_values(loader: Any) -> dict[str, float]:
        """Padded tokens per micro-batch and padding fraction of the micro-batches drawn since the last log line
        (all ranks), from the samples' lengths (a batch plan is set)."""
        real, padded, batches = distributed.sum_data_ints(loader.take_token_stats())
        spread, unbalanced, steps = loader.take_spread_stats()
        values = {}
        if steps:  # balanced steps (the same figures on every rank: they come from the layout)
            values['dynamic/rank_work_spread'] = round(spread / steps, 6)
            values['dynamic/rank_work_spread_unbalanced'] = round(unbalanced / steps, 6)
        if not batches:
            return values
        return {**values, 'dynamic/tokens_per_batch': round(padded / batches, 3),
                'dynamic/padding_fraction': round(padding_fraction(real, padded), 6)}

    def speed_values(self, loader: Any, runtime: float) -> dict[str, float]:
        """HF's ``train_samples_per_second`` assumes a constant batch; this counts the samples really used."""
        samples = distributed.sum_data_ints([loader.samples_seen - self.samples_at_start])[0]
        return {'train_samples_per_second': round(samples / runtime, 3) if runtime > 0 else 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {'tokens_seen': self.tokens_seen, 'padded_tokens_seen': self.padded_tokens_seen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.tokens_seen = int(state.get('tokens_seen', 0))
        self.padded_tokens_seen = int(state.get('padded_tokens_seen', 0))

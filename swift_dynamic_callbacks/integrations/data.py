"""The training data: the host's loader becomes the pack's elastic loader (map-style dataset) or stream loader
(``streaming: true``), with the host's collate function, workers and epoch order; the samples' lengths (read, or
estimated for a lazily tokenised dataset); the reports of micro-batches and samples over a token budget; the
per-step sample trace.

Both loaders meet :class:`~..data.interface.TrainLoader`: the integration does not ask which one it has, only what it
can do (``loader.has_length``, ``loader.lengths_estimated``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict
from typing import Any, Callable

import torch
import transformers

from .. import distributed
from ..config import ConfigError
from ..config.integration import IntegrationConfig
from ..config.launch import group_by_length_error
from ..config.rules import RunFacts, check_facts, custom_loss_name, pass_splitters
from ..data.length_estimates import cache_dir, estimate_lengths, is_lazy, mean_ratio
from ..data.elastic import ElasticDataLoader
from ..policies.balance import work_coefficient
from ..policies.length import BatchPlan
from ..policies.vision import ResizeRule, image_tokens, video_tokens
from ..records import DecisionRecord
from ..data.rows import (dataset_fingerprint, dataset_lengths, dataset_media_tokens, dataset_real_tokens, item_lengths,
                         row_cost)
from ..state import StateError
from ..data.stream import StreamLoader, stream_fingerprint
from ..data.interface import TrainLoader
from .decisions import Decisions
from .input_kinds import run_model
from .loss_kind import model_is_moe
from .steps import host_packs_rows

logger = logging.getLogger('swift_dynamic_callbacks')

SAMPLES_FILE = 'dynamic_samples.rank{rank}.jsonl'


def check_supported(trainer: Any, config: IntegrationConfig | None = None, *, streaming: bool = False) -> None:
    """Refuse trainer settings under which batches cannot be built exactly once per epoch at a changing size: the
    run rules of :mod:`..config.rules`, the same ones the launch check applies, on the trainer's arguments."""
    args = trainer.args
    template = getattr(trainer, 'template', None)
    callbacks = getattr(getattr(trainer, 'callback_handler', None), 'callbacks', ())
    listed = {cb.name: cb.config for cb in callbacks
              if getattr(cb, 'config_class', None) is not None and getattr(cb, 'config', None) is not None}
    model_type, layout, _ = run_model(trainer)
    check_facts(RunFacts(sequence_parallel_size=getattr(template, 'sequence_parallel_size', 1) or 1,
                         dataloader_drop_last=bool(args.dataloader_drop_last),
                         auto_find_batch_size=bool(args.auto_find_batch_size), streaming=streaming,
                         max_steps=args.max_steps, max_steps_unit=(config or IntegrationConfig()).max_steps_unit,
                         splitters=tuple(pass_splitters(listed)),
                         task_type=getattr(trainer, 'task_type', None) or getattr(template, 'task_type', None),
                         loss_type=getattr(args, 'loss_type', None),
                         compute_loss_func=custom_loss_name(getattr(trainer, 'compute_loss_func', None)),
                         label_smoothing_factor=float(getattr(args, 'label_smoothing_factor', 0) or 0),
                         router_aux_loss_coef=float(getattr(args, 'router_aux_loss_coef', 0) or 0),
                         world_size=distributed.world_size(),
                         average_tokens_across_devices=bool(getattr(args, 'average_tokens_across_devices', True)),
                         include_num_input_tokens_seen=getattr(args, 'include_num_input_tokens_seen', 'no') not in (
                             'no', False, None),
                         tokens_counted_per_slot=hasattr(transformers.Trainer, '_track_num_input_tokens'),
                         oom_recovery=(config or IntegrationConfig()).oom_recovery,
                         packed=host_packs_rows(trainer), moe=model_is_moe(trainer),
                         layout=layout, model_setting=f'model_type: {model_type}' if model_type else ''))


def length_key(trainer: Any) -> tuple[Any, ...]:
    """What changes an encoded row's length besides the raw row: the template (its class and type), ``max_length``,
    the truncation strategy and the template's mode (``train``, ``rlhf``, ``kto``: how many rows a sample is)."""
    template = getattr(trainer, 'template', None)
    meta = getattr(template, 'template_meta', None)
    return (type(template).__name__, getattr(meta, 'template_type', None), getattr(template, 'max_length', None),
            getattr(template, 'truncation_strategy', None), getattr(template, 'mode', None))


class DataFeed:
    """Builds and owns the training loader of one run.

    Args:
        trainer: the HF / ms-swift trainer (read: ``args``, ``_train_batch_size``, ``train_dataset``).
        config: the integration settings (``max_steps_unit``, ``stream_window``).
        decisions: where its records go.

    State: the loader's (key ``integration.data``, saved and restored by the integration); ``estimate_overruns``
    (micro-batches over the token budget because length estimates were low) is a log figure, not saved.
    """

    def __init__(self, trainer: Any, config: IntegrationConfig, decisions: Decisions) -> None:
        self.trainer = trainer
        self.config = config
        self.decisions = decisions
        self.image_rule: ResizeRule | None = None  # how the run's images are resized (the input kind's; begin)
        self.loader: TrainLoader | None = None
        self.fingerprint: dict[str, Any] | None = None  # the training dataset's (checked against a checkpoint's)
        self.estimate_overruns = 0
        self.row_media: list[int] | None = None  # each row's image and video tokens (a lazy dataset's estimate)
        self.vision_token_cost = 0.0  # an image (video) token's tower work in tokens (the step runner's; begin)
        self.media_token_ids: tuple[int, ...] = ()  # the input kind's image / video placeholder tokens (begin)

    # ---- building -----------------------------------------------------------------------------------------
    def build(self, host_loader: Any) -> Any:
        """Make the elastic (or stream) loader from the host's loader: its dataset, collate function, workers and
        order. Returns it, at the start of the data (the caller restores a checkpoint's position)."""
        trainer, args = self.trainer, self.trainer.args
        # a stream: ms-swift wraps a plain DataLoader in its DataLoaderDispatcher (rank 0 reads, then scatters)
        host_loader = getattr(host_loader, 'base_dataloader', host_loader)
        dataset = getattr(host_loader, 'dataset', None)
        if dataset is None:
            raise ConfigError('swift-dynamic-callbacks: the trainer\'s training loader has no dataset')
        loader_kwargs: dict[str, Any] = {
            'num_workers': host_loader.num_workers,
            'pin_memory': host_loader.pin_memory,
            'worker_init_fn': host_loader.worker_init_fn,
            'timeout': host_loader.timeout,
        }
        if host_loader.num_workers > 0:
            loader_kwargs['persistent_workers'] = host_loader.persistent_workers
            loader_kwargs['prefetch_factor'] = host_loader.prefetch_factor
            if host_loader.multiprocessing_context is not None:
                loader_kwargs['multiprocessing_context'] = host_loader.multiprocessing_context
        batch_size = int(trainer._train_batch_size)
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, '__len__'):
            self.loader = self._stream_loader(host_loader, dataset, loader_kwargs, batch_size)
            self.fingerprint = stream_fingerprint(dataset)
            return self.loader
        self.loader = ElasticDataLoader(
            dataset,
            host_loader.collate_fn,
            epoch_order_fn(host_loader, dataset, args),
            batch_size=batch_size,
            entries_per_step=args.gradient_accumulation_steps,
            loader_kwargs=loader_kwargs,
            lengths=lambda: self.dataset_lengths(dataset),
            real_tokens=lambda: dataset_real_tokens(dataset),
            global_order=global_order_fn(dataset, args),
            work_coef=model_work_coefficient(trainer),
            vision=lambda: self.dataset_vision(dataset))
        self.fingerprint = dataset_fingerprint(dataset)
        return self.loader

    def _stream_loader(self, host_loader: Any, dataset: Any, loader_kwargs: dict[str, Any],
                       batch_size: int) -> StreamLoader:
        """``streaming: true``: a :class:`~..data.stream.StreamLoader` over this rank's shard of the stream."""
        args = self.trainer.args
        check_supported(self.trainer, self.config, streaming=True)
        if host_loader.num_workers > 0:
            loader_kwargs['prefetch_factor'] = host_loader.prefetch_factor
        return StreamLoader(dataset, host_loader.collate_fn, batch_size=batch_size,
                            entries_per_step=args.gradient_accumulation_steps, loader_kwargs=loader_kwargs,
                            window=self.config.stream_window)

    def dataset_lengths(self, dataset: Any) -> list[int]:
        """Every sample's cost for a batch plan: the dataset's own lengths, or, for a lazily tokenised dataset, cheap
        estimates (:mod:`..data.length_estimates`; cached beside the dataset, shared by the ranks, refined as rows are
        encoded), with one ``length_estimate`` record."""
        if not is_lazy(dataset):
            return dataset_lengths(dataset)
        start = time.perf_counter()
        rule = self.image_rule
        lengths, info = estimate_lengths(
            dataset, lambda item, i: row_cost(item_lengths(item, i)),
            cache=cache_dir(dataset.dataset, os.path.join(self.trainer.args.output_dir, '.sdc_cache')),
            is_main=distributed.is_main_process(), wait=lambda: distributed.gather_objects(0),
            key=length_key(self.trainer) + (rule, ),
            image_tokens=None if rule is None else lambda w, h: image_tokens(w, h, rule),
            video_tokens=None if rule is None or rule.video is None else lambda v: video_tokens(v, rule.video))
        self.row_media = info.pop('row_media', None)
        if rule is not None:
            info['image_rule'] = asdict(rule)
        if self.loader is not None:
            self.loader.lengths_estimated = True
        seconds = round(time.perf_counter() - start, 3)
        self.decisions.hold(DecisionRecord('integration', 'length_estimate', 'lazy_tokenize', {
            **info, 'seconds': seconds, 'tokens_per_1000_chars': mean_ratio(info) if 'b' in info else None},
            f'lazy dataset: lengths of {info["rows"]} rows estimated from their characters ({info["sampled"]} rows '
            f'encoded{", read from the cache" if info["cached"] else ""}) in {seconds} s; refined as rows are encoded'))
        return lengths

    def dataset_vision(self, dataset: Any) -> list[int] | None:
        """Every sample's vision-tower work in tokens of the pass cost model, for the passes ``pass_tokens`` plans
        (the step runner prices each pass the same way): its image and video tokens (a lazy dataset's, counted from
        its files' headers by the length estimate; an encoded one's, its ``input_ids`` equal to the input kind's
        placeholder tokens, :attr:`media_token_ids`) x :attr:`vision_token_cost` (the step runner's,
        :func:`~.auto_budget.vision_cost`). ``None``: no tower priced, or media tokens unknown."""
        cost = self.vision_token_cost
        if not cost:
            return None
        if is_lazy(dataset):
            media = self.row_media
        else:
            media = dataset_media_tokens(dataset, list(self.media_token_ids)) if self.media_token_ids else None
        return None if media is None else [math.ceil(n * cost) for n in media]

    def check_same_dataset(self, dataloader: Any) -> None:
        """``control.new_dataloader`` must iterate the training dataset (only its batch size is taken)."""
        dataset = getattr(dataloader, 'dataset', None)
        if dataset is not self.loader.dataset and dataset is not self.trainer.train_dataset:
            raise ValueError('control.new_dataloader must iterate the trainer\'s training dataset '
                             f'(got a {type(dataloader).__name__} over {type(dataset).__name__}); the integration '
                             'only takes its batch size and keeps the epoch order and position')

    # ---- token budgets ------------------------------------------------------------------------------------
    def estimated_budget(self) -> int | None:
        """The token budget a micro-batch's real tokens must hold to while its lengths are estimates (a
        ``token_budget`` plan, or passes cut by ``pass_tokens``, over a lazily tokenised dataset), else ``None``."""
        loader = self.loader
        if loader is None or not loader.lengths_estimated or loader.plan is None:
            return None
        if loader.plan.cuts_passes:
            return loader.plan.pass_tokens
        return loader.plan.max_tokens if loader.plan.length_mode.sizes_by_tokens else None

    def report_over_budget(self, plan: BatchPlan) -> None:
        """After a new plan: hold one record for the samples longer than its token budget (each runs alone in its
        micro-batch). Collective."""
        loader = self.loader
        over = sum(distributed.gather_objects(loader.over_budget()), [])
        if over:
            longest = max(loader.lengths[i] for i in over)
            self._over_budget(over, longest, 'sample(s)', plan.max_tokens, hold=True)

    def report_step(self, splittable: bool) -> None:
        """After a step was drawn: record its micro-batches over the budget because the length estimates were low
        (``splittable``: they run as several passes within it), and a stream's rows over the budget (collective)."""
        loader = self.loader
        reports = loader.take_reports()
        # each rank records its own (no collective); under several processes the console names them
        for entry in reports.over_estimates:
            message = (f'micro-batch of {len(entry["indices"])} samples has {entry["padded"]} padded tokens, over '
                       f'micro_batch_tokens={loader.plan.max_tokens} (the length estimates were low); '
                       + ('it runs as several passes within the budget' if splittable else
                          'it runs in one pass, over the budget (passes cannot be split here)'))
            logger.warning(message)
            self.estimate_overruns += 1
            self.decisions.hold(DecisionRecord('integration', 'over_estimate', 'split' if splittable else 'warning', {
                'indices': entry['indices'][:32], 'padded': entry['padded'], 'max_tokens': loader.plan.max_tokens,
                'rank': distributed.rank()}, message))
        if not loader.has_length and loader.plan is not None:  # a stream: every rank reports at every step
            over = sum(distributed.gather_objects(reports.rows_over_budget), [])
            if over:
                self._over_budget([k for k, _ in over], max(cost for _, cost in over), 'stream row(s)',
                                  loader.plan.max_tokens, hold=False, epoch=loader.epoch)

    def _over_budget(self, indices: list[int], longest: int, what: str, max_tokens: int, *, hold: bool,
                     **extra: Any) -> None:
        message = (f'{len(indices)} {what} are longer than micro_batch_tokens={max_tokens} (longest {longest} '
                   'tokens); each runs alone in its micro-batch, over the token budget')
        logger.warning(message)
        record = DecisionRecord('integration', 'over_budget', 'warning', {
            'samples': len(indices), 'indices': sorted(indices)[:32], 'longest': longest, 'max_tokens': max_tokens,
            **extra}, message)
        (self.decisions.hold if hold else self.decisions.write)(record)

    # ---- the trace ----------------------------------------------------------------------------------------
    def write_trace(self, step: int, batches: list[list[int]], passes: list[int]) -> None:
        """``record_samples``: append this step's dataset indices to this rank's ``dynamic_samples.rank<R>.jsonl``
        (``batches``: a slot's indices each; ``passes``: the passes each slot was drawn as, before any OOM split)."""
        loader, rank = self.loader, distributed.rank()
        path = os.path.join(self.trainer.args.output_dir, SAMPLES_FILE.format(rank=rank))
        line = {'step': step, 'epoch': loader.epoch, 'rank': rank, 'batch_size': loader.batch_size,
                'num_pieces': loader.num_pieces, 'batches': batches, 'passes': passes}
        with open(path, 'a', encoding='utf-8') as f:
            f.write(json.dumps(line) + '\n')


def _set_host_epoch(host_loader: Any, epoch: int) -> None:
    if hasattr(host_loader, 'set_epoch'):
        host_loader.set_epoch(epoch)
    inner = getattr(getattr(host_loader, 'batch_sampler', None), 'batch_sampler', None)
    if hasattr(inner, 'set_epoch'):
        inner.set_epoch(epoch)


def epoch_order_fn(host_loader: Any, dataset: Any, args: Any) -> Callable[[int], list[int]]:
    """``epoch -> this rank's dataset indices in training order``.

    Single process: the host's own sampler decides (so the order is exactly plain ms-swift's / HF's, including
    ``group_by_length``). Several processes: a seeded permutation of *all* samples (seed ``data_seed + epoch``,
    as ms-swift) dealt ``rank::world``, because ms-swift's sampler leaves out ``len % world`` samples per epoch. Under
    sequence parallelism the ranks are the data ranks (a group shares its samples).
    """
    world = distributed.data_world()
    if world == 1:

        def host_order(epoch: int) -> list[int]:
            _set_host_epoch(host_loader, epoch)
            sampler = host_loader.batch_sampler if host_loader.batch_sampler is not None else host_loader.sampler
            order: list[int] = []
            for item in sampler:
                order.extend(item if isinstance(item, (list, tuple)) else [item])
            if sorted(order) != list(range(len(dataset))):
                raise StateError(f'the host sampler did not yield every index of the {len(dataset)}-sample dataset '
                                 f'exactly once in epoch {epoch} (got {len(order)} indices)')
            return order

        return host_order
    if getattr(args, 'group_by_length', False):
        raise group_by_length_error(f'world size {world}')
    rank, every = distributed.data_rank(), global_order_fn(dataset, args)

    def shard_order(epoch: int) -> list[int]:
        return every(epoch)[rank::world]

    return shard_order


def global_order_fn(dataset: Any, args: Any) -> Callable[[int], list[int]] | None:
    """``epoch -> all samples in the order the ranks' shards are dealt from`` (several processes; ``None`` on one:
    the host's sampler order is the epoch order there): a seeded permutation (``data_seed + epoch``), or the
    dataset order without ``train_dataloader_shuffle``. The same on every rank."""
    if distributed.data_world() == 1:
        return None
    n = len(dataset)
    seed = args.data_seed if args.data_seed is not None else 0
    shuffle = getattr(args, 'train_dataloader_shuffle', True)

    def every(epoch: int) -> list[int]:
        if not shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        return torch.randperm(n, generator=generator).tolist()

    return every


def model_work_coefficient(trainer: Any) -> float:
    """``a`` of a row's work ``a x L + L^2`` for the trainer's model (its config's hidden and intermediate sizes; a
    7B decoder's when it has none)."""
    config = getattr(getattr(trainer, 'model', None), 'config', None)
    config = getattr(config, 'text_config', None) or config
    return work_coefficient(getattr(config, 'hidden_size', None), getattr(config, 'intermediate_size', None))

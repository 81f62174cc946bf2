"""The trainer-side integration: the only code that knows HF ``Trainer`` / ms-swift internals.

:func:`install` mixes :class:`DynamicTrainerMixin` into the trainer's class (works for ms-swift's
``Seq2SeqTrainer`` and for a plain ``transformers.Trainer``) and adds :class:`IntegrationCallback`. From then on:

- ``get_train_dataloader`` wraps the host's loader settings (collate function, workers, seed order) into an
  :class:`~swift_dynamic_callbacks.loader.ElasticDataLoader` that has no fixed length, so HF runs its
  ``max_steps`` loop (for ``num_train_epochs`` runs, ``max_steps`` is derived from the initial batch size and the
  epoch budget is enforced here);
- ``get_batch_samples`` (called by HF once per optimizer step, in every supported transformers version) is
  the step boundary: it applies and clears the control-flag requests (``protocol``), agreed across ranks,
  then draws the step's micro-batches from the elastic loader instead of HF's epoch iterator;
- ``training_step`` splits a micro-batch into ``num_pieces`` forward/backward passes (same
  ``num_items_in_batch``, so the same gradient) and skips the empty placeholder of a short last step;
- ``IntegrationCallback.on_step_end`` ends the HF epoch when the data epoch is used up
  (``control.should_epoch_stop``), keeps ``state.epoch`` honest and stops at the epoch budget;
- ``_save_checkpoint`` writes the pack state (:mod:`~swift_dynamic_callbacks.state`) into the checkpoint first;
  ``train(resume_from_checkpoint=...)`` restores it, so a resumed run continues at the next unseen sample;
- ``log`` merges the current numbers (batch size, samples seen, callbacks' ``dynamic_metrics``) into every
  training log line and logs the LR the optimizer used in the step (ms-swift reads it after the scheduler
  stepped, i.e. the next step's), and decision records are written to ``dynamic_decisions.jsonl`` on rank 0.

``_inner_training_loop`` is not overridden. Helpers without trainer state live beside this module:
:mod:`.passes` (a micro-batch as passes, gradient snapshots, the noise probe), :mod:`.requests` (merging the ranks'
requests, ``applied_request`` records and replay) and :mod:`.scheduler` (the ``LambdaLR`` wrapper).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import asdict, replace
from typing import Any, Callable, Iterable, Mapping

import torch
from transformers import TrainerCallback

from .. import distributed, protocol
from ..config import ConfigError, to_mapping
from ..config.integration import IntegrationConfig
from ..config.pack import group_by_length_error, ignore_data_skip_error
from ..lengths import cache_dir, estimate_lengths, is_lazy, mean_ratio
from ..loader import (ElasticDataLoader, dataset_fingerprint, dataset_lengths, dataset_real_tokens, item_lengths,
                      row_cost)
from ..policies.data_plan import steps_to_budget
from ..policies.length import BatchPlan, padding_fraction
from ..stream_loader import StreamLoader, stream_fingerprint
from ..records import DECISIONS_FILE, DecisionLog, DecisionRecord
from ..state import (BINDING_KEY, STATE_FILE, StateError, binding_entry, build_payload, check_binding, file_digest,
                     new_run_id, read_state, restore_components, settings_changes, stateful_components, write_state)

from .engines import Engine, engine_name, select_engine
from .losses import loss_watch
from .passes import GradNoiseProbe, SampleTooLargeError  # noqa: F401  (SampleTooLargeError: re-exported)
from .requests import (LR_RECORD_KINDS, changes_lr, is_request_record, load_replay, merge_step, request_to_json,
                       set_request)
from .scheduler import ScaledLambda
from .steps import StepRunner

logger = logging.getLogger('swift_dynamic_callbacks')
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter('[swift-dynamic-callbacks] %(message)s'))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

SAMPLES_FILE = 'dynamic_samples.rank{rank}.jsonl'
_PAIRS_WHY = ('a micro-batch of pairs is its chosen rows then its rejected rows (KTO: completions and KL rows) and '
              'the loss is a mean over pairs, so it cannot be split into smaller forward/backward passes')
CONFIG_FILE = 'dynamic_callbacks_config.json'
#: settings that do not change what is trained: a resume may change them without ``allow_config_change``
LOGGING_SETTINGS = ('integration.record_samples', 'integration.log_values', 'integration.fail_fast',
                    'integration.allow_config_change', 'training_log')


class Integration:
    """State and logic of the integration for one trainer (reachable as ``trainer.dynamic_integration``).

    State: the loader's (key ``integration.data``: data position, batch size, pieces) and its own (key
    ``integration``: the requests still pending on ``control`` when the checkpoint was written, e.g. made in
    ``on_step_end`` of the saved step, with the decision records that go with them; they are set again on resume
    and applied, and the records written, at the first step). The epoch
    budget and the scheduler length are derived from the arguments again; the LR scale is in ``scheduler.pt``.
    """

    state_key = 'integration'

    def __init__(self, trainer: Any, config: IntegrationConfig | None = None,
                 pack_config: Mapping[str, Any] | None = None) -> None:
        self.trainer = trainer
        self.config = config or IntegrationConfig()
        self.pack_config = dict(pack_config or {})
        self.loader: ElasticDataLoader | None = None
        self.decisions = DecisionLog(None, enabled=False)
        self.epoch_budget: float | None = None  # num_train_epochs (or a sample budget as epochs of data)
        self._budget_reason = 'epoch_budget'
        self.scheduler_steps: int | None = None  # the LR schedule's length in epoch-based runs
        self._user_max_steps: int | None = None
        self._resume_payload: dict[str, Any] | None = None
        self._resume_checkpoint: str | None = None
        self._samples_at_start = 0
        self.tokens_seen = 0  # this rank's input tokens (non-padding) of the micro-batches drawn so far
        self.padded_tokens_seen = 0  # the same micro-batches' tokens with padding (rows x padded length)
        self._token_mark: tuple[float, int] | None = None  # (time, all ranks' tokens) at the last log line
        self._scheduler: Any = None
        self.horizon: int | None = None  # the LR schedule's length in optimizer steps (before any stretch)
        self.step_lr: float | None = None  # the LR the running optimizer step uses (first param group)
        self.pass_limit: dict[str, Any] | None = None  # the cap on samples per forward/backward pass
        self._can_split: bool | None = None  # whether a micro-batch may run as several passes (checked once)
        self.estimate_overruns = 0  # micro-batches over the token budget because length estimates were low
        self.engine: Engine = Engine(trainer)  # the engine adapter, chosen in begin_train
        self.runner = StepRunner(self, self.engine, oom_recovery=False, single_sample_retries=0)
        self._held: list[DecisionRecord] = []  # callbacks' records, written at the next step boundary
        self.replay: dict[int, protocol.BatchRequest] | None = None  # step -> recorded request (replay setting)
        self.run_id: str | None = None  # this run's identity in its checkpoints (kept across resumes)
        self._binding: dict[str, Any] | None = None  # the resumed state's binding (step, samples, dataset)
        self._dataset_fingerprint: dict[str, Any] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------
    def begin_train(self, resume_from_checkpoint: Any) -> None:
        """Called by ``train()`` before HF starts: open the decision log, restore callback state."""
        trainer = self.trainer
        args = trainer.args
        self._check_supported(trainer)
        self.decisions = DecisionLog(
            os.path.join(args.output_dir, DECISIONS_FILE), enabled=distributed.is_main_process())
        self._start_engine()
        if distributed.is_main_process():
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, CONFIG_FILE), 'w', encoding='utf-8') as f:
                json.dump(self.snapshot_config(), f, indent=1, sort_keys=True, default=str)
        _add_integration_callback(trainer, self)
        trainer.control._sdc_integration = True
        setattr(trainer.control, protocol.FAIL_FAST, self.config.fail_fast)
        if self.config.replay is not None:
            self.replay = load_replay(self.config.replay)
            message = (f'replaying {len(self.replay)} applied requests from {self.config.replay}: the callbacks\' '
                       'batch and LR requests are ignored (their deciding is off) and their request records are not '
                       'written; the recorded requests are applied at the same step boundaries')
            logger.warning(message)
            self._record(DecisionRecord('integration', 'replay', 'start', {
                'file': self.config.replay, 'requests': len(self.replay), 'steps': sorted(self.replay)[:64]}, message))
        checkpoint = resume_from_checkpoint
        if isinstance(checkpoint, bool):
            checkpoint = None
            if resume_from_checkpoint:
                from transformers.trainer_utils import get_last_checkpoint
                checkpoint = get_last_checkpoint(args.output_dir)
        self._resume_checkpoint = checkpoint
        self._resume_payload = read_state(checkpoint) if checkpoint else None
        self.run_id = new_run_id()
        if checkpoint and self._resume_payload is not None:
            self._check_resumed_state(checkpoint, self._resume_payload)
            source = os.path.join(checkpoint, STATE_FILE)
            missing = restore_components([self] + self.callback_components(), self._resume_payload, source=source)
            for key in missing:
                self._record(
                    DecisionRecord(
                        'integration', 'resume', 'new_component', {'state_key': key},
                        f'{key} has no state in {checkpoint}; it starts fresh'))
        self._user_max_steps = args.max_steps

    def settings_snapshot(self) -> dict[str, Any]:
        """Normalised settings of the integration and of every pack callback on the trainer (compared at resume)."""
        from ..callbacks.base import DynamicCallback
        snapshot = {'integration': to_mapping(self.config)}
        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, DynamicCallback) and dataclasses.is_dataclass(cb.config):
                snapshot[cb.name] = json.loads(json.dumps(to_mapping(cb.config), default=str))
        return snapshot

    def _check_resumed_state(self, checkpoint: str, payload: Mapping[str, Any]) -> None:
        """Refuse a state that does not belong to ``checkpoint`` and settings that changed since it was written
        (unless ``allow_config_change``, then each change is a ``config_change`` record)."""
        binding = check_binding(checkpoint, payload)
        if binding is None:
            self._record(DecisionRecord('integration', 'resume', 'unbound', {'checkpoint': os.path.basename(checkpoint)},
                                        'the pack state was written by an earlier version (format 1): it is not bound '
                                        'to its checkpoint and its settings are not compared'))
            return
        self._binding = binding
        self.run_id = binding.get('run_id') or self.run_id
        if 'settings' not in payload:
            return
        changes = settings_changes(payload['settings'], self.settings_snapshot(), ignore=LOGGING_SETTINGS)
        if not changes:
            return
        listed = '; '.join(f'{k}: {old!r} -> {new!r}' for k, (old, new) in changes.items())
        if not self.config.allow_config_change:
            raise StateError(f'the settings changed since {checkpoint} was written ({listed}); the resumed run would '
                             'silently train otherwise than the saved one. Resume with the same settings, or set '
                             'dynamic_callbacks.integration.allow_config_change: true to apply the new ones (each '
                             'change is then recorded)')
        for key, (old, new) in changes.items():
            self._record(DecisionRecord('integration', 'config_change', 'resume', {'setting': key, 'old': old,
                                                                                   'new': new},
                                        f'{key} changed at resume: {old!r} -> {new!r} (allow_config_change)'))

    def _start_engine(self) -> None:
        """Choose the engine adapter (once), refuse what it cannot run, and record what was chosen."""
        from ..config.engines import check_engine
        name = engine_name(self.trainer)
        listed = [getattr(cb, 'name', '') for cb in self.trainer.callback_handler.callbacks]
        check_engine(name, self.pack_config, listed)
        self.engine, recovery, why_off = select_engine(self.trainer, self.config.oom_recovery)
        if recovery and self.pairs:
            if self.config.oom_recovery is True:
                raise ConfigError(f'dynamic_callbacks.integration.oom_recovery: true is not supported under swift '
                                  f'rlhf: {_PAIRS_WHY}; use auto or false')
            recovery, why_off = False, f'swift rlhf: {_PAIRS_WHY}'
        self.runner = StepRunner(self, self.engine, oom_recovery=recovery,
                                 single_sample_retries=self.config.oom_single_sample_retries)
        facts = {**self.engine.describe(), 'oom_recovery': recovery}
        message = f'engine {self.engine.name}' + ('' if recovery else f'; OOM recovery off ({why_off})')
        if not recovery and self.config.oom_recovery == 'auto':
            logger.warning(message)
        self._record(DecisionRecord('integration', 'engine', self.engine.name, facts, message))

    def end_train(self) -> None:
        if self._user_max_steps is not None:
            self.trainer.args.max_steps = self._user_max_steps
        if self.loader is not None:
            self.loader.close()
        self.drain(self.trainer.control)
        if self.runner.oom is not None and self.runner.oom.get('record') is not None:
            self._held.append(self.runner.oom['record'])  # an OOM in the last step: no boundary exchanged it
        if protocol.has_pending_request(self.trainer.control):  # decided after the last step: never applied here
            self._held = [
                replace(r, values={**r.values, 'pending': True},
                        message=f'{r.message}; pending at the end of training (a resumed run applies it)'.lstrip('; '))
                if is_request_record(r) else r for r in self._held
            ]
        self.flush()

    def callback_components(self) -> list[Any]:
        """Stateful pack callbacks on the trainer (everything with ``state_key``/``state_dict``)."""
        return stateful_components(self.trainer.callback_handler.callbacks)

    def snapshot_config(self) -> dict[str, Any]:
        snapshot = dict(self.pack_config)
        snapshot['integration'] = to_mapping(self.config)
        return snapshot

    @staticmethod
    def _check_supported(trainer: Any) -> None:
        args = trainer.args
        template = getattr(trainer, 'template', None)
        if getattr(template, 'sequence_parallel_size', 1) > 1:
            raise ConfigError('sequence_parallel_size: swift-dynamic-callbacks does not support sequence parallelism '
                              f'(got {template.sequence_parallel_size}); use 1')
        if args.dataloader_drop_last:
            raise ConfigError('dataloader_drop_last: must be false with swift-dynamic-callbacks (every sample is '
                              'used exactly once per epoch; the last step of an epoch takes what is left)')
        if args.auto_find_batch_size:
            raise ConfigError('auto_find_batch_size: must be false with swift-dynamic-callbacks (it restarts '
                              'training from step 0 on OOM); the pack changes the batch size in place')

    # ---- the loader --------------------------------------------------------------------------------
    def build_loader(self, host_loader: Any) -> ElasticDataLoader:
        """Make the elastic loader from the host's loader (its dataset, collate function, workers and order)."""
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
            return self._build_stream_loader(host_loader, dataset, loader_kwargs, batch_size)
        order = _epoch_order_fn(host_loader, dataset, args)
        loader = ElasticDataLoader(
            dataset,
            host_loader.collate_fn,
            order,
            batch_size=batch_size,
            entries_per_step=args.gradient_accumulation_steps,
            loader_kwargs=loader_kwargs,
            lengths=lambda: self._dataset_lengths(dataset),
            real_tokens=lambda: dataset_real_tokens(dataset))
        return self._adopt_loader(loader, dataset_fingerprint(dataset), batch_size)

    def _build_stream_loader(self, host_loader: Any, dataset: Any, loader_kwargs: dict[str, Any],
                             batch_size: int) -> StreamLoader:
        """``streaming: true``: a :class:`~..stream_loader.StreamLoader` over this rank's shard of the stream."""
        args = self.trainer.args
        if args.max_steps <= 0:
            raise ConfigError(f'max_steps: streaming: true needs max_steps > 0 (a stream has no length, so '
                              f'num_train_epochs cannot be turned into steps); got {args.max_steps}')
        if self.config.max_steps_unit != 'steps':
            raise ConfigError(f'dynamic_callbacks.integration.max_steps_unit: {self.config.max_steps_unit} is not '
                              'supported with streaming: true (a sample budget needs the dataset length); use steps')
        if host_loader.num_workers > 0:
            loader_kwargs['prefetch_factor'] = host_loader.prefetch_factor
        loader = StreamLoader(dataset, host_loader.collate_fn, batch_size=batch_size,
                              entries_per_step=args.gradient_accumulation_steps, loader_kwargs=loader_kwargs,
                              window=self.config.stream_window)
        return self._adopt_loader(loader, stream_fingerprint(dataset), batch_size)

    def _adopt_loader(self, loader: Any, fingerprint: dict[str, Any], batch_size: int) -> Any:
        """Make ``loader`` the training loader: note the dataset's fingerprint (checked against a checkpoint's), restore
        its position from a checkpoint, and derive ``max_steps`` from it."""
        self.loader = loader
        self._dataset_fingerprint = fingerprint
        self._restore_loader(loader)
        self._samples_at_start = loader.samples_seen
        self._derive_max_steps(loader, batch_size)
        return loader

    def _dataset_lengths(self, dataset: Any) -> list[int]:
        """Every sample's cost for a batch plan: the dataset's own lengths, or, for a lazily tokenised dataset, cheap
        estimates (:mod:`..lengths`; cached beside the dataset, shared by the ranks, refined as rows are encoded),
        with one ``length_estimate`` record."""
        if not is_lazy(dataset):
            return dataset_lengths(dataset)
        import time
        start = time.perf_counter()
        lengths, info = estimate_lengths(
            dataset, lambda item, i: row_cost(item_lengths(item, i)),
            cache=cache_dir(dataset.dataset, os.path.join(self.trainer.args.output_dir, '.sdc_cache')),
            is_main=distributed.is_main_process(), wait=lambda: distributed.gather_objects(0))
        if self.loader is not None:
            self.loader.lengths_estimated = True
        seconds = round(time.perf_counter() - start, 3)
        self._held.append(DecisionRecord('integration', 'length_estimate', 'lazy_tokenize', {
            **info, 'seconds': seconds, 'tokens_per_1000_chars': mean_ratio(info) if 'b' in info else None},
            f'lazy dataset: lengths of {info["rows"]} rows estimated from their characters ({info["sampled"]} rows '
            f'encoded{", read from the cache" if info["cached"] else ""}) in {seconds} s; refined as rows are encoded'))
        return lengths

    def effective_pass_limit(self) -> dict[str, Any] | None:
        """The pass limit, with the token budget added while lengths are estimates: a micro-batch whose real padded
        tokens exceed ``max_tokens`` then runs as several passes within it (when passes can split, same gradient)."""
        loader = self.loader
        if loader is None or not getattr(loader, 'lengths_estimated', False) or loader.plan is None or \
                loader.plan.mode != 'token_budget' or not self._splittable():
            return self.pass_limit
        limit = dict(self.pass_limit or {})
        tokens = limit.get('tokens')
        limit['tokens'] = loader.plan.max_tokens if tokens is None else min(tokens, loader.plan.max_tokens)
        return limit

    def _splittable(self) -> bool:
        if self._can_split is None:
            try:
                self.check_splittable('length estimates')
                self._can_split = True
            except ConfigError:
                self._can_split = False
        return self._can_split

    def _over_estimates(self, loader: ElasticDataLoader) -> None:
        """Record the micro-batches of this step whose real padded tokens exceeded the budget (rank 0 writes; no
        collective: each rank records its own, under several processes the console log names them)."""
        over, loader.over_estimates = loader.over_estimates, []
        split = self._splittable()
        for entry in over:
            message = (f'micro-batch of {len(entry["indices"])} samples has {entry["padded"]} padded tokens, over '
                       f'max_tokens={loader.plan.max_tokens} (the length estimates were low); '
                       + ('it runs as several passes within the budget' if split else
                          'it runs in one pass, over the budget (passes cannot be split here)'))
            logger.warning(message)
            self.estimate_overruns += 1
            self._held.append(DecisionRecord('integration', 'over_estimate', 'split' if split else 'warning', {
                'indices': entry['indices'][:32], 'padded': entry['padded'], 'max_tokens': loader.plan.max_tokens,
                'rank': distributed.rank()}, message))

    def _restore_loader(self, loader: ElasticDataLoader) -> None:
        checkpoint = self._resume_checkpoint
        if not checkpoint:
            return
        payload = self._resume_payload
        if payload is not None and loader.state_key in payload['components']:
            if self.trainer.args.ignore_data_skip:
                raise ignore_data_skip_error(checkpoint)
            self._check_same_data(checkpoint, loader)
            source = os.path.join(checkpoint, STATE_FILE)
            restore_components([loader], {'components': {
                loader.state_key: _rank_state(payload['components'], loader.state_key)}}, source=source)
            self._record(
                DecisionRecord(
                    'integration', 'resume', 'checkpoint', {
                        'checkpoint': os.path.basename(checkpoint),
                        'epoch': loader.epoch,
                        'position': loader.position,
                        'batch_size': loader.batch_size,
                        'num_pieces': loader.num_pieces
                    }, 'resumed at the next unseen sample'))
            return
        # A checkpoint written without the pack: the batch size never changed, so HF's batch arithmetic holds.
        state_file = os.path.join(checkpoint, 'trainer_state.json')
        if self.trainer.args.ignore_data_skip or not os.path.exists(state_file):
            return
        with open(state_file, encoding='utf-8') as f:
            global_step = int(json.load(f).get('global_step', 0))
        consumed = global_step * loader.batch_size * loader.entries_per_step
        epoch_size = max(loader.epoch_size, 1) if not getattr(loader, 'streaming', False) else consumed + 1
        epoch, position = divmod(consumed, epoch_size)
        for _ in range(epoch):
            loader.start_next_epoch()
        loader.position = position
        loader.samples_seen = consumed
        self._record(
            DecisionRecord('integration', 'resume', 'no_pack_state', {
                'global_step': global_step,
                'epoch': epoch,
                'position': position
            }, f'{checkpoint} has no pack state; position derived from global_step at a constant batch size'))

    def _check_same_data(self, checkpoint: str, loader: ElasticDataLoader) -> None:
        """Refuse a resume over another training dataset than the one the checkpoint's position counts in."""
        saved = (self._binding or {}).get('dataset')
        if not saved:
            return
        now = self._dataset_fingerprint or (stream_fingerprint if getattr(loader, 'streaming', False) else
                                            dataset_fingerprint)(loader.dataset)
        if saved.get('size') != now['size'] or (saved.get('sha256') and now['sha256']
                                                  and saved['sha256'] != now['sha256']):
            what = (f'{saved.get("size")} samples then, {now["size"]} now' if saved.get('size') != now['size'] else
                    'the same number of samples, other content')
            raise StateError(f'{checkpoint} was written for another training dataset ({what}): its data position would '
                             'point at other samples. Resume with the same dataset and preprocessing (dataset files, '
                             'max_length, dataset_seed, split_dataset_ratio)')

    def _derive_max_steps(self, loader: ElasticDataLoader, batch_size: int) -> None:
        """For ``num_train_epochs`` runs: give HF a loop bound that no batch size can outrun, and the epoch budget.

        ``args.max_steps`` becomes the steps needed at batch size 1 (HF's loop and epoch ranges never run short,
        so no epoch ends early); the LR scheduler gets the honest estimate at the initial batch size
        (``create_scheduler``); ``state.max_steps`` follows the budget at the current batch size
        (:meth:`update_max_steps`); training stops when the budget of data is used (:meth:`after_step`).
        """
        args = self.trainer.args
        entries = loader.entries_per_step
        if args.max_steps > 0 and self.config.max_steps_unit == 'steps':
            self.epoch_budget = self.scheduler_steps = None
            return
        if args.max_steps > 0:  # a sample budget: max_steps steps at the initial batch size, as epochs of data
            budget_samples = args.max_steps * batch_size * entries
            epochs = budget_samples / max(loader.epoch_size, 1)
            reason = 'sample_budget'
            message = (f'max_steps {args.max_steps} at batch size {batch_size} is a budget of {budget_samples} '
                       'samples per device; training stops when they are used, whatever the batch sizes')
        else:
            epochs = float(args.num_train_epochs)
            if epochs <= 0:
                raise ConfigError(f'num_train_epochs: must be > 0 when max_steps is not set, got {epochs}')
            reason = 'epoch_budget'
            message = (f'{epochs} epochs at batch size {batch_size} are {{steps}} optimizer steps (the LR schedule\'s '
                       'length); training stops when the epochs of data are used, whatever the batch sizes')
        self.epoch_budget = epochs
        self._budget_reason = reason
        self.scheduler_steps = steps_to_budget(0, 0, loader.epoch_size, epochs, batch_size, entries)
        values = {'num_train_epochs': epochs, 'max_steps': self.scheduler_steps}
        if reason == 'sample_budget':
            values = {'budget_samples': budget_samples, 'epochs': epochs, 'max_steps': self.scheduler_steps}
        args.max_steps = steps_to_budget(0, 0, loader.epoch_size, epochs, 1, entries)
        values['loop_bound'] = args.max_steps
        self._record(
            DecisionRecord('integration', 'max_steps', reason, values, message.format(steps=self.scheduler_steps)))

    def update_max_steps(self, state: Any, reason: str) -> None:
        """Keep ``state.max_steps`` (progress, remaining time, HF's stop) equal to the steps the epoch budget needs,
        and stretch the LR schedule's remaining part to end there (no jump at the change)."""
        loader = self.loader
        if self.epoch_budget is None or loader is None:
            return
        needed = state.global_step + loader.steps_to_budget(self.epoch_budget)
        if needed != state.max_steps:
            old, state.max_steps = state.max_steps, needed
            self.sync_progress_bars(needed)
            if self.scheduler_steps is not None:
                for fn in getattr(self._scheduler, 'lr_lambdas', None) or []:
                    if isinstance(fn, ScaledLambda):
                        fn.stretch(state.global_step, needed, self.scheduler_steps)
            if reason != 'start':
                self._record(
                    DecisionRecord('integration', 'max_steps', reason, {
                        'old': old,
                        'new': needed
                    }, f'the epoch budget needs {needed} steps at batch size {loader.batch_size}'))

    def sync_progress_bars(self, total: int) -> None:
        """Set the total of the trainer's progress bars (HF's ``ProgressCallback``, ms-swift's
        ``ProgressCallbackNew``: a tqdm in ``training_bar``) to ``total``: the bar follows every ``max_steps``
        change, up or down, and a run that ends early ends at N/N."""
        for callback in self.trainer.callback_handler.callbacks:
            bar = getattr(callback, 'training_bar', None)
            if bar is not None and getattr(bar, 'total', None) != total:
                bar.total = total
                bar.refresh()

    # ---- the step boundary ---------------------------------------------------------------------------
    def next_step(self, num_batches: int, device: Any, original: Callable) -> tuple[list, Any]:
        """HF's ``get_batch_samples``: apply requests, then draw this step's micro-batches."""
        trainer, loader = self.trainer, self.loader
        if loader is None:
            raise RuntimeError('swift-dynamic-callbacks: get_batch_samples before get_train_dataloader')
        control = trainer.control
        control._sdc_integration = True
        if control.should_training_stop:  # e.g. a resumed run that had stopped: no step, HF leaves the loop
            self.runner.clear()
            return [], None
        self.apply_requests(control)
        optimizer = getattr(trainer, 'optimizer', None)
        self.step_lr = float(optimizer.param_groups[0]['lr']) if optimizer is not None else None
        if loader.epoch_complete:
            loader.start_next_epoch()
        if self._token_mark is None:  # the first step of this run (or of a resumed one): tokens/s start here
            self._token_mark = (time.monotonic(), distributed.sum_ints([self.tokens_seen])[0])
        pairs = loader.next_step(num_batches)
        if getattr(loader, 'over_estimates', None):
            self._over_estimates(loader)
        if getattr(loader, 'streaming', False) and loader.plan is not None:
            self._stream_over_budget(loader)
        real = [batch for indices, batch in pairs if indices]
        self.tokens_seen += sum(count_tokens(batch) for batch in real)
        self.padded_tokens_seen += sum(count_tokens(batch, padded=True) for batch in real)
        # A rank whose step is placeholders only still counts (0) items: HF gathers the count across ranks.
        counted = real or ([{'labels': torch.full((1, 1), -100)}] if distributed.world_size() > 1 else [])
        _, num_items_in_batch = original(iter(counted), len(counted), device)
        setattr(control, protocol.GRAD_NOISE_SAMPLE, None)
        setattr(control, protocol.OOM_EVENT, None)
        probe = None
        if protocol.grad_noise_requested(control):
            self.engine.refuse('noise_scale', 'control.measure_grad_noise (batch_growth policy: noise_scale)')
            probe = GradNoiseProbe(
                sum(len(indices) for indices, _ in pairs), world=distributed.world_size(),
                tokens_averaged=bool(getattr(trainer.args, 'average_tokens_across_devices', False)),
                num_items_in_batch=num_items_in_batch)
        self.runner.start_step(pairs, probe)
        if self.config.record_samples:
            self._write_samples([indices for indices, _ in pairs])
        return [batch for _, batch in pairs], num_items_in_batch

    def apply_requests(self, control: Any) -> None:
        """Read the request flags, agree on them across ranks, apply them, clear them; write the decisions.

        A change a callback recorded itself is not recorded twice; an LR change is added to the callback's record
        (``old_lr``/``new_lr``). A change requested through the raw flags alone gets a ``control_flags`` record.
        """
        request = protocol.pending_request(control)
        if request.via_dataloader:
            self._check_same_dataset(control.new_dataloader)
        protocol.clear_requests(control)
        if self.replay is not None:  # the recorded request of this boundary instead of the callbacks'
            request = self.replay.get(self.trainer.state.global_step, protocol.BatchRequest())
        oom = self.runner.oom
        if oom is not None and oom.get('new_cap') is not None:  # this rank's OOM cap: every rank takes the smallest
            own = dict(request.pass_limit or self.pass_limit or {})
            own['samples'] = min(v for v in (own.get('samples'), oom['new_cap']) if v is not None)
            request = replace(request, pass_limit=protocol.check_pass_limit(own))
        own_oom = (oom or {}).get('record')
        # one small all-reduce decides whether any rank has something to agree on (most boundaries: nothing); only
        # then are the requests and OOM records gathered
        if distributed.sum_ints([int(not request.empty or own_oom is not None)])[0]:
            request, ooms = distributed.agree((request, own_oom), merge_step)
        else:
            ooms = []
        self.drain(control)
        self._held.extend(ooms)  # every rank's OOM of the last step, on every rank (rank 0 writes them)
        if self.replay is not None:
            self._held = [r for r in self._held
                          if r.source == 'integration' or not (is_request_record(r) or r.kind == 'batch_plan')]
        try:
            if not request.empty:
                self._apply(request)
                self._held.append(
                    DecisionRecord('integration', 'applied_request', 'replay' if self.replay is not None else 'agreed',
                                   request_to_json(request)))
        finally:
            self.flush()

    def _apply(self, request: protocol.BatchRequest) -> None:
        loader = self.loader
        queued_kinds = {r.kind for r in self._held}
        queued_kinds.update(k for r in self._held for k in ('num_pieces', 'lr_scale') if k in r.values)
        if 'oom' in queued_kinds:  # the OOM records (every rank's) name the new pass cap
            queued_kinds.add('pass_limit')
        if request.batch_size is not None and request.batch_size != loader.batch_size:
            old = loader.batch_size
            loader.set_batch_size(request.batch_size)
            self.update_max_steps(self.trainer.state, 'batch_size')
            if 'batch_size' not in queued_kinds:
                self._record(
                    DecisionRecord(
                        'control_flags', 'batch_size', 'new_dataloader' if request.via_dataloader else 'request', {
                            'old': old,
                            'new': request.batch_size,
                            'global_batch_size': self.global_batch_size()
                        }))
        if request.batch_plan is not None:
            self._apply_batch_plan(request.batch_plan, queued_kinds)
        if request.num_pieces is not None and request.num_pieces != loader.num_pieces:
            if request.num_pieces > 1:
                self.check_splittable('control.new_num_pieces')
            old = loader.num_pieces
            loader.num_pieces = request.num_pieces
            if 'num_pieces' not in queued_kinds:
                self._record(
                    DecisionRecord('control_flags', 'num_pieces', 'request', {
                        'old': old,
                        'new': request.num_pieces
                    }))
        if request.pass_limit is not None and request.pass_limit != self.pass_limit:
            if any(request.pass_limit.values()) and 'oom' not in queued_kinds:
                self.check_splittable('control.new_pass_limit', 'pass_limit')  # refused up front, not at a split
            old_limit = self.pass_limit
            self.pass_limit = None if all(not v for v in request.pass_limit.values()) else dict(request.pass_limit)
            if 'pass_limit' not in queued_kinds:
                self._record(
                    DecisionRecord('control_flags', 'pass_limit', 'request', {
                        'old': old_limit,
                        'new': self.pass_limit
                    }))
        old_lr = self._current_lr()
        if request.lr_schedule is not None:
            self.set_lr_schedule(request.lr_schedule)
            if not any(r.kind in LR_RECORD_KINDS for r in self._held):
                self._record(DecisionRecord('control_flags', 'lr_schedule', 'request', {'schedule': request.lr_schedule}))
        scaled = request.lr_scale is not None and request.lr_scale != self.lr_scale
        if scaled:
            old_scale = self.lr_scale
            self.set_lr_scale(request.lr_scale)
        if scaled or request.lr_schedule is not None:
            new_lr = self._current_lr()
            self._held = [
                replace(r, values={**r.values, 'old_lr': old_lr, 'new_lr': new_lr},
                        message=f'{r.message}; lr {old_lr:.4g} -> {new_lr:.4g}'.lstrip('; '))
                if changes_lr(r) else r for r in self._held
            ]
        if scaled:
            if 'lr_scale' not in queued_kinds:
                self._record(
                    DecisionRecord('control_flags', 'lr_scale', 'request', {
                        'old': old_scale,
                        'new': request.lr_scale,
                        'old_lr': old_lr,
                        'new_lr': self._current_lr()
                    }))

    def _apply_batch_plan(self, mapping: Mapping[str, Any], queued_kinds: set[str]) -> None:
        """``new_batch_plan``: hand the plan to the loader, add what it plans for the rest of the epoch to the plan's
        decision record, and write a warning record for samples longer than the token budget (each runs alone)."""
        loader = self.loader
        plan = BatchPlan.from_json(mapping)
        old = loader.plan.to_json() if loader.plan is not None else None
        if not loader.set_plan(plan):
            return
        self.update_max_steps(self.trainer.state, 'batch_plan')
        real, padded, batches = loader.planned_padding()
        applied = {'micro_batches_left': batches, 'planned_padding_fraction': round(padding_fraction(real, padded), 6),
                   'bucketed_from_epoch': loader.epoch if loader.order_bucketed else loader.epoch + 1}
        if 'batch_plan' in queued_kinds:
            self._held = [replace(r, values={**r.values, **applied}) if r.kind == 'batch_plan' else r
                          for r in self._held]
        else:
            self._held.append(DecisionRecord('control_flags', 'batch_plan', 'request', {'old': old, 'new': mapping,
                                                                                         **applied}))
        over = sum(distributed.gather_objects(loader.over_budget()), [])
        if over:
            longest = max(loader.lengths[i] for i in over)
            message = (f'{len(over)} sample(s) are longer than max_tokens={plan.max_tokens} (longest {longest} '
                       'tokens); each runs alone in its micro-batch, over the token budget')
            logger.warning(message)
            self._held.append(DecisionRecord('integration', 'over_budget', 'warning', {
                'samples': len(over), 'indices': sorted(over)[:32], 'longest': longest, 'max_tokens': plan.max_tokens
            }, message))

    def _stream_over_budget(self, loader: StreamLoader) -> None:
        """On a stream, rows over the token budget are met window by window: one ``over_budget`` record each time
        (collective: every rank calls it at the same step boundary)."""
        rows, loader.over_budget_rows = loader.over_budget_rows, []
        over = sum(distributed.gather_objects(rows), [])
        if not over:
            return
        longest = max(cost for _, cost in over)
        message = (f'{len(over)} stream row(s) are longer than max_tokens={loader.plan.max_tokens} (longest {longest} '
                   'tokens); each runs alone in its micro-batch, over the token budget')
        logger.warning(message)
        self._record(DecisionRecord('integration', 'over_budget', 'warning', {
            'samples': len(over), 'indices': sorted(k for k, _ in over)[:32], 'longest': longest,
            'max_tokens': loader.plan.max_tokens, 'epoch': loader.epoch}, message))

    def token_values(self) -> dict[str, float]:
        """Padded tokens per micro-batch and padding fraction of the micro-batches drawn since the last log line
        (all ranks), from the samples' lengths (a batch plan is set)."""
        real, padded, batches = distributed.sum_ints(self.loader.take_token_stats())
        if not batches:
            return {}
        return {'dynamic/tokens_per_batch': round(padded / batches, 3),
                'dynamic/padding_fraction': round(padding_fraction(real, padded), 6)}

    def _check_same_dataset(self, dataloader: Any) -> None:
        dataset = getattr(dataloader, 'dataset', None)
        ours = self.loader.dataset
        if dataset is not ours and dataset is not self.trainer.train_dataset:
            raise ValueError('control.new_dataloader must iterate the trainer\'s training dataset '
                             f'(got a {type(dataloader).__name__} over {type(dataset).__name__}); the integration '
                             'only takes its batch size and keeps the epoch order and position')

    @property
    def pairs(self) -> bool:
        """Whether a sample is several rows run together (``swift rlhf``: DPO/ORPO/... chosen + rejected, KTO
        completion + KL row; the template's ``mode`` is ``rlhf`` or ``kto``)."""
        return getattr(getattr(self.trainer, 'template', None), 'mode', None) in ('rlhf', 'kto')

    def check_splittable(self, setting: str, feature: str = 'pieces') -> None:
        """Raise when a micro-batch cannot run as several passes: packed rows, pairs (``swift rlhf``), or an engine
        whose passes hold collectives (``config.engines``; ``feature``: the row of its table, ``pieces`` or
        ``pass_limit``)."""
        if self.pairs:
            raise ConfigError(f'{setting}: not supported under swift rlhf: {_PAIRS_WHY}')
        args = self.trainer.args
        template = getattr(self.trainer, 'template', None)
        if getattr(template, 'padding_free', False) or getattr(args, 'padding_free', False) or getattr(
                args, 'packing', False):
            raise ConfigError(f'{setting}: a micro-batch cannot run as several passes with packing / padding_free: '
                              'a packed micro-batch is one [1, N] row and cannot be split')
        self.engine.refuse(feature, setting)

    def drain(self, control: Any) -> None:
        """Take the decision records queued on ``control`` (written by :meth:`flush`)."""
        self._held.extend(protocol.drain_decisions(control))

    def flush(self) -> None:
        held, self._held = self._held, []
        for record in held:
            self._record(record)

    def _record(self, record: DecisionRecord) -> None:
        loader = self.loader
        self.decisions.write(
            record.stamped(
                step=self.trainer.state.global_step,
                epoch=loader.epoch_progress if loader is not None else 0.0,
                samples_seen=self.samples_seen_local() if loader is not None else 0))

    def _write_samples(self, batches: list[list[int]]) -> None:
        loader, args = self.loader, self.trainer.args
        rank = distributed.rank()
        path = os.path.join(args.output_dir, SAMPLES_FILE.format(rank=rank))
        line = {
            'step': self.trainer.state.global_step + 1,
            'epoch': loader.epoch,
            'rank': rank,
            'batch_size': loader.batch_size,
            'num_pieces': loader.num_pieces,
            'batches': batches,
        }
        with open(path, 'a', encoding='utf-8') as f:
            f.write(json.dumps(line) + '\n')

    # ---- the learning rate ------------------------------------------------------------------------------
    def wrap_scheduler(self, scheduler: Any) -> Any:
        """Make ``new_lr_scale`` possible: every ``LambdaLR`` lambda (all HF warmup/decay schedules) is multiplied
        by the current scale. Other schedulers are left alone and a scale request then fails with a clear error."""
        self._scheduler = scheduler
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            scheduler.lr_lambdas = [
                fn if isinstance(fn, ScaledLambda) else ScaledLambda(fn) for fn in scheduler.lr_lambdas
            ]
        return scheduler

    @property
    def lr_scale(self) -> float:
        lambdas = getattr(self._scheduler, 'lr_lambdas', None) or []
        scaled = [fn.scale for fn in lambdas if isinstance(fn, ScaledLambda)]
        return scaled[0] if scaled else 1.0

    def _scaled_lambdas(self, what: str, remedy: str) -> list['ScaledLambda']:
        scheduler = self._scheduler
        lambdas = getattr(scheduler, 'lr_lambdas', None)
        if not lambdas or not all(isinstance(fn, ScaledLambda) for fn in lambdas):
            raise ConfigError(f'{what} was requested but the LR scheduler ({type(scheduler).__name__}) is not a '
                              'LambdaLR the pack can take over; use one of HF\'s lr_scheduler_type schedules '
                              f'(linear, cosine, constant, constant_with_warmup, warmup_stable_decay, ...) or {remedy}')
        return lambdas

    def set_lr_scale(self, scale: float) -> None:
        """Scale the schedule and the optimizer's current LR now, so this step already runs at the new LR."""
        for fn in self._scaled_lambdas('LR scaling', 'set the batch callback\'s lr_scaling to none'):
            fn.scale = scale
        self._refresh_lr()

    def set_lr_schedule(self, schedule: Mapping[str, Any]) -> None:
        """Make ``schedule`` (:mod:`~swift_dynamic_callbacks.policies.lr`) the shape every param group follows.

        Its steps are the trainer's optimizer steps; they are put on each lambda's (possibly stretched) time axis:
        restarts already placed keep their place, a new one is placed at the current point of the axis.
        """
        lambdas = self._scaled_lambdas('An LR schedule (lr_schedule callback)', 'remove the lr_schedule callback')
        if self.horizon is None:
            raise RuntimeError('swift-dynamic-callbacks: an LR schedule request before the scheduler was created')
        for fn in lambdas:
            placed = {int(real): virtual for real, virtual in
                      zip((fn.schedule or {}).get('restarts_real', ()), ((fn.schedule or {}).get('restarts', ())))}
            restarts, real_steps = [], []
            for step, peak, rewarmup in schedule.get('restarts', ()):
                start = placed[step][0] if step in placed else fn.virtual_step(step)
                restarts.append([start, float(peak), int(rewarmup)])
                real_steps.append(int(step))
            fn.schedule = {**schedule, 'total': int(self.horizon), 'restarts': restarts, 'restarts_real': real_steps}
        self._refresh_lr()

    def _refresh_lr(self) -> None:
        scheduler = self._scheduler
        lrs = [group['initial_lr'] * fn(scheduler.last_epoch)
               for group, fn in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas)]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group['lr'] = lr
        scheduler._last_lr = lrs

    def _current_lr(self) -> float | None:
        scheduler = self._scheduler
        return float(scheduler.get_last_lr()[0]) if scheduler is not None else None

    # ---- after the optimizer step ---------------------------------------------------------------------
    def after_step(self, state: Any, control: Any) -> None:
        loader = self.loader
        if loader is None:
            return
        state.epoch = loader.epoch_progress
        if loader.epoch_complete:
            control.should_epoch_stop = True
        if self.epoch_budget is not None and loader.epoch_progress >= self.epoch_budget - 1e-9:
            if not control.should_training_stop:
                self._record(
                    DecisionRecord('integration', 'stop', self._budget_reason, {'epochs': self.epoch_budget},
                                   f'{self.epoch_budget:.6g} epochs of data used'))
            control.should_training_stop = True

    # ---- the micro-step -----------------------------------------------------------------------------
    def run_micro_batch(self, model: Any, inputs: Any, run: Callable[[Any], torch.Tensor],
                        num_items_in_batch: Any) -> torch.Tensor:
        """HF's ``training_step`` for one micro-batch: see :meth:`.steps.StepRunner.run_micro_batch`. Every returned
        loss is noted (:mod:`.losses`): a non-finite one is published at the next log line."""
        loss = self.runner.run_micro_batch(model, inputs, run, num_items_in_batch)
        return loss_watch(self).note(self.trainer.state.global_step, loss)

    # ---- numbers for the logs -------------------------------------------------------------------------
    def global_batch_size(self) -> int:
        loader = self.loader
        return loader.batch_size * loader.entries_per_step * distributed.world_size()

    def samples_seen_local(self) -> int:
        return self.loader.samples_seen if self.loader is not None else 0

    def log_values(self, control: Any) -> dict[str, float]:
        loader = self.loader
        values: dict[str, float] = {}
        if loader is not None and self.config.log_values:
            samples, tokens, padded = distributed.sum_ints([loader.samples_seen, self.tokens_seen,
                                                             self.padded_tokens_seen])
            values.update(self.throughput_values(tokens))
            values['dynamic/padded_tokens_seen'] = padded
            values.update({
                'dynamic/batch_size': loader.batch_size,
                'dynamic/num_pieces': loader.num_pieces,
                'dynamic/global_batch_size': self.global_batch_size(),
                'dynamic/samples_seen': samples,
                'dynamic/epoch_coverage': round(loader.position / max(loader.epoch_size, 1), 6),
                'dynamic/lr_scale': self.lr_scale,
                'dynamic/pass_size': self.runner.max_pass,
                'dynamic/oom_count': self.runner.oom_count,
            })
            if getattr(loader, 'streaming', False):  # no length: no coverage, the rows of the epoch so far instead
                del values['dynamic/epoch_coverage']
                values['dynamic/stream_position'] = distributed.sum_ints([loader.position])[0]
        if loader is not None and self.config.log_values and loader.plan is not None:
            values.update(self.token_values())
            if getattr(loader, 'lengths_estimated', False):
                values['dynamic/estimate_overruns'] = self.estimate_overruns
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

    def state_dict(self) -> dict[str, Any]:
        request = protocol.pending_request(self.trainer.control)
        return {
            'tokens_seen': self.tokens_seen,
            'padded_tokens_seen': self.padded_tokens_seen,
            'pending_request': None if request.empty else asdict(request),
            'held_decisions': [r.to_json() for r in self._held],
            'pass_limit': self.pass_limit,
            'oom_count': self.runner.oom_count,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._held = [DecisionRecord(**r) for r in state.get('held_decisions', [])]
        self.pass_limit = state.get('pass_limit')
        self.runner.oom_count = int(state.get('oom_count', 0))
        self.tokens_seen = int(state.get('tokens_seen', 0))
        self.padded_tokens_seen = int(state.get('padded_tokens_seen', 0))
        pending = state.get('pending_request')
        if not pending:
            return
        set_request(self.trainer.control, pending)

    def speed_values(self, runtime: float) -> dict[str, float]:
        """HF's ``train_samples_per_second`` assumes a constant batch; this counts the samples really used."""
        samples = sum(distributed.gather_objects(self.loader.samples_seen - self._samples_at_start))
        return {'train_samples_per_second': round(samples / runtime, 3) if runtime > 0 else 0.0}

    # ---- checkpoints ----------------------------------------------------------------------------------
    def save(self, checkpoint_dir: str) -> None:
        """Write the pack state into ``checkpoint_dir`` (rank 0) before HF writes the rest of the checkpoint.

        Records still held for the next step boundary are saved with the pending requests (not written yet: the
        boundary adds the applied LR to them), so a resume writes them exactly once.
        """
        self.drain(self.trainer.control)
        # each rank's data position (its own shard and plan), gathered on every rank before rank 0 writes
        loader_ranks = distributed.gather_objects(self.loader.state_dict()) if self.loader is not None else []
        if not (self.trainer.args.should_save and distributed.is_main_process()):
            return
        components = [self] + ([self.loader] if self.loader is not None else []) + self.callback_components()
        binding = {'run_id': self.run_id, 'global_step': self.trainer.state.global_step,
                   'samples_seen': sum(int(state.get('samples_seen', 0)) for state in loader_ranks),
                   'dataset': self._dataset_fingerprint}
        payload = build_payload(components, self.snapshot_config(), binding=binding, settings=self.settings_snapshot())
        if len(loader_ranks) > 1:
            payload['components'][f'{self.loader.state_key}.ranks'] = loader_ranks
        path = write_state(checkpoint_dir, payload)
        # HF writes trainer_state.json after this: the entry binds the state file to this checkpoint (check_binding)
        self.trainer.state.stateful_callbacks[BINDING_KEY] = binding_entry(payload, file_digest(path))


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


def _rank_state(components: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """This rank's entry of a per-rank state (``<key>.ranks``, written by several processes), else ``key``'s."""
    ranks = components.get(f'{key}.ranks')
    if not ranks:
        return components[key]
    if len(ranks) != distributed.world_size():
        raise StateError(f'the checkpoint was written by {len(ranks)} processes and is resumed by '
                         f'{distributed.world_size()}: each process\'s data shard and position would change; resume '
                         'with the same number of processes')
    return ranks[distributed.rank()]


def _set_host_epoch(host_loader: Any, epoch: int) -> None:
    if hasattr(host_loader, 'set_epoch'):
        host_loader.set_epoch(epoch)
    inner = getattr(getattr(host_loader, 'batch_sampler', None), 'batch_sampler', None)
    if hasattr(inner, 'set_epoch'):
        inner.set_epoch(epoch)


def _epoch_order_fn(host_loader: Any, dataset: Any, args: Any) -> Callable[[int], list[int]]:
    """``epoch -> this rank's dataset indices in training order``.

    Single process: the host's own sampler decides (so the order is exactly plain ms-swift's / HF's, including
    ``group_by_length``). Several processes: a seeded permutation of *all* samples (seed ``data_seed + epoch``,
    as ms-swift) dealt ``rank::world``, because ms-swift's sampler leaves out ``len % world`` samples per epoch.
    """
    world = distributed.world_size()
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
    rank, n = distributed.rank(), len(dataset)
    seed = args.data_seed if args.data_seed is not None else 0
    shuffle = getattr(args, 'train_dataloader_shuffle', True)

    def shard_order(epoch: int) -> list[int]:
        if not shuffle:
            return list(range(rank, n, world))
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        return torch.randperm(n, generator=generator).tolist()[rank::world]

    return shard_order


class IntegrationCallback(TrainerCallback):
    """Internal callback of the integration.

    Placed first among the trainer's callbacks, so progress bars and HF's stop rule see its ``max_steps``.
    Hooks: ``on_train_begin`` (marks ``control`` as honoured, sets ``state.max_steps`` for epoch budgets),
    ``on_step_end`` (epoch end, honest ``state.epoch``, epoch budget), ``on_train_end`` (takes the decision queue;
    the progress bar's total becomes the steps run).
    Flags set: ``should_epoch_stop``, ``should_training_stop``. State: none (the integration owns it).
    """

    def __init__(self, integration: Integration) -> None:
        self.integration = integration

    def on_train_begin(self, args, state, control, **kwargs):
        control._sdc_integration = True
        setattr(control, protocol.FAIL_FAST, self.integration.config.fail_fast)
        self.integration.update_max_steps(state, 'start')

    def on_step_end(self, args, state, control, **kwargs):
        self.integration.after_step(state, control)

    def on_train_end(self, args, state, control, **kwargs):
        self.integration.drain(control)
        self.integration.sync_progress_bars(state.global_step)  # runs before the progress callback closes its bar


class DynamicTrainerMixin:
    """Overrides mixed into the trainer's own class by :func:`install` (see the module docstring)."""

    dynamic_integration: Integration

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self.dynamic_integration.begin_train(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.dynamic_integration.end_train()

    def get_train_dataloader(self, *args, **kwargs):
        # ms-swift passes ``skip_batches`` on resume; the elastic loader resumes from its own state instead.
        kwargs.pop('skip_batches', None)
        host_loader = super().get_train_dataloader()
        return self.dynamic_integration.build_loader(host_loader)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        original = super().get_batch_samples
        return self.dynamic_integration.next_step(num_batches, device, original)

    def training_step(self, model, inputs, *args, **kwargs):
        num_items = args[0] if args else kwargs.get('num_items_in_batch')
        run = lambda part: super(DynamicTrainerMixin, self).training_step(model, part, *args, **kwargs)  # noqa: E731
        return self.dynamic_integration.run_micro_batch(model, inputs, run, num_items)

    # ms-swift + transformers 4.57 build the scheduler through create_optimizer_and_scheduler, which calls HF's
    # create_scheduler on the class (not this override); 5.x calls create_scheduler. Both paths get the epoch
    # budget's horizon and the scalable wrapper.
    def create_optimizer_and_scheduler(self, num_training_steps, *args, **kwargs):
        steps = self.dynamic_integration.scheduler_steps
        steps = steps if steps is not None else num_training_steps
        self.dynamic_integration.horizon = steps
        result = super().create_optimizer_and_scheduler(steps, *args, **kwargs)
        self.dynamic_integration.wrap_scheduler(self.lr_scheduler)
        return result

    def create_scheduler(self, num_training_steps, *args, **kwargs):
        steps = self.dynamic_integration.scheduler_steps
        steps = steps if steps is not None else num_training_steps
        self.dynamic_integration.horizon = steps
        scheduler = super().create_scheduler(steps, *args, **kwargs)
        return self.dynamic_integration.wrap_scheduler(scheduler)

    def log(self, logs, *args, **kwargs):
        integration = self.dynamic_integration
        if 'loss' in logs and integration.loader is not None:
            nonfinite = sum(distributed.gather_objects(loss_watch(integration).take()))  # HF may log a NaN as finite
            setattr(self.control, protocol.LOSS_NONFINITE, nonfinite)
            if nonfinite or integration.config.log_values:
                logs[protocol.NONFINITE_LOG_KEY] = nonfinite
            logs.update(integration.log_values(self.control))
            if 'learning_rate' in logs and integration.step_lr is not None:
                # ms-swift reads the LR after the scheduler stepped (the next step's); log the one this step used
                logs['learning_rate'] = integration.step_lr
        if 'train_runtime' in logs and integration.loader is not None:
            logs.update(integration.speed_values(float(logs['train_runtime'])))
        return super().log(logs, *args, **kwargs)

    def _save_checkpoint(self, model, trial, *args, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        output_dir = os.path.join(self._get_output_dir(trial=trial), f'{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}')
        self.dynamic_integration.save(output_dir)
        return super()._save_checkpoint(model, trial, *args, **kwargs)


_MIXED_CLASSES: dict[type, type] = {}


def _add_integration_callback(trainer: Any, integration: Integration) -> None:
    callbacks = trainer.callback_handler.callbacks
    if not any(isinstance(cb, IntegrationCallback) for cb in callbacks):
        callbacks.insert(0, IntegrationCallback(integration))


def _skip_first_batches_patch() -> None:
    """Make ``transformers.trainer.skip_first_batches`` leave the elastic loader alone on resume.

    HF (and ms-swift's wrapper around it, which delegates loaders it does not know) would otherwise rebuild
    the loader and skip by batch count; the elastic loader resumes from its saved sample position instead.
    """
    import transformers.trainer as hf_trainer
    original = hf_trainer.skip_first_batches
    if getattr(original, '_sdc_patched', False):
        return

    def skip_first_batches(dataloader, num_batches=0):
        if isinstance(dataloader, (ElasticDataLoader, StreamLoader)):
            return dataloader
        return original(dataloader, num_batches)

    skip_first_batches._sdc_patched = True
    hf_trainer.skip_first_batches = skip_first_batches


DISABLE_ENV = 'SWIFT_DYNAMIC_CALLBACKS_DISABLE'


def pack_disabled(config: IntegrationConfig | None) -> str | None:
    """Why the whole pack is off (``None`` when it is on): the environment variable or ``enabled: false``."""
    if os.environ.get(DISABLE_ENV, '').strip().lower() in ('1', 'true', 'yes', 'on'):
        return f'{DISABLE_ENV}={os.environ[DISABLE_ENV]}'
    if config is not None and not config.enabled:
        return 'dynamic_callbacks.integration.enabled: false'
    return None


class PackOffCallback(TrainerCallback):
    """Stands in for the pack when it is switched off (:func:`pack_disabled`): at train begin it sets
    ``control.dynamic_disabled`` (pack callbacks' hooks then do nothing), logs one line and writes one
    ``pack``/``disabled`` record to the decision log (rank 0). Nothing else: the run is the plain trainer's."""

    def __init__(self, why: str, callbacks: Iterable[str] = ()) -> None:
        self.why = why
        self.callbacks = list(callbacks)

    def on_train_begin(self, args, state, control, **kwargs):
        setattr(control, protocol.DISABLED, True)
        control._sdc_integration = True  # no "request not honoured" warning: nothing is requested on purpose
        listed = f' ({", ".join(self.callbacks)} listed but inactive)' if self.callbacks else ''
        message = (f'swift-dynamic-callbacks is OFF ({self.why}): no dynamic behaviour{listed}; this is a plain '
                   'baseline run')
        logger.warning(message)
        log = DecisionLog(os.path.join(args.output_dir, DECISIONS_FILE),
                          enabled=bool(getattr(state, 'is_world_process_zero', True)))
        log.write(DecisionRecord('integration', 'pack', 'disabled', {'switch': self.why, 'callbacks': self.callbacks},
                                 message).stamped(step=state.global_step, epoch=float(state.epoch or 0.0),
                                                  samples_seen=0))


def install(trainer: Any, config: IntegrationConfig | None = None,
            pack_config: Mapping[str, Any] | None = None) -> Integration | None:
    """Install the integration on ``trainer`` (idempotent) and return it.

    Works on an ms-swift trainer under construction (the pack's callback factories call this) and on a fully
    built ``transformers.Trainer``: ``install(trainer); trainer.add_callback(cb); trainer.train()``.
    When the pack is switched off (:func:`pack_disabled`), the trainer is left as it is except for a
    :class:`PackOffCallback` (pack callbacks added to it do nothing), and ``None`` is returned.
    """
    why = pack_disabled(config)
    if why is not None:
        callbacks = getattr(getattr(trainer, 'callback_handler', None), 'callbacks', None)
        if callbacks is not None and not any(isinstance(cb, PackOffCallback) for cb in callbacks):
            callbacks.insert(0, PackOffCallback(why))
        return None
    existing = getattr(trainer, 'dynamic_integration', None)
    if isinstance(existing, Integration):
        if config is not None and config != existing.config:
            raise ConfigError(f'dynamic_callbacks.integration: installed twice with different settings '
                              f'({existing.config} vs {config})')
        existing.pack_config.update(pack_config or {})
        return existing
    cls = type(trainer)
    if not issubclass(cls, DynamicTrainerMixin):
        mixed = _MIXED_CLASSES.get(cls)
        if mixed is None:
            mixed = type(f'Dynamic{cls.__name__}', (DynamicTrainerMixin, cls), {'__module__': cls.__module__})
            _MIXED_CLASSES[cls] = mixed
        trainer.__class__ = mixed
    integration = Integration(trainer, config, pack_config)
    trainer.dynamic_integration = integration
    _skip_first_batches_patch()
    if getattr(trainer, 'callback_handler', None) is not None:
        _add_integration_callback(trainer, integration)
        trainer.control._sdc_integration = True
    return integration

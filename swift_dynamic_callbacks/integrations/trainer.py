"""The coordinator: runs each step boundary of a training run in order, over parts that each own one job.

- :mod:`.data` — the loader (elastic or stream), lengths, over-budget reports, the sample trace;
- :mod:`.requests` / :mod:`.apply` — read and agree the callbacks' requests / apply each field to its owner;
- :mod:`.decisions` — which record is written, once, when;
- :mod:`.budget` — max_steps, the epoch budget, progress bars;
- :mod:`.lr` — the LR the optimizer uses (scale, stretch, schedule);
- :mod:`.steps` — one step's passes on the engine (:mod:`.engines`), the pass limit, OOM recovery;
- :mod:`.packed_attention` — the kernel packed rows run with: chosen, proven, agreed, fallen back from;
- :mod:`.pass_budget` — what a pass may hold: every cap (requested, the plan's, the OOM budget), computed once;
- :mod:`.checkpoint` — the pack state in checkpoints, resume checks;
- :mod:`.metrics` — the numbers in the logs.

The parts do not import each other's classes beyond what they are handed: the coordinator builds them and passes
each the collaborators it needs. Where HF and ms-swift call in is :mod:`.hooks`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, replace
from typing import Any, Callable, Mapping

import torch

from .. import distributed, protocol
from ..config import ConfigError
from ..config.integration import IntegrationConfig
from ..config.rules import ROLLOUT_WHY, rlhf_refusal
from ..data.slots import slot_batches
from ..records import DECISIONS_FILE, DecisionRecord
from ..state import stateful_components
from .apply import RequestApplier
from .auto_budget import agreed_auto_pass_tokens
from .budget import StepBudget
from .checkpoint import Checkpoints
from .data import DataFeed, check_supported
from .decisions import Decisions
from .engines import Engine
from .eval_passes import EvalPasses
from .grpo_passes import GrpoPasses
from .inputs import mask_may_go, prepare_slot, to_device
from .layout import Layout
from .optimizer import OptimizerScale
from .lr import LRControl
from .packed_attention import PackedAttention
from .oom_report import fewer_rows_advice
from .pass_budget import PassBudget, oom_notes
from .metrics import Metrics, allocator_figures
from .requests import agree_step, load_replay, request_to_json, set_request
from .steps import StepRunner

logger = logging.getLogger('swift_dynamic_callbacks')


class Integration:
    """The integration of one trainer (reachable as ``trainer.dynamic_integration``).

    Hooks (called by :mod:`.hooks`): :meth:`begin_train`, :meth:`build_loader`, :meth:`schedule_length`,
    :meth:`next_step` (the step boundary), :meth:`run_micro_batch`, :meth:`predict` (an eval batch),
    :meth:`update_logs`, :meth:`after_step`, :meth:`save`, :meth:`end_train`.

    State (key ``integration``): the requests still pending on ``control`` when the checkpoint was written (e.g.
    made in ``on_step_end`` of the saved step) with the decision records that go with them (set again on resume,
    applied and written at the first step), the pass limit, the token budget of a pass after OOMs, the OOM count,
    the tokens seen, the run's reference layout, the optimizer's configured weight decay / beta2 and their scale,
    and the LR schedule's length. The loader's state is saved under ``integration.data``. The epoch budget and the
    schedule length are derived from the arguments again (the saved length is used when the layout changed); the LR
    scale is in ``scheduler.pt``.
    """

    state_key = 'integration'

    def __init__(self, trainer: Any, config: IntegrationConfig | None = None,
                 pack_config: Mapping[str, Any] | None = None, *, run_level: str | None = None) -> None:
        self.trainer = trainer
        #: the ``rlhf_type`` of a trainer that draws its own batches and passes (GRPO, GKD): the pack then acts at the
        #: step boundary only (:meth:`boundary`), its loader and step runner unused; ``None``: the full integration
        self.run_level = run_level
        self.config = config or IntegrationConfig()
        self.pack_config = dict(pack_config or {})
        self.decisions = Decisions(self._where)
        self.feed = DataFeed(trainer, self.config, self.decisions)
        self.budget = StepBudget(trainer, self.config, self.decisions)
        self.lr = LRControl()
        self.attention = PackedAttention()
        self.pass_budget = PassBudget(self.config.oom_grow_back_steps, self.config.oom_probe_steps)
        self.runner = StepRunner(trainer, Engine(trainer), oom_recovery=False, single_sample_retries=0,
                                 attention=self.attention, budget=self.pass_budget)
        self.eval_passes = EvalPasses(self.runner, self.decisions.write)  # eval batches an OOM cannot end
        self.metrics = Metrics(self.config)
        self.checkpoints = Checkpoints(trainer, self.config, self.pack_config, self.decisions)
        self.layout = Layout()
        self.optimizer = OptimizerScale(trainer)
        self.applier = RequestApplier(self.feed, self.runner, self.lr, self.decisions, self.refresh_budget,
                                      self.layout, self.optimizer, self.pack_config)
        self.step_lr: float | None = None  # the LR the running optimizer step uses (first param group)
        self.crash_ooms: list[DecisionRecord] = []  # OOMs that ended an earlier run after the resumed checkpoint
        self.saved_oom_count = 0  # every rank's OOMs at the last save (the checkpoint's ``oom_count``)
        self.replay: dict[int, protocol.BatchRequest] | None = None  # step -> recorded request (replay setting)
        self.grpo_passes: GrpoPasses | None = None  # GRPO's loss passes by tokens (grpo_pass_tokens; run level)

    @property
    def loader(self) -> Any:
        return self.feed.loader

    def _where(self) -> tuple[int, float, int]:
        loader = self.feed.loader
        if loader is None:
            return self.trainer.state.global_step, 0.0, 0
        return self.trainer.state.global_step, loader.epoch_progress, loader.samples_seen

    def callback_components(self) -> list[Any]:
        """Stateful pack callbacks on the trainer (everything with ``state_key``/``state_dict``)."""
        return stateful_components(self.trainer.callback_handler.callbacks)

    # ---- begin and end ------------------------------------------------------------------------------------
    def begin_train(self, resume_from_checkpoint: Any) -> None:
        """``train()``, before HF starts: check the trainer, open the decision log, choose the engine, restore the
        pack state of a resumed checkpoint (the loader's when it is built)."""
        trainer = self.trainer
        self.decisions.open(os.path.join(trainer.args.output_dir, DECISIONS_FILE),
                            enabled=distributed.is_main_process())
        if self.run_level is not None:
            return self._begin_run_level(resume_from_checkpoint)
        check_supported(trainer, self.config)
        self._sequence_parallel_mesh()
        self.decisions.write(self.runner.begin(self.config, self.pack_config))
        eval_record = self.eval_passes.begin(trainer)
        if getattr(trainer, 'eval_dataset', None) is not None:  # said where the run evaluates
            self.decisions.write(eval_record)
        self.feed.image_rule = self.runner.kind.image_rule(trainer)  # lazily tokenised rows: images counted exactly
        self.feed.vision_token_cost = self.runner.vision_token_cost  # what pass_tokens plans a row's media tokens at
        self.feed.media_token_ids = self.runner.kind.media_token_ids()
        self.checkpoints.write_config()
        trainer.control._sdc_integration = True
        setattr(trainer.control, protocol.FAIL_FAST, self.config.fail_fast)
        if self.config.replay is not None:
            self.replay = load_replay(self.config.replay)
            message = (f'replaying {len(self.replay)} applied requests from {self.config.replay}: the callbacks\' '
                       'batch and LR requests are ignored (their deciding is off) and their request records are not '
                       'written; the recorded requests are applied at the same step boundaries')
            logger.warning(message)
            self.decisions.write(DecisionRecord('integration', 'replay', 'start', {
                'file': self.config.replay, 'requests': len(self.replay), 'steps': sorted(self.replay)[:64]}, message))
        self.checkpoints.resume(resume_from_checkpoint, [self] + self.callback_components())
        self.runner.output_dir = trainer.args.output_dir
        if self.checkpoints.payload is not None:  # OOMs that ended a run after this checkpoint: folded at step 1
            self.crash_ooms = oom_notes(trainer.args.output_dir, self.trainer.state.global_step)
        self.budget.begin()

    def _sequence_parallel_mesh(self) -> None:
        """Under ms-swift's sequence parallelism the pack's data ranks are its data-parallel ranks (read from
        ms-swift's mesh, not derived): a group of ``sequence_parallel_size`` ranks draws the same samples and cuts them
        alike (:func:`..distributed.set_sequence_parallel`); one ``sequence_parallel`` record."""
        size = int(getattr(getattr(self.trainer, 'template', None), 'sequence_parallel_size', 1) or 1)
        if size <= 1:
            distributed.clear_sequence_parallel()
            return
        from swift.sequence_parallel import sequence_parallel as mesh
        distributed.set_sequence_parallel(mesh.dp_rank, mesh.dp_world_size, size)
        self.decisions.write(DecisionRecord(
            'integration', 'sequence_parallel', 'mesh', {
                'sequence_parallel_size': size, 'data_parallel_size': mesh.dp_world_size,
                'ulysses': mesh.sp_world_size, 'ring': mesh.rp_world_size, 'world_size': distributed.world_size()},
            f'sequence_parallel_size {size}: {mesh.dp_world_size} data rank(s); each group of {size} ranks draws the '
            'same samples and passes (budgets in tokens a data rank)'))

    def _begin_run_level(self, resume_from_checkpoint: Any) -> None:
        """``train()`` of a trainer that draws its own batches (:attr:`run_level`): what ``rlhf_type`` allows checked
        again on the listed callbacks, one ``mode`` record, the pack state of a resumed checkpoint restored (the
        callbacks' and the LR's; there is no loader of the pack's)."""
        trainer = self.trainer
        listed = {cb.name: cb.config for cb in trainer.callback_handler.callbacks
                  if getattr(cb, 'config_class', None) is not None and getattr(cb, 'config', None) is not None}
        message = rlhf_refusal(self.run_level, list(listed), listed, self.config.oom_recovery,
                               grpo_pass_tokens=self.config.grpo_pass_tokens,
                               get=lambda name: _grpo_setting(trainer, name), world_size=distributed.world_size())
        if message is not None:
            raise ConfigError(message)
        host = type(trainer).__bases__[-1].__name__  # the class the pack's mixin was mixed into
        if self.config.grpo_pass_tokens is not None:
            self._begin_grpo_passes()
        recovery = self.grpo_passes is not None and self.grpo_passes.oom_recovery
        self.decisions.write(DecisionRecord(
            'integration', 'mode', 'run_level', {'rlhf_type': self.run_level, 'trainer': host,
                                                 'callbacks': sorted(listed), 'oom_recovery': recovery,
                                                 'grpo_pass_tokens': self.config.grpo_pass_tokens},
            f'rlhf_type {self.run_level}: {ROLLOUT_WHY[self.run_level]}; the pack acts at the step boundary (LR '
            'schedule, early stopping, checkpoint rotation, training log)'
            + ('; its loss passes cut by grpo_pass_tokens' if self.grpo_passes is not None else '')
            + ('' if recovery else '; OOM recovery off')))
        self.checkpoints.write_config()
        trainer.control._sdc_integration = True
        setattr(trainer.control, protocol.FAIL_FAST, self.config.fail_fast)
        self.checkpoints.resume(resume_from_checkpoint, [self] + self.callback_components())
        self.checkpoints.resumed_without_loader()
        self.budget.begin()

    def _begin_grpo_passes(self) -> None:
        """``grpo_pass_tokens``: GRPO's loss passes cut by tokens (:mod:`.grpo_passes`), OOM recovery on one process
        (``oom_recovery`` auto or true); one ``grpo_passes`` record."""
        config = self.config
        # oom_recovery: true under several processes was refused before the model loaded (rules.grpo_passes_refusal)
        recovery = config.oom_recovery is not False and distributed.world_size() == 1
        tokens = config.grpo_pass_tokens
        if tokens == 'auto':  # from the free memory now (the policy, reference and rollout models loaded)
            budget = (self.pack_config.get('memory_backoff') or {}).get('cpu_budget_gib')
            tokens, record = agreed_auto_pass_tokens(self.trainer, self.runner.engine, cpu_budget_gib=budget,
                                                     setting='grpo_pass_tokens')
            self.decisions.write(record)
        self.grpo_passes = GrpoPasses(tokens, str(self.trainer.loss_type), oom_recovery=recovery,
                                      single_sample_retries=config.oom_single_sample_retries,
                                      grow_back_steps=config.oom_grow_back_steps,
                                      probe_steps=config.oom_probe_steps)
        values = self.grpo_passes.describe()
        self.decisions.write(DecisionRecord(
            'integration', 'grpo_passes', 'pass_tokens', values,
            f'GRPO loss passes of at most {tokens} padded tokens, each weighted by its '
            f'{values["weighting"]} under loss_type {values["loss_type"]}'
            + ('; OOM recovery on' if recovery else '; OOM recovery off')))

    def boundary(self, control: Any) -> None:
        """HF's ``get_batch_samples`` of a run-level trainer (:attr:`run_level`): the requests agreed and applied, the
        LR the step uses noted; the trainer then draws its step as it would. Under ``grpo_pass_tokens`` the last
        step's OOMs and budget changes are written first."""
        if self.grpo_passes is not None:
            for record in self.grpo_passes.end_step(int(self.trainer.state.global_step)):
                self.decisions.write(record)
        control._sdc_integration = True
        self.apply_requests(control)
        optimizer = getattr(self.trainer, 'optimizer', None)
        self.step_lr = float(optimizer.param_groups[0]['lr']) if optimizer is not None else None

    def build_loader(self, host_loader: Any) -> Any:
        """``get_train_dataloader``: the pack's loader, at the resumed position, with the run's step budget."""
        loader = self.feed.build(host_loader)
        loader.equal_passes = self.runner.engine.collective_passes  # every rank the same passes a step
        initial_batch_size = loader.batch_size
        self.layout.begin(distributed.data_world(), loader.entries_per_step, initial_batch_size)
        self.checkpoints.restore_loader(loader, self.feed.fingerprint, self.layout)
        if loader.plan is not None and loader.plan.padding_free:  # a resumed plan is not requested again
            attention = self.runner.set_padding_free(True, self.trainer.model)
            if attention is not None:
                self.decisions.write(attention)
        if self.checkpoints.payload is not None and self.layout.batch != initial_batch_size:
            self.decisions.write(DecisionRecord(
                'integration', 'resume', 'batch_setting', {'run': self.layout.batch, 'now': initial_batch_size,
                                                           'batch_size': loader.batch_size},
                f'per_device_train_batch_size is {initial_batch_size} now and was {self.layout.batch} when the run '
                f'started: it only sets a fresh run\'s first batch; the resumed run continues at batch size '
                f'{loader.batch_size} (its callbacks decide the size; processes and gradient_accumulation_steps may '
                'change, the global batch is kept)'))
        if not self.layout.changed:  # the same layout derives the same schedule length from the arguments
            self.budget.saved_scheduler_steps = None
        self.metrics.samples_at_start = loader.samples_seen
        self.budget.derive(loader, initial_batch_size)
        return loader

    def schedule_length(self, num_training_steps: int) -> int:
        """The LR schedule's length HF builds the scheduler for: the budget's estimate in epoch-budget runs."""
        steps = self.budget.scheduler_steps
        self.lr.horizon = steps if steps is not None else num_training_steps
        return self.lr.horizon

    def end_train(self) -> None:
        distributed.clear_sequence_parallel()
        self.budget.end()
        if self.loader is not None:
            self.loader.close()
        self.decisions.drain(self.trainer.control)
        self.decisions.hold_all(self._own_records())  # an OOM or a kernel fallback in the last step: not exchanged
        if protocol.has_pending_request(self.trainer.control):  # decided after the last step: never applied here
            self.decisions.mark_pending()
        self.decisions.flush()

    # ---- the step boundary --------------------------------------------------------------------------------
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
        self.metrics.start_clock()
        pairs = loader.next_step(num_batches)
        refused = self.runner.check_inputs([b for _, slot in pairs for b in slot_batches(slot)], loader.pass_pieces)
        if refused is not None:
            self.decisions.write(refused)
        self.feed.report_step(splittable=self.runner.splittable())
        self.metrics.count([batch for _, slot in pairs for batch in slot_batches(slot)],
                           padding_free=self.runner.padding_free)
        target = trainer.args.device if trainer.args.device.type == 'cuda' else None
        mask_free = mask_may_go(trainer.args)
        pairs = [(indices, prepare_slot(slot, padding_free=self.runner.padding_free,
                                                 attention=self.attention.kernel, device=target,
                                                 kind=self.runner.kind, mask_free=mask_free))
                 for indices, slot in pairs]
        real = [batch for _, slot in pairs for batch in slot_batches(slot)]
        # A rank whose step is placeholders only still counts (0) items: HF gathers the count across ranks.
        counted = real or ([to_device({'labels': torch.full((1, 1), -100)}, target)]
                           if distributed.world_size() > 1 else [])
        _, num_items_in_batch = original(iter(counted), len(counted), device)
        setattr(control, protocol.GRAD_NOISE_SAMPLE, None)
        setattr(control, protocol.OOM_EVENT, None)
        self.runner.start_step(pairs, self.runner.noise_probe(pairs, num_items_in_batch),
                               num_pieces=loader.pass_pieces, budget_tokens=self.feed.estimated_budget())
        if self.config.record_samples:
            self.feed.write_trace(trainer.state.global_step + 1, [indices for indices, _ in pairs],
                                  [len(slot_batches(slot)) for _, slot in pairs])
        return [batch for _, batch in pairs], num_items_in_batch

    def apply_requests(self, control: Any) -> None:
        """Read the request flags, agree on them across ranks, apply them, clear them; write the decisions."""
        request = protocol.pending_request(control)
        if request.via_dataloader:
            self.feed.check_same_dataset(control.new_dataloader)
        protocol.clear_requests(control)
        if self.replay is not None:  # the recorded request of this boundary instead of the callbacks'
            request = self.replay.get(self.trainer.state.global_step, protocol.BatchRequest())
        request = self.settle_step(request)
        self.decisions.drain(control)
        if self.replay is not None:
            self.decisions.drop_callback_requests()
        try:
            if not request.empty:
                self.applier.apply(request)
                self.decisions.hold(DecisionRecord('integration', 'applied_request',
                                                   'replay' if self.replay is not None else 'agreed',
                                                   request_to_json(request)))
            self.update_pass_budget()
        finally:
            self.decisions.flush()

    def _own_records(self) -> list[DecisionRecord]:
        """This rank's records of the step that ended that the other ranks must know: its OOM, a kernel fallback."""
        oom = (self.runner.oom or {}).pop('record', None) if self.runner.oom else None
        return [r for r in [oom] + self.runner.take_records() if r is not None]

    def settle_step(self, request: protocol.BatchRequest = protocol.BatchRequest(), *,
                    hold: bool = True) -> protocol.BatchRequest:
        """The step that ended, settled on every rank once: ``request`` agreed, every rank's OOM and kernel-fallback
        records exchanged (rank 0 writes them), the attention every rank runs made one again, and the step's outcome
        folded into the pass budget (the same on every rank). Called at the step boundary (the records held, written
        after the boundary's request is applied) and, earlier, when a checkpoint is saved after the step
        (``hold=False``: written now, so the checkpoint's log has them and a resumed run does not write them again).
        Collective. Returns the agreed request."""
        request, shared, fitted = agree_step(request, self._own_records(), self.pass_budget.fitted)
        records = list(shared)  # every rank's OOM and kernel fallback of the last step
        crashed, self.crash_ooms = self.crash_ooms, []
        follow = self.attention.follow(self.trainer.model, shared, self.trainer.state.global_step)
        if follow is not None:  # another rank's kernel failed: every rank runs the same attention from this step
            records.append(follow)
        loader = self.loader
        if loader is not None:
            self.pass_budget.configure(tokens_ceiling=loader.plan.pass_tokens if loader.cuts_passes else None,
                                       rows=loader.batch_size)
            if crashed:  # every rank read the same notes: the same budget
                records.extend(crashed)
                refusal = self.runner.split_refusal()
                if refusal is not None:  # lowered, the budget would cut micro-batches this run may not cut
                    records.append(self._not_lowered(crashed, refusal))
                else:
                    record = self.pass_budget.fold(crashed, self.trainer.state.global_step, again=True)
                    if record is not None:  # stamped with the OOM's step, as the fold of a recovered one
                        records.append(replace(record, step=max(r.step for r in crashed)))
            record = self.pass_budget.fold([r for r in shared if r.kind == 'oom'], self.trainer.state.global_step,
                                           fitted=fitted)
            if record is not None:
                records.append(record)
        self.pass_budget.fitted = 0
        for record in records:
            self.decisions.hold(record) if hold else self.decisions.write(record)
        return request

    def _not_lowered(self, crashed: list[DecisionRecord], refusal: str) -> DecisionRecord:
        """The record (and warning) of the OOMs that ended an earlier run, read on resume, where this run may not cut
        a micro-batch into passes (``refusal``): the budget is not lowered (the same micro-batches, the same
        gradient), and the message says what to set instead."""
        rows = max(int(r.values.get('pass_size') or 0) for r in crashed)
        accumulation = int(self.trainer.args.gradient_accumulation_steps)
        advice = (fewer_rows_advice(rows, accumulation) if rows > 1 else
                  'a lower max_length (one row cannot be cut)')
        message = (f'an earlier run ended out of memory at step {max(r.step for r in crashed)} in a pass of {rows} '
                   f'rows; this run does not lower its pass budget because {refusal}: it runs the same micro-batches '
                   f'(the same gradient) and may run out of memory there again. To fit, set {advice}')
        logger.warning(message)
        return DecisionRecord('integration', 'pass_budget', 'not_lowered', {
            'unit': self.pass_budget.unit, 'failed': rows, 'why': refusal, 'advice': advice},
            message, step=max(r.step for r in crashed))

    def update_pass_budget(self) -> None:
        """Hand the loader the token budget it plans passes at (the budget owner's; collective when it changes: every
        rank the same budget, so the re-plan happens at this boundary on every rank)."""
        loader = self.loader
        if loader is None:  # a run-level trainer: its passes are its own
            return
        self.pass_budget.configure(tokens_ceiling=loader.plan.pass_tokens if loader.cuts_passes else None,
                                   rows=loader.batch_size)
        loader.set_pass_budget(self.pass_budget.plan_tokens())

    def refresh_budget(self, reason: str) -> None:
        """After a change of the batch size or plan: the step budget, and the LR schedule stretched to it."""
        state = self.trainer.state
        total = self.budget.refresh(state, self.loader, reason)
        if total is not None and self.budget.scheduler_steps is not None:
            self.lr.stretch(state.global_step, total, self.budget.scheduler_steps)

    def run_micro_batch(self, model: Any, inputs: Any, run: Callable[[Any], torch.Tensor],
                        num_items_in_batch: Any) -> torch.Tensor:
        """HF's ``training_step`` for one micro-batch (:meth:`.steps.StepRunner.run_micro_batch`). Every returned
        loss is noted: a non-finite one is published at the next log line."""
        loss = self.runner.run_micro_batch(model, inputs, run, num_items_in_batch)
        return self.metrics.losses.note(self.trainer.state.global_step, loss)

    def predict(self, model: Any, inputs: Any, predict: Callable[[Any], Any]) -> Any:
        """HF's ``prediction_step`` for one eval batch (:meth:`.eval_passes.EvalPasses.run`: an OOM runs it again in
        halves)."""
        return self.eval_passes.run(model, inputs, predict)

    def after_step(self, state: Any, control: Any) -> None:
        """``on_step_end``: epoch end and the epoch budget."""
        if self.loader is not None:
            self.budget.after_step(state, control, self.loader)

    def update_logs(self, logs: dict[str, Any], control: Any) -> None:
        """HF's ``log``: the pack's numbers merged into the line."""
        if self.run_level is not None:  # no loader, no passes of the pack's: the LR and the callbacks' values
            if 'loss' in logs:
                logs.update({'dynamic/lr_scale': self.lr.scale, **protocol.current_metrics(control)})
                if self.grpo_passes is not None:
                    logs.update(self.grpo_passes.metrics())
                if 'learning_rate' in logs and self.step_lr is not None:
                    logs['learning_rate'] = self.step_lr
            return
        parts = {'dynamic/lr_scale': self.lr.scale, 'dynamic/pass_size': self.runner.max_pass}
        counts = {'dynamic/oom_count': self.runner.oom_count, **allocator_figures(self.runner.oom_count)}
        if self.loader is not None and self.loader.cuts_passes:
            parts['dynamic/pass_budget'] = self.loader.pass_tokens
        elif self.pass_budget.budget is not None:  # the rows a pass may hold after OOMs
            parts['dynamic/pass_rows_budget'] = self.pass_budget.budget
        self.metrics.update_logs(logs, control, self.loader, parts, rank_counts=counts, step_lr=self.step_lr,
                                 estimate_overruns=self.feed.estimate_overruns, pass_stats=self.runner.take_pass_stats)

    # ---- state and checkpoints ----------------------------------------------------------------------------
    def save(self, checkpoint_dir: str) -> None:
        """Write the pack state into ``checkpoint_dir`` before HF writes the rest of the checkpoint. Records still
        held for the next step boundary are saved with the pending requests (not written yet: the boundary adds the
        applied LR to them), so a resume writes them exactly once."""
        self.decisions.drain(self.trainer.control)
        if self.loader is not None:  # the step's OOMs, every rank's, folded and written now: in the checkpoint
            self.settle_step(hold=False)
        self.saved_oom_count = distributed.sum_ints([self.runner.oom_count])[0]  # every rank's, in rank 0's state
        self.checkpoints.save(checkpoint_dir, self, self.loader, self.callback_components(), self.feed.fingerprint)

    def state_dict(self) -> dict[str, Any]:
        request = protocol.pending_request(self.trainer.control)
        return {
            **self.metrics.state_dict(),
            'pending_request': None if request.empty else asdict(request),
            'held_decisions': [r.to_json() for r in self.decisions.held],
            'pass_budget': self.pass_budget.state_dict(),
            'oom_count': self.saved_oom_count,
            'packed_attention': self.attention.state_dict(),
            'layout': self.layout.state_dict(),
            'optimizer': self.optimizer.state_dict(),
            'scheduler_steps': self.budget.scheduler_steps,
            'sequence_parallel_size': distributed.sequence_parallel_size(),
            'grpo_passes': self.grpo_passes.state_dict() if self.grpo_passes is not None else None,
            'eval_passes': self.eval_passes.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.decisions.held = [DecisionRecord(**r) for r in state.get('held_decisions', [])]
        self.pass_budget.load_state_dict(state.get('pass_budget'))
        if state.get('pass_limit') is not None:  # a checkpoint of 0.1: the requested limit was saved apart
            self.pass_budget.requested = state['pass_limit']
        self.attention.load_state_dict(state.get('packed_attention'))
        # every rank's OOMs so far (rank 0's state): counted once, on rank 0, so that the logged sum over ranks holds
        self.runner.oom_count = int(state.get('oom_count', 0)) if distributed.rank() == 0 else 0
        self.layout.load_state_dict(state.get('layout'))
        self.optimizer.load_state_dict(state.get('optimizer'))
        self.budget.saved_scheduler_steps = state.get('scheduler_steps')
        if self.grpo_passes is not None:
            self.grpo_passes.load_state_dict(state.get('grpo_passes'))
        self.eval_passes.load_state_dict(state.get('eval_passes'))
        self.metrics.load_state_dict(state)
        pending = state.get('pending_request')
        if pending:
            set_request(self.trainer.control, pending)


def _grpo_setting(trainer: Any, name: str) -> Any:
    """A GRPO setting as the trainer runs it (its own attribute where ms-swift keeps one, else its arguments')."""
    if name == 'rlhf_type':
        return 'grpo'
    if name == 'loss_type' and getattr(trainer, 'loss_type', None) is not None:
        return trainer.loss_type
    if name == 'padding_free':
        return bool(getattr(getattr(trainer, 'template', None), 'padding_free', False)
                    or getattr(trainer.args, 'padding_free', False))
    if name == 'multimodal':
        return bool(getattr(trainer, 'is_multimodal', False))
    if name in ('deepspeed', 'fsdp'):
        return bool(getattr(trainer, 'is_deepspeed_enabled' if name == 'deepspeed' else 'is_fsdp_enabled', False))
    return getattr(trainer.args, name, None)

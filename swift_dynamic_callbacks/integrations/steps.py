"""The step runner: one optimizer step's micro-batches as forward/backward passes on the engine, with OOM recovery.

HF calls ``training_step`` once per micro-batch; :meth:`StepRunner.run_micro_batch` runs it as one or more passes
(requested pieces, or more to respect the pass limit; the same ``num_items_in_batch``, so the same gradient; a
:class:`~..slots.PassGroup` slot is several passes cut by ``pass_tokens``), lets a rank without samples join the
engine's collectives, recovers from out-of-memory errors and, after the step's last
pass, has the engine reduce the step's gradients. Everything engine-specific is asked of the
:class:`~.engines.base.Engine` adapter chosen at start; nothing here branches on the engine.

What a pass may hold is asked of the :class:`~.pass_budget.PassBudget` (the one owner of every cap: the requested
limit, the plan's, the OOM budget, this step's); the runner says whether a micro-batch may run as several passes at
all (:meth:`StepRunner.check_splittable`: not for packed rows, ``swift rlhf`` pairs, or engines whose passes hold
collectives) and how many pieces a batch needs (:func:`~..policies.pass_cost.pieces_within`, the planner's cost
model: ``rows x longest`` padded, the sum packed). After an OOM the failing pass is re-cut within half of it (tokens
where passes are cut by tokens, else rows) for the rest of the step; the budget owner folds the OOM into later steps
at the next boundary.

A micro-batch run as several pieces keeps its gradient for every loss the runner runs under (:mod:`.loss_kind`): a
token sum as it is, a mean per call (label smoothing, a sequence classifier) each piece weighted by its share of the
label tokens or rows (:attr:`StepRunner.loss_weight`, applied in the trainer's ``compute_loss``). Under a loss whose
pieces do not add up, OOM recovery is off (``auto``: a warning and the ``engine`` record) or refused (``true``).

State kept for one step only (set by :meth:`StepRunner.start_step` at every step boundary): the micro-batches and
their dataset indices, the pieces asked for, the pass being run, the OOM retries. Kept for the run and saved with the
integration's state: ``oom_count`` (every OOM of the run).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Mapping

import torch

from .. import distributed, protocol
from ..config import ConfigError
from ..config.integration import IntegrationConfig
from ..config.rules import PACKED_WHY, PAIRS_WHY, SP_WHY, recovery_refused
from ..data.slots import EmptyMicroBatch, PassGroup
from ..device_memory import device_figures, free_memory, is_oom
from ..policies.data_plan import piece_bounds
from ..policies.memory import pass_cap
from ..policies.pass_cost import pass_cost, pieces_within
from ..records import DecisionRecord
from .auto_budget import vision_cost
from .engines import Engine, select_engine
from .input_kinds import InputKind, TextRows, Unsupported, select_input_kind
from .loss_kind import LossKind, loss_kind, piece_weights
from .packed_attention import PackedAttention
from .oom_report import PassOom, recovered, too_large_message, unrecovered_message, unrecovered_note
from .pass_budget import PassBudget, write_oom_note
from .padding_free import PackedBatch
from .passes import GradNoiseProbe, SampleTooLargeError, batch_shape, frozen_base, grad_snapshot, pass_lengths, \
    restore_grads, row_tokens, split_micro_batch

Run = Callable[[Mapping[str, Any]], torch.Tensor]
logger = logging.getLogger('swift_dynamic_callbacks')



def host_packs_rows(trainer: Any) -> bool:
    """Whether ms-swift already packs a micro-batch into one ``[1, N]`` row (``packing`` / ``padding_free``)."""
    args = trainer.args
    return bool(getattr(getattr(trainer, 'template', None), 'padding_free', False)
                or getattr(args, 'padding_free', False) or getattr(args, 'packing', False))


def is_pairs(trainer: Any) -> bool:
    """Whether a sample is several rows run together (``swift rlhf``: DPO/ORPO/... chosen + rejected, KTO
    completion + KL row; the template's ``mode`` is ``rlhf`` or ``kto``)."""
    return getattr(getattr(trainer, 'template', None), 'mode', None) in ('rlhf', 'kto')


class StepRunner:
    """Runs the micro-batches of one optimizer step (see the module docstring).

    Args:
        trainer: the HF / ms-swift trainer (read: ``args``, ``state``, ``template``, ``control``).
        engine: the engine adapter (:meth:`begin` chooses the run's).
        oom_recovery: whether an OOM is recovered from (the engine allows it and the setting asks for it).
        single_sample_retries: how often a one-sample pass that ran out of memory is run again (memory freed before
            each try) before the sample is declared too large.
    """

    def __init__(self, trainer: Any, engine: Engine, *, oom_recovery: bool, single_sample_retries: int,
                 attention: PackedAttention | None = None, budget: PassBudget | None = None) -> None:
        self.trainer = trainer
        self.attention = attention or PackedAttention()  # the packed rows' kernel (chosen, proven, fallen back from)
        self.budget = budget or PassBudget()  # what a pass may hold (the one owner of every cap)
        self.records: list[DecisionRecord] = []  # decisions made inside a step, held at the next boundary
        self.engine = engine
        self.oom_recovery = oom_recovery
        self.single_sample_retries = single_sample_retries
        self.oom_count = 0
        self.loss = LossKind('token_sum', None, '')  # the training loss's kind (begin)
        self.kind: InputKind = TextRows()  # how a micro-batch of the run's model is cut into passes (begin)
        self.input_refusal: str | None = None  # a key of the run's micro-batches the kind cannot cut (check_inputs)
        self.loss_weight: float | None = None  # the running piece's share of its micro-batch's mean loss
        self.oom_off: str | None = None  # why OOM recovery is off in this run (begin)
        self.batches: list[Any] = []
        self.indices: list[list[int]] = []
        self.num_pieces = 1  # the passes a micro-batch of this step is cut into at least (requested)
        self.max_pass = 0  # the largest pass (samples) of the step so far
        self.max_cost = 0  # the largest pass's cost (tokens) of the step so far
        self._current_cost = 0  # the running pass's cost (tokens)
        self.patch_cost = 0.0  # tokens of the cost model a patch through the vision tower is worth (begin)
        self.vision_token_cost = 0.0  # the same, an image (video) token: patch_cost x the patches merged into one
        self.oom: dict[str, Any] | None = None  # this step's OOM: pass_size, new_cap, record
        self.probe: GradNoiseProbe | None = None
        self._micro = 0
        self._current: tuple[int, int, int] | None = None  # (micro-batch, first row, end row) of the running pass
        self._halvings = 0
        self._single_retries = 0
        self._adapter_like: bool | None = None
        self._template: Mapping[str, Any] | None = None  # a row of the last real micro-batch (placeholder passes)
        self._checked = False
        self._can_split: bool | None = None  # whether a micro-batch may run as several passes (checked once)
        self.padding_free = False  # every pass runs as one packed row (a batch plan's padding_free)
        self._pass_stats = [0, 0, 0]  # passes run, steps started, padding passes run, since the last read
        self._pads: list[int] = []  # per slot of this step: padding passes to run after its own (equal passes)
        self.output_dir: str | None = None  # where an OOM this run cannot recover from leaves its note

    def begin(self, config: IntegrationConfig, pack_config: Mapping[str, Any]) -> DecisionRecord:
        """At train start: choose the engine adapter, refuse what it cannot run (``config.engines``), decide whether
        OOMs are recovered from; returns the ``engine`` decision record."""
        from ..config.engines import check_engine
        from .engines import engine_name
        listed = [getattr(cb, 'name', '') for cb in self.trainer.callback_handler.callbacks]
        check_engine(engine_name(self.trainer), pack_config, listed)
        self.engine, recovery, why_off = select_engine(self.trainer, config.oom_recovery)
        if recovery and is_pairs(self.trainer):
            if config.oom_recovery is True:
                raise ConfigError(f'dynamic_callbacks.integration.oom_recovery: true is not supported under swift '
                                  f'rlhf: {PAIRS_WHY}; use auto or false')
            recovery, why_off = False, f'swift rlhf: {PAIRS_WHY}'
        if recovery and host_packs_rows(self.trainer):  # oom_recovery: true was refused (rules.recovery_packed)
            recovery, why_off = False, f'packing / padding_free: {PACKED_WHY}'
        self.loss = loss_kind(self.trainer)
        if recovery and not self.loss.splittable:
            if config.oom_recovery is True:
                raise ConfigError(recovery_refused(self.loss.setting, self.loss.why))
            recovery, why_off = False, f'{self.loss.setting}: {self.loss.why}'
        if recovery and distributed.sequence_parallel_size() > 1:  # every pass holds the group's exchange
            recovery, why_off = False, f'sequence_parallel_size: {distributed.sequence_parallel_size()}: {SP_WHY}'
        self.kind = select_input_kind(self.trainer)
        self.vision_token_cost, merge, vision = vision_cost(self.trainer.model, self.trainer.args)
        self.patch_cost = self.vision_token_cost / merge
        self.input_refusal = self.kind.refusal({}) if isinstance(self.kind, Unsupported) else None
        if recovery and self.input_refusal:
            if config.oom_recovery is True:
                raise ConfigError(f'dynamic_callbacks.integration.oom_recovery: true cannot be used here: '
                                  f'{self.input_refusal}; use auto or false')
            recovery, why_off = False, self.input_refusal
        self.oom_recovery, self.single_sample_retries = recovery, config.oom_single_sample_retries
        self.attention.mode = config.packed_attention
        self.oom_count, self._checked, self._can_split, self._adapter_like = 0, False, None, None
        self.oom_off = None if recovery else why_off
        message = f'engine {self.engine.name}' + ('' if recovery else f'; OOM recovery off ({why_off})')
        if not recovery and config.oom_recovery == 'auto':
            logger.warning(message)
        return DecisionRecord('integration', 'engine', self.engine.name,
                              {**self.engine.describe(), 'oom_recovery': recovery,
                               'oom_recovery_off': None if recovery else why_off, 'loss': self.loss.kind,
                               'loss_setting': self.loss.setting, **self.kind.describe(), **vision}, message)

    # ---- what a micro-batch may be cut into -------------------------------------------------------------------
    def split_refusal(self) -> str | None:
        """The one rule for whether this run may cut a collated micro-batch into several passes, asked by every source
        of a split (OOM recovery, the note of an OOM that ended a run, ``memory_backoff``, pieces, pass caps,
        ``split: passes``, the over-estimate split): why it may not (pairs under ``swift rlhf``, rows ms-swift
        packs, a loss whose pieces do not add up), else ``None``. Engine refusals are per feature
        (:meth:`check_splittable`)."""
        if is_pairs(self.trainer):
            return f'not supported under swift rlhf: {PAIRS_WHY}'
        if host_packs_rows(self.trainer):
            return ('a micro-batch cannot run as several passes with packing / padding_free: a packed micro-batch is '
                    'one [1, N] row and cannot be split')
        if not self.loss.splittable:
            return f'a micro-batch cannot run as several passes under {self.loss.setting}: {self.loss.why}'
        if self.input_refusal:
            return f'a micro-batch cannot run as several passes: {self.input_refusal}'
        return None

    def check_inputs(self, batches: list[Any], pieces: int = 1) -> DecisionRecord | None:
        """At a step boundary, before the step's batches are prepared: the first key of a real micro-batch the input
        kind cannot cut (:meth:`~.input_kinds.InputKind.refusal`) makes every later split refused, turns OOM recovery
        off (the returned ``oom_recovery`` record, held for the boundary; a warning) and, where this step would cut a
        micro-batch already (``pieces`` > 1, a pass limit), stops the run here naming the key: never a
        ``ValueError`` mid-pass."""
        if self.split_refusal() is not None:  # never cut anyway (pairs, packed rows, the loss, a refused key)
            return None
        why = next((w for w in (self.kind.refusal(b) for b in batches if isinstance(b, Mapping)) if w), None)
        if why is None:
            return None
        self.input_refusal, self._can_split = why, None
        if pieces > 1 or self.budget.requested:
            raise ConfigError(f'control.new_num_pieces / new_pass_limit: a micro-batch cannot run as several passes: '
                              f'{why}')
        if not self.oom_recovery:
            return None
        self.oom_recovery, self.oom_off = False, why
        message = f'OOM recovery off from this step on: {why} (an OOM ends the run with what to lower)'
        logger.warning(message)
        return DecisionRecord('integration', 'oom_recovery', 'off', {'why': why, 'input_kind': self.kind.name},
                              message, step=int(self.trainer.state.global_step))

    def check_splittable(self, setting: str, feature: str = 'pieces') -> None:
        """Raise when a micro-batch cannot run as several passes: :meth:`split_refusal`, or an engine whose passes
        hold collectives (``config.engines``; ``feature``: the row of its table, ``pieces`` or ``pass_limit``)."""
        refusal = self.split_refusal()
        if refusal is not None:
            raise ConfigError(f'{setting}: {refusal}')
        self.engine.refuse(feature, setting)

    def set_padding_free(self, on: bool, model: Any) -> DecisionRecord | None:
        """Run every pass as one packed row from now on (``on``), with the attention the
        :class:`~.packed_attention.PackedAttention` part chooses (``integration.packed_attention``) and proves keeps
        packed rows apart; refused under ``swift rlhf`` and ms-swift's own packing. Returns the ``packed_attention``
        decision when padding-free passes start."""
        record = None
        if on and not self.padding_free:
            setting = 'length_batching.padding_free'
            if is_pairs(self.trainer):
                raise ConfigError(f'{setting}: not supported under swift rlhf (a sample is several rows whose loss '
                                  'pairs them; they are not flattened)')
            if host_packs_rows(self.trainer):
                raise ConfigError(f'{setting}: ms-swift\'s padding_free / packing already pack the rows; use one')
            if distributed.sequence_parallel_size() > 1:
                raise ConfigError(f'{setting}: not supported with sequence_parallel_size: '
                                  f'{distributed.sequence_parallel_size()} (ms-swift pads and splits each row across '
                                  'the group; for packed rows use ms-swift\'s own padding_free)')
            if not self.kind.packs:
                raise ConfigError(f'{setting}: not supported for {self.kind.setting or self.kind.name} rows '
                                  f'({self.kind.name}: 3-D rotary positions and images the pack\'s packing does not '
                                  'redo); use ms-swift\'s own padding_free (flash attention) or remove the setting')
            collective = self.engine.collective_passes
            record = self.attention.start(model, probe_backward=not collective, sharded=collective, setting=setting)
        self.padding_free = bool(on)
        return record

    def take_records(self) -> list[DecisionRecord]:
        """The decisions made inside the last step (a kernel fallback), to hold at the boundary."""
        records, self.records = self.records, []
        return records

    def splittable(self) -> bool:
        """Whether a micro-batch may run as several passes here (checked once)."""
        if self._can_split is None:
            try:
                self.check_splittable('length estimates')
                self._can_split = True
            except ConfigError:
                self._can_split = False
        return self._can_split

    def effective_pass_limit(self) -> dict[str, Any] | None:
        """The limit a pass is cut at now (the budget owner's; a step's estimate budget applies where passes can
        split)."""
        return self.budget.limit(estimates_split=self.budget.estimate is not None and self.splittable())

    def set_pass_limit(self, limit: Mapping[str, Any], *, checked: bool = False) -> dict[str, Any] | None:
        """Apply a requested pass limit (all caps empty: none); ``checked``: its splittability was already settled.
        Returns the old limit."""
        if any(limit.values()) and not checked:
            self.check_splittable('control.new_pass_limit', 'pass_limit')  # refused up front, not at a split
        return self.budget.set_requested(limit)

    @property
    def pass_limit(self) -> dict[str, Any] | None:
        """The requested pass limit (``memory_backoff``'s), without the OOM budget."""
        return self.budget.requested

    def noise_probe(self, pairs: list[tuple[list[int], Any]], num_items_in_batch: Any) -> GradNoiseProbe | None:
        """The gradient-noise probe of this step when a callback asked for one (``control.measure_grad_noise``)."""
        if not protocol.grad_noise_requested(self.trainer.control):
            return None
        self.engine.refuse('noise_scale', 'control.measure_grad_noise (batch_growth policy: noise_scale, '
                           'training_log noise_scale)')
        if distributed.sequence_parallel_size() > 1:
            raise ConfigError('control.measure_grad_noise (batch_growth policy: noise_scale, training_log '
                              'noise_scale): not supported with sequence_parallel_size > 1 (a pass\'s gradient on one '
                              'rank is not its rows\')')
        return GradNoiseProbe(
            sum(len(indices) for indices, _ in pairs), world=distributed.data_world(),
            tokens_averaged=bool(getattr(self.trainer.args, 'average_tokens_across_devices', False)),
            num_items_in_batch=num_items_in_batch)

    # ---- one step -----------------------------------------------------------------------------------------
    def start_step(self, pairs: list[tuple[list[int], Any]], probe: GradNoiseProbe | None, *, num_pieces: int = 1,
                   budget_tokens: int | None = None) -> None:
        """A new optimizer step with ``pairs`` (dataset indices, collated micro-batch), cut into at least
        ``num_pieces`` passes a micro-batch; ``budget_tokens``: the token budget of a plan whose lengths are
        estimates (a micro-batch over it runs as several passes within it, when passes can split)."""
        self.batches = [batch for _, batch in pairs]
        self.indices = [indices for indices, _ in pairs]
        self.num_pieces = num_pieces
        self.budget.start_step(budget_tokens)
        self._micro = self.max_pass = self.max_cost = self._halvings = self._single_retries = 0
        self.oom = None
        self.probe = probe
        self._pass_stats[1] += 1
        if self._template is None:  # a padding pass copies a row of the step's first real batch
            self._template = self._first_row(next((b for b in (_first_batch(s) for s in self.batches)
                                                   if b is not None), None))
        self._pads = self._equal_passes() if self.engine.collective_passes else [0] * len(self.batches)

    def _slot_passes(self, slot: Any) -> int:
        """The passes this rank runs for one slot at the limit in force now: one for an empty slot (a placeholder
        or padding pass), else each batch's pieces."""
        if isinstance(slot, EmptyMicroBatch):
            return 1
        batches = slot.passes if isinstance(slot, PassGroup) else [slot]
        return sum(1 if isinstance(b, EmptyMicroBatch) else self._pieces(b) for b in batches)

    def _equal_passes(self) -> list[int]:
        """Engines whose every pass communicates: the padding passes each slot needs so that every rank runs as many
        passes in it as the rank that runs most. Passes the planner cut (``pass_tokens``) are equal already (padded
        when planned), so nothing is exchanged; where a pass limit or pieces could cut a micro-batch differently on
        each rank (their rows' lengths), one small all-reduce of the slots' pass counts a step agrees them."""
        own = [self._slot_passes(slot) for slot in self.batches]
        # the planner's passes are never cut again, unless the vision tower's work (priced here, not when planned) does
        planned = self.budget.unit == 'tokens' and self.budget.estimate is None and not self.patch_cost
        if planned or (self.effective_pass_limit() is None and self.num_pieces <= 1):
            return [0] * len(own)
        return [most - mine for most, mine in zip(distributed.max_ints(own), own)]

    def _pieces(self, batch: Any) -> int:
        """The passes one collated batch runs as at the limit in force now (:func:`pieces_within`)."""
        _, length = batch_shape(batch)
        lengths, packed = pass_lengths(batch), isinstance(batch, PackedBatch)
        limit = self.effective_pass_limit()
        samples = pass_cap(length, {**limit, 'tokens': None}) if limit else None
        return pieces_within(lengths, packed=packed, tokens=(limit or {}).get('tokens'), samples=samples,
                             requested=self.num_pieces, vision=self._vision(batch))

    def _vision(self, batch: Any) -> list[int] | None:
        """Each row's vision-tower work in tokens of the cost model (its patches x :attr:`patch_cost`), or ``None``
        (no tower priced, or a batch whose rows' patches are not known)."""
        patches = self.kind.vision_patches(batch) if self.patch_cost else None
        return None if patches is None else [math.ceil(n * self.patch_cost) for n in patches]

    def _first_row(self, batch: Any) -> Any:
        """The first row of a collated batch, cut by its input kind (a packed batch: its first packed row), for
        the zero-weight passes of a rank without samples (``Engine.zero_weight_batch``); ``None`` stays ``None``. A
        batch this run may not cut (:meth:`split_refusal`: pairs, rows compared by the loss, a key the kind does not
        cut) is kept whole: a zero-weight pass over all of it is still a valid call of the loss."""
        rows = batch_shape(batch)[0] if batch is not None else 0
        if rows <= 1 or isinstance(batch, PackedBatch) or self.split_refusal() is not None:
            return batch
        return self.kind.cut(batch, [(0, 1), (1, rows)])[0]

    def take_pass_stats(self) -> tuple[int, int, int]:
        """``(passes run, steps started, padding passes run)`` since the last call (OOM retries included), and reset
        them."""
        stats, self._pass_stats = tuple(self._pass_stats), [0, 0, 0]
        return stats

    def clear(self) -> None:
        self.batches, self.indices = [], []

    # ---- one micro-batch ----------------------------------------------------------------------------------
    def run_micro_batch(self, model: Any, inputs: Any, run: Run, num_items_in_batch: Any) -> torch.Tensor:
        """Run one HF micro-batch (HF's ``training_step``).

        A placeholder (no sample on this rank) runs what the engine needs to join the other ranks' collectives. A
        real micro-batch runs as one or more passes. With OOM recovery, an out-of-memory error in any pass (forward
        or backward) does not end the run: the step's gradients are dropped (``grad = None``: nothing of the failed
        attempt leaks into the step), memory is freed, the pass cap is halved, and the micro-batch is run again in
        smaller passes — the same samples with the same loss normalisation, so the optimizer step sees the same
        gradient. The gradients the step had before this micro-batch come back from a snapshot taken before it when
        the trainable parameters are a small part of the model (LoRA and other adapters: at most 10 %, so the copy
        is cheap); otherwise the step's earlier micro-batches are run again too (their losses were already counted
        by HF and are not counted again). A one-sample pass that runs out of memory is run again up to
        ``single_sample_retries`` times; then :class:`SampleTooLargeError` stops the run (never a skipped sample).
        """
        if not self._checked:
            self.engine.check_wrapped(model)
            self._checked = True
        index = self._micro
        self._micro += 1
        last_of_step = index == len(self.batches) - 1
        pads = self._pads[index] if index < len(self._pads) else 0
        if isinstance(inputs, EmptyMicroBatch):
            loss = self.engine.placeholder_pass(model, run, self._template, sync=last_of_step and not pads)
            self._pad(model, run, pads, last_of_step)
            if last_of_step:
                self._finish_step(model)
            # A plain zero, not ``loss * 0``: the loss over a row whose labels are all ignored can be NaN (a mean
            # over no tokens), and the trainer adds what is returned here to the logged training loss.
            return torch.zeros((), device=loss.device if loss is not None else self.trainer.args.device)
        self._template = self._first_row(_first_batch(inputs)) or self._template
        if not self.oom_recovery:
            try:
                loss = self._run_passes(model, inputs, run, num_items_in_batch, index, final=last_of_step and not pads)
            except Exception as error:  # noqa: BLE001 - a switched kernel's failure is reported, then re-raised
                if is_oom(error):
                    self._unrecovered_oom(error)
                elif self.padding_free and self.attention.switched:
                    logger.error(f'{self.attention.kernel} failed during training and OOM recovery is off here, so '
                                 'the step cannot be run again on sdpa; set integration.packed_attention: sdpa')
                raise
            self._pad(model, run, pads, last_of_step)
        else:
            loss = self._run_with_recovery(model, inputs, run, num_items_in_batch, index, last_of_step)
        if last_of_step:
            self._finish_step(model)
        return loss

    def _pad(self, model: Any, run: Run, pads: int, last_of_step: bool) -> None:
        """``pads`` padding passes after a slot's own (the last one ends the step when the slot does)."""
        for k in range(pads):
            self._padding_pass(model, run, sync=last_of_step and k == pads - 1)

    def _padding_pass(self, model: Any, run: Run, *, sync: bool) -> None:
        """One zero-weight pass so that this rank runs as many passes in the step as the others (counted)."""
        self.engine.padding_pass(model, run, self._template, sync=sync)
        self._pass_stats[2] += 1

    def _run_with_recovery(self, model: Any, inputs: Any, run: Run, num_items_in_batch: Any, index: int,
                           last_of_step: bool) -> torch.Tensor:
        snapshot = grad_snapshot(model) if self._snapshot_grads(model) else None
        retries = ooms = 0
        kernel_error: BaseException | None = None
        while True:
            failed: Any = None  # (micro-batch, first row, end row) of the failing pass, or 'outside' one
            try:
                if retries and snapshot is not None:  # the step's gradients before this micro-batch, back
                    restore_grads(model, snapshot)
                elif retries:  # the step so far, again: the gradients were dropped
                    for j in range(index):
                        if not isinstance(self.batches[j], EmptyMicroBatch):
                            self._run_passes(model, self.batches[j], run, num_items_in_batch, j, final=False)
                loss = self._run_passes(model, inputs, run, num_items_in_batch, index, final=last_of_step)
            except Exception as error:  # noqa: BLE001 - OOMs and a switched kernel's failure; the rest is re-raised
                if not is_oom(error):
                    if not (self.padding_free and self.attention.switched):
                        raise
                    kernel_error = error
                else:
                    failed = self._current if self._current is not None else 'outside'

            if kernel_error is not None:  # the model's own attention from now on, the micro-batch again
                inputs = self._fall_back(model, kernel_error, inputs)
                kernel_error = None
                retries += 1
                continue
            if failed is None:
                if ooms:
                    self._report_oom(retries)
                return loss
            retries += 1
            ooms += 1
            self._recover(model, None if failed == 'outside' else failed)

    def _run_passes(self, model: Any, inputs: Any, run: Run, num_items_in_batch: Any, index: int, *,
                    final: bool) -> torch.Tensor:
        """One micro-batch slot: a collated micro-batch, or each batch of a :class:`PassGroup` in turn, as passes.
        ``final``: the step's last slot (its last pass syncs)."""
        if not isinstance(inputs, PassGroup):
            return self._run_batch(model, inputs, run, num_items_in_batch, index, 0, final=final)
        total, offset = None, 0
        for k, batch in enumerate(inputs.passes):
            last = final and k == len(inputs.passes) - 1
            if isinstance(batch, EmptyMicroBatch):  # a padding pass the planner added (equal passes)
                self._padding_pass(model, run, sync=last)
                continue
            loss = self._run_batch(model, batch, run, num_items_in_batch, index, offset, final=last)
            total = loss if total is None else total + loss
            offset += batch_shape(batch)[0]
        return total if total is not None else torch.zeros((), device=self.trainer.args.device)

    def _run_batch(self, model: Any, inputs: Any, run: Run, num_items_in_batch: Any, index: int, offset: int, *,
                   final: bool) -> torch.Tensor:
        """One collated batch as ``pieces`` passes; ``offset``: its first row's place in the slot. ``final``: its
        last pass is the step's last (it syncs)."""
        rows, _ = batch_shape(inputs)
        lengths, packed = pass_lengths(inputs), isinstance(inputs, PackedBatch)
        vision = self._vision(inputs)
        pieces = self._pieces(inputs)
        probe = self.probe
        if pieces > 1 and num_items_in_batch is None and self.loss.kind == 'token_sum':
            raise RuntimeError('splitting a micro-batch into passes (num_pieces > 1, a pass limit or OOM recovery) '
                               'needs the loss normalised by num_items_in_batch (token-sum losses, as ms-swift uses); '
                               'this model/trainer computes a per-batch mean, so splitting would change the gradient')
        if probe is not None and num_items_in_batch is None:
            raise RuntimeError('measure_grad_noise needs the loss normalised by num_items_in_batch (token-sum '
                               'losses, as ms-swift uses); this model/trainer computes a per-batch mean')
        if pieces > 1:
            self.check_splittable('new_num_pieces / new_pass_limit')
        bounds = piece_bounds(rows, pieces)
        parts = split_micro_batch(inputs, pieces, self.kind) if pieces > 1 else [inputs]
        weights = piece_weights(self.loss, parts) or [None] * len(parts)
        total = None
        for i, (part, (start, stop), weight) in enumerate(zip(parts, bounds, weights)):
            last = i == len(parts) - 1
            self._current = (index, offset + start, offset + stop)
            self._current_cost = pass_cost(lengths[start:stop], packed=packed,
                                           vision=vision[start:stop] if vision else None)
            self.max_pass = max(self.max_pass, stop - start)
            self.max_cost = max(self.max_cost, self._current_cost)
            self._pass_stats[0] += 1
            self.loss_weight = weight
            try:
                with self.engine.pass_context(model, sync=final and last), self.attention.training_pass():
                    loss = run(dict(part))
            finally:
                self.loss_weight = None
            self.budget.ran(stop - start, self._current_cost)
            total = loss if total is None else total + loss
            if probe is not None:
                probe.after_pass(model, part, num_items_in_batch)
        self._current = None
        setattr(self.trainer.control, protocol.PASS_SIZE, self.max_pass)
        setattr(self.trainer.control, protocol.PASS_COST, self.max_cost if self.budget.unit == 'tokens' else 0)
        return total

    def _finish_step(self, model: Any) -> None:
        """After the step's last pass: the engine's gradient reduction, then the noise probe's step measurement
        (the gradient the optimizer uses, reduced across ranks)."""
        self.engine.finish_step(model)
        if self.probe is not None:
            sample = self.probe.finish(model)
            if sample is not None:
                setattr(self.trainer.control, protocol.GRAD_NOISE_SAMPLE, sample)

    def _fall_back(self, model: Any, error: BaseException, inputs: Any) -> Any:
        """After a switched kernel failed in a pass of ``inputs``: drop the step's gradients (the caller restores
        or recomputes the earlier ones), switch to the model's own attention, finish the step's batches for it; the
        record is held for the boundary. Returns ``inputs`` finished again."""
        for p in model.parameters():
            p.grad = None
        self.probe = None
        self._current = None
        free_memory()
        self.records.append(self.attention.fall_back(model, error, self.trainer.state.global_step))
        self.batches = [self.attention.refinish(b) for b in self.batches]
        return self.attention.refinish(inputs)

    # ---- out of memory -------------------------------------------------------------------------------------
    def _snapshot_grads(self, model: Any) -> bool:
        if self._adapter_like is None:
            self._adapter_like = frozen_base(model)
        return self._adapter_like

    def _recover(self, model: Any, failed: tuple[int, int, int] | None) -> None:
        """After an OOM (outside the ``except`` block, so the traceback no longer pins tensors): drop the step's
        gradients, free memory, let the engine repair its state, then cut the failing pass in half for the rest of the
        step (the budget owner's step cap). A one-row pass cannot be cut, and an OOM outside any pass (``failed``
        ``None``) has no pass to cut: the micro-batch is run again as it was, memory freed, a bounded number of times
        (``single_sample_retries``); neither lowers the budget of the passes that follow."""
        size, cost = (failed[2] - failed[1], self._current_cost) if failed is not None else (0, 0)
        for p in model.parameters():
            p.grad = None
        self.probe = None  # the first-pass gradient of this step is gone
        free_memory()
        self.engine.after_oom(model)
        self.oom_count += 1
        cap = self.budget.after_oom(size, cost)
        if cap is None:
            if self._single_retries < self.single_sample_retries:
                self._single_retries += 1
                self.oom = {'pass_size': size, 'pass_tokens': cost if failed is not None else None, 'new_cap': None,
                            'record': None}
                return
            if failed is None:
                raise RuntimeError(f'out of memory outside a forward/backward pass {self._single_retries + 1} times '
                                   f'in a row (memory: {device_figures()})')
            raise self._too_large(failed[0], failed[1])
        self._halvings += 1
        self.oom = {'pass_size': size, 'pass_tokens': cost, 'new_cap': cap, 'record': None}

    def _facts(self, size: int, tokens: int | None) -> PassOom:
        """The facts of an OOM in a pass of ``size`` rows (``tokens``), for :mod:`.oom_report`."""
        return PassOom(distributed.rank(), int(self.trainer.state.global_step), size, tokens, self.budget.unit,
                       self.budget.fitted, device_figures())

    def _unrecovered_oom(self, error: BaseException) -> None:
        """An OOM where recovery is off (FSDP2, DeepSpeed, or by setting): say which pass, the budget and the setting
        to lower, and leave a note in the output folder (``dynamic_oom.rank<R>.json``) that a run resumed from an
        earlier checkpoint folds into its pass budget before its first step (a ``pass_budget`` record), so it does
        not run out of memory at the same pass again. The error is raised again: the launcher ends every rank."""
        current = self._current
        oom = self._facts(current[2] - current[1] if current is not None else 0, self._current_cost)
        engine = self.engine.name
        refusal = self.split_refusal()
        logger.error(unrecovered_message(
            oom, engine=engine, why_off=self.oom_off or 'oom_recovery: false', budget=self.budget.budget,
            ceiling=self.budget.ceiling, resume=None if refusal else self.budget.resume_budget(oom.pass_size,
                                                                                                self._current_cost),
            cannot_split=refusal, accumulation=int(self.trainer.args.gradient_accumulation_steps)))
        if self.output_dir:
            try:
                write_oom_note(self.output_dir, unrecovered_note(oom, engine=engine, error=error, time=time.time()))
            except OSError as e:  # the note is best effort: the error itself is what the user must see
                logger.error(f'could not write the OOM note: {e}')

    def _too_large(self, micro: int, start: int) -> SampleTooLargeError:
        """The error of the sample at row ``start`` of micro-batch slot ``micro``, which cannot fit alone."""
        batch, row = self.batches[micro], start
        indices = self.indices[micro] if micro < len(self.indices) else []
        for part in batch.passes if isinstance(batch, PassGroup) else ():  # the pass that holds slot row ``start``
            batch = part
            if row < batch_shape(part)[0]:
                break
            row -= batch_shape(part)[0]
        row_ids = batch.get('input_ids') if isinstance(batch, Mapping) else None
        return SampleTooLargeError(too_large_message(
            sample=indices[start] if start < len(indices) else None, tokens=row_tokens(batch, row),
            padded=int(row_ids.shape[-1]) if isinstance(row_ids, torch.Tensor) else None, halvings=self._halvings,
            retries=self._single_retries, setting_retries=self.single_sample_retries, memory=device_figures()))

    def _report_oom(self, retries: int) -> None:
        """The step finished after ``retries`` runs again: the event on the control, the record held in ``oom`` (set
        by :meth:`_recover`, which every retry after an OOM follows)."""
        info = self.oom
        assert info is not None, 'an OOM was recovered from without _recover'
        event, info['record'] = recovered(
            self._facts(info['pass_size'], info['pass_tokens']), new_cap=info['new_cap'], retries=retries,
            single_sample_retries=self._single_retries, oom_count=self.oom_count, loss=self.loss)
        setattr(self.trainer.control, protocol.OOM_EVENT, event)


def _first_batch(slot: Any) -> Any:
    """The first collated batch of data in a slot (``None``: an empty slot or a group of padding passes)."""
    if isinstance(slot, EmptyMicroBatch):
        return None
    if isinstance(slot, PassGroup):
        return next((b for b in slot.passes if not isinstance(b, EmptyMicroBatch)), None)
    return slot

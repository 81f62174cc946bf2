"""GRPO's training phase cut into passes by tokens (``dynamic_callbacks.integration.grpo_pass_tokens``), with OOM
recovery on one process.

ms-swift's ``GRPOTrainer.compute_loss`` runs a micro-batch of completions (its ``model_inputs`` and ``grpo_batch``)
as one forward and one backward. With a token budget, :meth:`GrpoPasses.compute_loss` (called by the trainer mixin's
``compute_loss``, :class:`~.hooks.RunLevelTrainerMixin`) runs it as passes of whole completions, each at most
``budget`` padded tokens (:func:`..policies.rl_passes.plan_passes`): each pass is sliced with ms-swift's own
``get_chunked_inputs``, its loss computed by ms-swift's own ``_compute_loss_and_metrics`` (the same advantages, old
and reference log-probs, KL and clipping as the one-pass call), weighted by its share of the micro-batch's loss under
``loss_type`` (:func:`..policies.rl_passes.pass_weight`) and backpropagated at once, so only one pass's activations
live at a time. The summed weighted losses are the one-pass loss and gradient; the value returned to HF's
``training_step`` is that sum as a leaf (its backward adds nothing). Under DDP every rank runs as many passes as the
rank with most (zero-weight passes: ms-swift's gathers of metrics and DDP's reduction stay in step), all but the
last under ``no_sync``. A ``num_generations`` group's advantages were computed by ms-swift before the batch reached
here and are only sliced, never changed; a micro-batch never leaves its optimizer step.

On one process an OOM in a pass (forward or backward) brings back the gradients from before the micro-batch and runs
it again cut at the step's cap (the failing pass in halves at least; a one-row pass is retried
``oom_single_sample_retries`` times, then the run ends naming what to lower), under the step runner's one snapshot
rule (:func:`~.passes.frozen_base`): an adapter run copies its trainable gradients once a micro-batch; a full
fine-tune keeps no copy, drops the gradients and runs the step's earlier micro-batches again (kept until the step's
boundary: ms-swift holds them in its rollout buffer anyway; their metrics are not counted twice).
The budget is the step runner's one owner, :class:`~.pass_budget.PassBudget`, in tokens, under the same rule
as ``swift sft``: an OOM caps the rest of the step (the largest pass known to run clean below the failing one, else
its half), and the step's outcome is folded in once, at its boundary (the smallest failure, the largest clean pass;
grown back every ``oom_grow_back_steps`` clean steps, probed after ``oom_probe_steps``). The ``oom`` records are the
step runner's (:func:`~.oom_report.recovered`).
Under several processes an OOM ends the run with the pass and what to lower (one rank cannot re-cut alone: every
pass holds ms-swift's metric gathers).

State (``state_dict``): the pass budget (:class:`~.pass_budget.PassBudget`'s) and the OOM count; per step: the passes
run, the step's OOM records and (a full fine-tune with recovery on) its micro-batches.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Mapping

import torch

from .. import distributed
from ..config.rules import GRPO_RECOVERY_WHY
from ..device_memory import device_figures, free_memory, is_oom
from ..policies.pass_cost import BudgetState
from ..policies.rl_passes import WEIGHTING, pass_weight, plan_passes
from ..records import DecisionRecord
from .loss_kind import LossKind
from .oom_report import PassOom, recovered
from .pass_budget import PassBudget
from .passes import frozen_base, grad_snapshot, restore_grads

logger = logging.getLogger('swift_dynamic_callbacks')

#: how GRPO's loss sums over its passes (for the oom record's wording): each pass weighted by its share
_GRPO_LOSS = LossKind('token_sum', None, 'GRPO\'s passes are weighted by their share of the loss under loss_type')


class GrpoPassTooLargeError(RuntimeError):
    """A one-completion pass of GRPO's training phase ran out of memory after its retries."""


class GrpoPasses:
    """Runs GRPO's loss over a micro-batch of completions as passes within a token budget (see the module docstring).

    Args:
        pass_tokens: the budget, in padded tokens (prompt + completion) a pass.
        loss_type: the trainer's ``loss_type`` (one of :data:`..policies.rl_passes.WEIGHTING`).
        oom_recovery: whether an OOM in a pass is recovered from (one process).
        single_sample_retries / grow_back_steps / probe_steps: the ``integration`` OOM settings.
    """

    def __init__(self, pass_tokens: int, loss_type: str, *, oom_recovery: bool, single_sample_retries: int,
                 grow_back_steps: int, probe_steps: int) -> None:
        if loss_type not in WEIGHTING:
            raise ValueError(f'loss_type {loss_type!r}: not one the passes weight ({", ".join(WEIGHTING)})')
        self.ceiling = pass_tokens
        self.loss_type = loss_type
        self.oom_recovery = oom_recovery
        self.single_sample_retries = single_sample_retries
        self.pass_budget = PassBudget(grow_after=grow_back_steps, probe_after=probe_steps)
        self.pass_budget.configure(tokens_ceiling=pass_tokens, rows=1)
        self.pass_budget.start_step(None)
        self.oom_count = 0
        self.step_passes = 0  # the most passes a micro-batch of the last step ran
        self.logp_passes = 0  # the most passes a log-prob forward (no gradient) of the last step ran
        self._ooms: list[DecisionRecord] = []  # this step's oom records (folded into the budget at its boundary)
        self._step_batches: list[_MicroBatch] = []  # a full fine-tune's micro-batches of this step (run again after
        # an OOM: their gradients are dropped with the failing pass's)
        self._frozen: bool | None = None  # whether the base is frozen (an adapter run): read once
        self._current: tuple[int, int] = (0, 0)  # the pass running or last run: (completions, padded length)

    @property
    def budget(self) -> int:
        """The tokens a pass may hold now (the setting, lower after an OOM: in this step, its cap; later, the folded
        budget)."""
        limit = self.pass_budget.limit()
        return int(limit['tokens']) if limit and limit.get('tokens') is not None else self.ceiling

    def describe(self) -> dict[str, Any]:
        return {'grpo_pass_tokens': self.ceiling, 'loss_type': self.loss_type,
                'weighting': WEIGHTING[self.loss_type], 'oom_recovery': self.oom_recovery}

    # ---- one micro-batch -----------------------------------------------------------------------------------------
    def compute_loss(self, trainer: Any, model: Any, inputs: Any, num_items_in_batch: Any) -> torch.Tensor:
        """The trainer's ``compute_loss`` in training: every pass's forward and backward here; returns the summed loss
        as a leaf for HF's ``training_step`` to scale and backpropagate (nothing flows from it).

        After an OOM the micro-batch runs again from the gradients before it, cut at the step's cap, under the step
        runner's one snapshot rule: where the base is frozen (an adapter run) a copy of the gradients taken once
        before the micro-batch comes back; a full fine-tune keeps no second copy of its gradients (exactly when memory
        is short), drops them and runs the step's earlier micro-batches again (their metrics are not counted twice).
        """
        if isinstance(inputs, list):
            assert len(inputs) == 1
            inputs = inputs[0]
        batch = _MicroBatch(trainer, inputs, _ga_divisor(trainer, num_items_in_batch))
        frozen = self._frozen_base(model)
        snapshot = grad_snapshot(model) if self.oom_recovery and frozen else None
        ooms = single = 0
        while True:
            try:
                if ooms and snapshot is None:  # a full fine-tune: the step so far, again (its gradients were dropped)
                    for earlier in self._step_batches:
                        self._run_passes(trainer, model, earlier, count=False)
                total, metrics = self._run_passes(trainer, model, batch, count=True)
                break
            except Exception as error:  # noqa: BLE001 - only OOMs are recovered; everything else is raised
                self._raise_unless_recovered(error)
            # recovered outside the except block, so that no traceback pins the failed pass's tensors
            if snapshot is not None:
                restore_grads(model, snapshot)
            else:
                for p in model.parameters():
                    p.grad = None
            ooms += 1
            single = self._after_oom(trainer, ooms, single, phase='loss')
        del snapshot
        if self.oom_recovery and not frozen:
            self._step_batches.append(batch)
        trainer._aggregate_and_update_metrics(metrics, 'train')
        return total.detach().clone().requires_grad_(True)

    def _run_passes(self, trainer: Any, model: Any, batch: _MicroBatch, *, count: bool) -> tuple[Any, list]:
        """One micro-batch as passes within the budget (every rank as many: zero-weight passes), each backpropagated
        at once; returns the summed weighted loss (on the device) and the passes' metrics. ``count``: the passes run
        for the step (a replay after an OOM adds its gradient only). The pass running is ``_current``."""
        plan = plan_passes(batch.rows, batch.length, self.budget)
        passes = distributed.max_ints([len(plan)])[0] if count else len(plan)  # the most any rank runs
        queue = [(s, e, True) for s, e in plan] + [(0, 1, False)] * (passes - len(plan))
        total: Any = torch.zeros((), device=batch.device)  # summed on the device (read by HF's logging, not here)
        metrics: list[tuple[Any, int]] = []
        for k, (start, end, real) in enumerate(queue):
            weight = batch.weight(self.loss_type, start, end) if real else 0.0
            self._current = (end - start, batch.length)
            part_inputs, part_batch = trainer.get_chunked_inputs(batch.model_inputs, batch.batch, start, end,
                                                                 batch.origin)
            context = trainer.accelerator.no_sync(model) if k < len(queue) - 1 else contextlib.nullcontext()
            with context:
                loss, data = trainer._compute_loss_and_metrics(model, part_inputs, part_batch)
                trainer.accelerator.backward(loss * (weight / batch.divisor))
            self.pass_budget.ran(end - start, (end - start) * batch.length)
            if real:
                total = total + loss.detach() * weight
                metrics.append((data, end - start))
            del loss
        if count:
            self.step_passes = max(self.step_passes, len(queue))
        return total, metrics

    # ---- the log-prob forwards without a gradient ----------------------------------------------------------------
    def logps(self, trainer: Any, model: Any, model_inputs: Mapping[str, Any], grpo_batch: Any, *,
              compute_entropy: bool, origin: Any, whole: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A rollout's old and reference per-token log-probs (ms-swift's ``_get_per_token_logps_and_entropies`` under
        ``no_grad``) cut by the same budget as the loss passes: each pass of whole completions (ms-swift's
        ``get_chunked_inputs``, the same padded length) runs ms-swift's one-call computation and the passes' rows are
        put back together in order, so the result is the one call's (each completion's log-probs are its own). No
        collective runs in these forwards (the unwrapped model), so the ranks need not run as many. An OOM in one is
        recovered as a loss pass's, with ``phase: logps`` (the forwards are run again at the step's cap; nothing to
        restore). ``whole``: the trainer's own call, used when the micro-batch fits the budget or its rows are packed
        (``padding_free``: one row)."""
        rows, length = (int(n) for n in model_inputs['input_ids'].shape[:2])
        if getattr(getattr(trainer, 'template', None), 'padding_free', False):
            return whole()
        ooms = single = 0
        while True:
            plan = plan_passes(rows, length, self.budget)
            if len(plan) <= 1 and not ooms:
                return whole()
            try:
                parts = []
                for start, end in plan:
                    self._current = (end - start, length)
                    part_inputs, part_batch = trainer.get_chunked_inputs(model_inputs, grpo_batch, start, end, origin)
                    parts.append(trainer._get_per_token_logps_and_entropies_single(
                        model, part_inputs, part_batch, compute_entropy=compute_entropy))
                break
            except Exception as error:  # noqa: BLE001 - only OOMs are recovered; everything else is raised
                self._raise_unless_recovered(error)
            parts = []
            ooms += 1
            single = self._after_oom(trainer, ooms, single, phase='logps')
        self.logp_passes = max(self.logp_passes, len(plan))
        logps = torch.cat([part[0] for part in parts])
        entropies = torch.cat([part[1] for part in parts]) if compute_entropy else None
        return logps, entropies

    def _raise_unless_recovered(self, error: BaseException) -> None:
        """In the ``except`` block of a failed pass (``_current``): raise ``error`` unless it is an OOM this run
        recovers from; an OOM it does not recover from as the message of what to lower."""
        if self.oom_recovery and is_oom(error):
            return
        if is_oom(error):
            raise RuntimeError(self._unrecovered(*self._current)) from error
        raise error

    def _after_oom(self, trainer: Any, ooms: int, single: int, *, phase: str) -> int:
        """After the ``ooms``-th OOM of a micro-batch (its gradients already back): memory freed, the OOM noted (the
        step's cap lowered) and, where the failing pass held one completion (it cannot be cut and runs again as it
        was), ``single`` counted against ``oom_single_sample_retries``; returns it."""
        rows, length = self._current
        free_memory()
        self._note_oom(trainer, rows, length, ooms, phase=phase)
        if rows == 1:
            single += 1
            if single > self.single_sample_retries:
                raise GrpoPassTooLargeError(self._too_large(length))
        return single

    def _frozen_base(self, model: Any) -> bool:
        """The step runner's snapshot rule (``passes.frozen_base``), read once a run."""
        if self._frozen is None:
            self._frozen = frozen_base(model)
        return self._frozen

    def _note_oom(self, trainer: Any, size: int, length: int, retries: int, *, phase: str = 'loss') -> int:
        """An OOM in a pass of ``size`` completions (the micro-batch's ``retries``-th): the step's cap (the budget
        owner's rule; returned, in tokens) and the step runner's ``oom`` record (said now, written at the boundary,
        folded into the budget there)."""
        self.oom_count += 1
        cost = size * length
        cap = self.pass_budget.after_oom(size, cost)
        oom = PassOom(distributed.rank(), int(trainer.state.global_step), size, cost, 'tokens', self.pass_budget.fitted,
                      device_figures())
        _, record = recovered(oom, new_cap=cap, retries=retries, single_sample_retries=self.single_sample_retries,
                              oom_count=self.oom_count, loss=_GRPO_LOSS)
        record.values['phase'] = phase
        what = 'loss' if phase == 'loss' else 'log-prob'
        logger.warning(f'{record.message} [GRPO {what} pass: {size} completions x {length} tokens]')
        self._ooms.append(record)
        return self.budget

    def _unrecovered(self, rows: int, length: int) -> str:
        """The message of an OOM this run does not recover from (several processes, or ``oom_recovery: false``), with
        advice that can be followed: a budget below the failing pass while it held several completions; at one
        completion the budget cannot go lower, so what makes a completion smaller or memory larger."""
        why = ('OOM recovery runs on one process: ' + GRPO_RECOVERY_WHY if distributed.world_size() > 1
               else 'oom_recovery: false')
        if rows > 1:
            advice = (f'set dynamic_callbacks.integration.grpo_pass_tokens below {rows * length} (now {self.budget}; '
                      f'{length} is one completion\'s padded tokens), or lower max_completion_length')
        else:
            advice = ('a pass of one completion cannot be cut, so a lower grpo_pass_tokens cannot help: lower '
                      'max_completion_length or max_length, free memory (a smaller num_generations per device, '
                      'gradient_checkpointing, offloading the reference model) or run on one process, where OOM '
                      'recovery retries the pass')
        return (f'out of memory in a GRPO loss pass of {rows} completion{"s" if rows > 1 else ""} x {length} tokens '
                f'under {distributed.world_size()} process{"es" if distributed.world_size() > 1 else ""} ({why}); '
                f'{advice}')

    def _too_large(self, length: int) -> str:
        return (f'one completion of {length} tokens (prompt + completion, padded) runs out of memory alone after '
                f'{self.single_sample_retries} retries: lower max_completion_length or max_length (GRPO\'s passes '
                'cannot cut a completion)')

    # ---- at the step boundary ----------------------------------------------------------------------------------
    def end_step(self, step: int) -> list[DecisionRecord]:
        """After a step: its OOMs folded into the budget once (or the budget grown back after clean steps), as the step
        runner's boundary does; returns the step's records (OOMs, a budget change) for the decision log."""
        folded = self.pass_budget.fold(self._ooms, step, fitted=self.pass_budget.fitted)
        records = self._ooms + ([folded] if folded is not None else [])
        self._ooms = []
        self._step_batches = []
        self.pass_budget.start_step(None)
        return records

    def metrics(self) -> dict[str, Any]:
        """The numbers of the last step for the log line."""
        values = {'dynamic/grpo_passes': self.step_passes, 'dynamic/grpo_logp_passes': self.logp_passes,
                  'dynamic/pass_budget': self.budget,
                  'dynamic/oom_count': self.oom_count}  # recovered on one process only: this rank's are all
        self.step_passes = self.logp_passes = 0
        return values

    def state_dict(self) -> dict[str, Any]:
        return {'pass_budget': self.pass_budget.state_dict(), 'oom_count': self.oom_count, 'ceiling': self.ceiling}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """A checkpoint's budget, kept where the ceiling is the same (another ``grpo_pass_tokens`` starts afresh); a
        checkpoint of the earlier format (its ``BudgetState`` under ``state``) is read too."""
        if not state:
            return
        self.oom_count = int(state.get('oom_count', 0))
        if state.get('ceiling') != self.ceiling:
            return
        if 'pass_budget' in state:
            self.pass_budget.load_state_dict(state['pass_budget'])
        elif 'state' in state:
            self.pass_budget.oom = BudgetState(**state['state'])
        self.pass_budget.configure(tokens_ceiling=self.ceiling, rows=1)



class _MicroBatch:
    """One micro-batch of completions as the passes read it: ms-swift's ``model_inputs`` and ``grpo_batch``, its
    shape, each completion's counted tokens (one read from the device a micro-batch) and HF's divisor."""

    def __init__(self, trainer: Any, inputs: Mapping[str, Any], divisor: float) -> None:
        self.model_inputs, self.batch = inputs['model_inputs'], inputs['grpo_batch']
        self.origin = inputs.get('_origin_data')
        self.rows, self.length = (int(n) for n in self.model_inputs['input_ids'].shape[:2])
        self.device = self.model_inputs['input_ids'].device
        self.row_tokens = counted_mask(trainer, self.batch).sum(dim=-1).tolist()
        self.total_tokens = sum(self.row_tokens)
        self.divisor = divisor

    def weight(self, loss_type: str, start: int, end: int) -> float:
        """The pass ``start:end``'s share of the micro-batch's loss under ``loss_type``."""
        return pass_weight(loss_type, end - start, self.rows, int(sum(self.row_tokens[start:end])), self.total_tokens)


def counted_mask(trainer: Any, batch: Any) -> torch.Tensor:
    """The completion tokens ms-swift's loss counts (``_compute_loss_and_metrics``): the collated ``completion_mask``,
    less every truncated completion under ``overlong_filter`` (ms-swift drops them inside each loss call, so a pass
    holding none filters nothing and one holding them drops them: the same tokens as the one-pass call). The other
    masks ms-swift applies inside a call either act on whole completions of a row-weighted loss
    (``off_policy_sequence_mask_delta``) or are refused with passes (top-entropy masking, rollout importance
    sampling; :data:`..config.rules.GRPO_PASSES_REFUSED`)."""
    mask = batch.completion_mask
    truncated = getattr(batch, 'truncated_mask', None)
    if getattr(trainer, 'overlong_filter', False) and truncated is not None:  # none truncated: the same mask
        mask = mask & ~truncated.bool().unsqueeze(-1)
    return mask


def _ga_divisor(trainer: Any, num_items_in_batch: Any) -> float:
    """What HF's ``training_step`` divides the returned loss by (``current_gradient_accumulation_steps`` unless the loss
    is already scaled for it): every pass's backward is scaled the same."""
    scaled = getattr(trainer, 'loss_is_scaled_for_ga', None)
    if scaled is None:
        scaled = ((getattr(trainer, 'model_accepts_loss_kwargs', False) and num_items_in_batch is not None)
                  or getattr(trainer, 'compute_loss_func', None) is not None)
    if scaled:
        return 1.0
    return float(getattr(trainer, 'current_gradient_accumulation_steps', None)
                 or trainer.args.gradient_accumulation_steps)

"""The elastic training loader: exactly-once epochs at a batch size that may change between optimizer steps.

:class:`ElasticDataLoader` owns the position in the data, counted in samples (``epoch``, ``position`` in this
rank's shard of the epoch order). For each optimizer step the integration calls :meth:`next_step`, which
cuts the next samples of the epoch order into micro-batches (``policies.data_plan``) and returns them
collated, each with the dataset indices it holds. Only consumed samples move the position, so a change of
batch size, a restart of the workers or a resume never drops or repeats a sample.

Under the hood one torch ``DataLoader`` (:class:`~.prefetch.Prefetch`: the host's collate function, workers, pin-memory
and prefetch settings) runs over a batch sampler that reads the current plan whenever an iterator is created. Workers
prefetch ahead; when the batch size changes, the iterator is recreated from the current position and
prefetched batches of the old size are discarded (never trained on), so a change is never delayed.

HF sees this object as ``train_dataloader``. It deliberately has no length: the number of steps in an
epoch depends on batch sizes chosen while it runs, so the integration makes HF take its ``max_steps`` path
and ends each epoch itself (``control.should_epoch_stop``).

Length-aware batching (:meth:`ElasticDataLoader.set_plan`, a :class:`~..policies.length.BatchPlan`): the epoch order
may be laid out in shuffled chunks of similar length, and the rest of the epoch is planned as a list of micro-batch
sizes decided from the samples' lengths (token budget or rules, at most ``batch_size`` samples each) before any of
them is collated. The plan is made again (from the current position) at every epoch start, batch-size change and
plan change; under data parallelism the ranks then agree on the number of optimizer steps left in the epoch
(:func:`~..policies.length.agreed_steps`) and a rank with fewer splits its largest micro-batches
(:func:`~..policies.length.equalize_steps`), so no rank waits in an all-reduce for another. The remaining sizes are
part of the state, so a resume continues with exactly the micro-batches the interrupted run would have drawn.

Balanced global steps (a plan with ``mode: balanced``, :mod:`..policies.balance`): every rank lays the whole epoch
(all ranks' samples, ``global_order``) out the same way and takes its share, so each optimizer step holds exactly the
global batch, of samples of similar length, dealt so the ranks' work is even. When the batch size changes inside an
epoch, the samples all ranks have left are laid out again for the new size (collective; the epoch then counts as
re-dealt, like a resume on another number of processes, and its order is in the state).

The loader coordinates its parts, each with its own state and contract: :class:`~.position.ShardPosition` (this
rank's shard of the epoch and how much of it was used), :class:`~.layout.EpochLayout` (how an epoch is ordered),
:class:`~.cursor.PlanCursor` (the micro-batches planned for the rest of the epoch), :class:`~.stats.DrawStats` (what
was drawn since the last log), :class:`~.prefetch.Prefetch` (the workers) and :class:`~.rows.RowLengths` (the
lengths it plans with). The arithmetic (step sizes,
budgets, re-deals) is the pure functions of :mod:`..policies.data_plan`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

from .. import distributed
from ..policies import length as length_policy
from ..policies.balance import DEFAULT_WORK_COEF
from ..policies.data_plan import (before, epoch_steps, micro_batches_to, planned_steps_to_budget, redeal,
                                  redealt_to_draw, step_sizes, steps_in_epoch, steps_to_budget)
from .cursor import PlanCursor
from .interface import BudgetReports
from .layout import EpochLayout
from .planner import plan_micro_batches, plan_passes
from .position import ShardPosition, saved_rests
from .prefetch import Prefetch
from .rows import RowLengths
from .slots import EmptyMicroBatch, group_passes
from .stats import DrawStats


class ElasticDataLoader:
    """Training loader whose per-device batch size can change at any optimizer-step boundary.

    Args:
        dataset: the trainer's training dataset (map-style).
        collate_fn: the host's collate function.
        epoch_order: ``epoch -> list of dataset indices`` of this rank's share of the epoch, in training order.
        batch_size: initial per-device micro-batch size.
        entries_per_step: micro-batches per optimizer step (HF's ``gradient_accumulation_steps``).
        loader_kwargs: extra ``torch.utils.data.DataLoader`` settings (workers, pin memory, prefetch ...).
        lengths: ``() -> tokens of every dataset index``, called once, when a batch plan first needs them: the padded
            tokens a sample costs in a micro-batch (:func:`row_cost`: a DPO pair counts both its rows).
        real_tokens: ``() -> real tokens of every index, or None`` (samples of several rows: the sum of their rows),
            called once after ``lengths``; only for the logged padding. ``None``: the lengths.
        global_order: ``epoch -> every rank's dataset indices in the host's order`` (the same on every rank), for
            balanced steps under several processes; one process: ``epoch_order``.
        work_coef: ``a`` of a row's work ``a x L + L^2`` (:func:`~..policies.balance.work_coefficient`).
        vision: ``() -> each index's vision-tower work in tokens of the pass cost model, or None``, called once, when
            passes are first planned by tokens (``pass_tokens``): the planner prices a pass as the step runner does.

    State (``state_dict``): ``batch_size``, ``num_pieces``, ``entries_per_step``, ``pass_budget``; the shard
    position's (``epoch``, ``position``, ``samples_seen``, ``epoch_size``, ``rest``: this rank's unconsumed samples
    of the epoch, packed, what a resume on another number of processes re-deals; ``padding``, ``redealt``); with a
    batch plan the cursor's (``plan``, ``plan_sizes``, ``plan_steps``, ``plan_passes``) and ``order_plan`` (the plan
    that laid out the current epoch's order).
    """

    state_key = 'integration.data'
    has_length = True

    def __init__(self,
                 dataset: Any,
                 collate_fn: Callable[[list], Any],
                 epoch_order: Callable[[int], Sequence[int]],
                 *,
                 batch_size: int,
                 entries_per_step: int,
                 loader_kwargs: Mapping[str, Any] | None = None,
                 lengths: Callable[[], Sequence[int]] | None = None,
                 real_tokens: Callable[[], Sequence[int] | None] | None = None,
                 global_order: Callable[[int], Sequence[int]] | None = None,
                 work_coef: float = DEFAULT_WORK_COEF,
                 vision: Callable[[], Sequence[int] | None] | None = None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.batch_size = batch_size
        self.entries_per_step = entries_per_step
        self.num_pieces = 1
        self.pass_budget: int | None = None  # a token budget below the plan's pass_tokens (OOMs, memory_backoff)
        #: every rank runs the same number of passes a step (engines whose every pass communicates: FSDP2, DeepSpeed)
        self.equal_passes = False
        self.padding_passes = 0  # the padding passes planned for the rest of the epoch (equal_passes)
        self.loader_kwargs = dict(loader_kwargs or {})
        self.num_workers = int(self.loader_kwargs.get('num_workers', 0))
        self.rows = RowLengths(len(dataset), lengths, real_tokens, vision)
        self.layout = EpochLayout(epoch_order, global_order, self.rows, work_coef=work_coef)
        order = list(epoch_order(0))
        # Under data parallelism the ranks' shards differ by a sample (``rank::world``). Steps are counted on the
        # largest shard (agreed once here), so every rank ends each epoch at the same optimizer step: a rank whose
        # shard is a sample short runs its last step with fewer samples, or as placeholders only (the shard's
        # ``padding`` counts the samples it lacked). Without a batch plan; a plan agrees its own step counts.
        self.shard = ShardPosition(order, max(distributed.gather_objects(len(order))))
        self.cursor = PlanCursor()
        self.stats = DrawStats()
        #: the spreads of the step drawn last (balanced steps), read by the integration's metrics
        self.step_spread: tuple[float, float] | None = None
        self.prefetch = Prefetch(dataset, collate_fn, self.rest_batches, self.loader_kwargs)

    # ---- what HF and callbacks see -------------------------------------------------------------------
    def __len__(self) -> int:
        raise TypeError('ElasticDataLoader has no fixed length: the batch size may change inside an epoch')

    def __iter__(self) -> Iterator[Any]:
        """A read-only preview of the rest of the epoch at the current batch size (does not move the position).

        The HF loop creates this iterator every epoch but never reads it: the integration's
        ``get_batch_samples`` draws from :meth:`next_step`. Code that inspects the loader (token counting)
        gets real batches.
        """
        order, start, sizes = self.rest_batches()
        for size in sizes:
            yield self.collate_fn([self.dataset[i] for i in order[start:start + size]])
            start += size

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the data epoch is counted here (HF's epoch counter restarts at 0 after a resume)."""

    def rest_batches(self) -> tuple[list[int], int, list[int]]:
        """``(order, start, sizes)``: the rest of the epoch as it would be drawn now, the micro-batches of ``sizes``
        samples of ``order`` from ``start`` (a copy: later changes do not touch it)."""
        order, start = list(self.shard.order), self.shard.position
        if self.plan is not None:  # padding passes (0 rows) draw nothing
            return order, start, [size for size in self.cursor.sizes if size]
        steps = epoch_steps(len(order) - start, self.batch_size, self.entries_per_step)
        return order, start, [size for sizes in steps for size in sizes if size]

    # ---- position ----------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.shard.epoch

    @property
    def position(self) -> int:
        """Samples of this rank's shard of the epoch consumed."""
        return self.shard.position

    @property
    def samples_seen(self) -> int:
        return self.shard.samples_seen

    @property
    def redealt(self) -> dict[str, int] | None:
        """The current epoch's rest was dealt again (:class:`~.position.ShardPosition`); None otherwise."""
        return self.shard.redealt

    @property
    def epoch_size(self) -> int:
        """Samples of a whole epoch as steps count them: the largest rank's shard (this rank's own without peers)."""
        return self.shard.full_span if self.plan is None else self.shard.full_len

    @property
    def remaining(self) -> int:
        return self.shard.remaining

    @property
    def epoch_complete(self) -> bool:
        if self.plan is not None:
            return self.shard.used_up(planned=True) and self.cursor.steps <= 0
        return self.shard.used_up(planned=False)

    @property
    def epoch_progress(self) -> float:
        """Data epochs done, fractional (``epoch + position / epoch_size``; the same on every rank)."""
        return self.epoch + self.coverage

    @property
    def coverage(self) -> float:
        """The fraction of the current epoch's data used (a re-dealt epoch counts what was used before it)."""
        return self.shard.coverage(self.plan is not None, self.epoch_complete, len(self.dataset))

    def skip_to(self, consumed: int) -> None:
        """Resume by HF's arithmetic (a checkpoint without the pack's state): ``consumed`` samples, at a constant
        batch size, are behind. An active plan is planned again from the new position."""
        epoch, position = divmod(consumed, max(self.epoch_size, 1))
        if epoch:  # straight to the epoch it is in: the epochs before it are neither laid out nor planned
            self._enter_epoch(self.epoch + epoch)
        self.shard.skip_to(position, consumed)
        self._replan()
        self._restart()

    def start_next_epoch(self) -> None:
        self._enter_epoch(self.epoch + 1)
        self._replan()
        self._restart()

    def _enter_epoch(self, epoch: int) -> None:
        self.shard.start_epoch(epoch, self.layout.lay_out(epoch, self.plan, self.batch_size, self.entries_per_step))
        self.prefetch.new_epoch()

    def set_batch_size(self, batch_size: int) -> None:
        if batch_size != self.batch_size:
            self.batch_size = batch_size
            self._relayout()
            self._replan()
            self._restart()

    def set_entries_per_step(self, entries: int) -> None:
        if entries != self.entries_per_step:
            self.entries_per_step = entries
            self._relayout()
            self._replan()
            self._restart()

    def _relayout(self) -> None:
        """Balanced steps after a change of the global batch: lay the epoch (at its start) or the samples every rank
        has left (inside it: collective, the epoch counts as re-dealt) out again for the new size."""
        if not self.layout.balanced:
            return
        # every data rank's (a sequence-parallel group once), on every rank, so every rank takes the same branch
        positions = distributed.gather_data_objects(self.position)
        if self.redealt is None and not any(positions):
            self.shard.order = self.layout.lay_out(self.epoch, self.layout.plan, self.batch_size,
                                                   self.entries_per_step)
            return
        rests = distributed.gather_data_objects(self.shard.rest)
        consumed = int((self.redealt or {}).get('consumed', 0)) + sum(positions)
        merged = redeal(rests, 1)[0]  # the order in which the ranks would have drawn them
        self._take_balanced(merged, self.layout.plan, consumed, distributed.data_rank(), distributed.data_world())

    def _take_balanced(self, merged: list[int], plan: length_policy.BatchPlan, consumed: int, rank: int,
                       world: int) -> None:
        """The rest of the epoch is rank ``rank``'s share of ``merged`` (every rank's samples left) laid out in
        balanced steps at the current size over ``world`` processes; the epoch counts as re-dealt over them."""
        share, spreads = self.layout.balanced_share(merged, self.epoch, plan, self.batch_size, self.entries_per_step,
                                                    salt=consumed, rank=rank, world=world)
        self.layout.set_current(plan, None, spreads)
        self.shard.take_share(share, consumed=consumed, dealt=len(merged), world=world)

    # ---- length-aware batching ---------------------------------------------------------------------------
    @property
    def plan(self) -> length_policy.BatchPlan | None:
        """The batch plan the rest of the epoch is cut by (None: equal micro-batches of ``batch_size``)."""
        return self.cursor.plan

    @property
    def order_bucketed(self) -> bool:
        """Whether the current epoch's order was laid out by a plan (bucketing or balanced steps)."""
        return self.layout.bucketed

    @property
    def balanced_steps(self) -> bool:
        """Whether the current epoch is laid out in balanced global steps."""
        return self.layout.balanced

    @property
    def cuts_passes(self) -> bool:
        """Whether each step's share is cut into passes by a token budget here (``pass_tokens``)."""
        return self.cursor.cuts_passes

    @property
    def pass_pieces(self) -> int:
        """The pieces the step runner cuts each drawn micro-batch into at least: ``num_pieces``, or 1 when the
        passes were cut here (``num_pieces`` then capped the rows of a pass)."""
        return 1 if self.cuts_passes else self.num_pieces

    def set_num_pieces(self, num_pieces: int) -> None:
        """The pieces a micro-batch of the per-device size runs in; passes cut here take at most
        ``ceil(batch_size / num_pieces)`` rows from the next step on (collective in that case)."""
        if num_pieces != self.num_pieces:
            self.num_pieces = num_pieces
            if self.cuts_passes:
                self._replan()
                self._restart()

    def set_pass_budget(self, tokens: int | None) -> bool:
        """Cut the passes of the steps from the next one on within ``tokens`` when that is below the plan's
        ``pass_tokens`` (``None``: the plan's); returns whether the passes were planned again. Collective when they
        are (every rank calls it at the same step boundary with the same budget)."""
        if tokens == self.pass_budget:
            return False
        self.pass_budget = tokens
        if not self.cuts_passes:
            return False
        self._replan()
        self._restart()
        return True

    @property
    def pass_tokens(self) -> int | None:
        """The token budget passes are planned at now: the plan's ``pass_tokens`` or the lower ``pass_budget``
        (``None``: passes are not cut by tokens)."""
        if not self.cuts_passes:
            return None
        budget = self.plan.pass_tokens
        return budget if self.pass_budget is None else min(budget, self.pass_budget)

    @property
    def lengths(self) -> list[int]:
        """Tokens of every dataset index (computed once, by the ``lengths`` callable)."""
        return self.rows.costs

    @property
    def real_tokens(self) -> list[int]:
        """Real tokens of every dataset index (the lengths, unless a sample is several rows)."""
        return self.rows.real

    @property
    def lengths_estimated(self) -> bool:
        """The lengths are estimates (a lazy dataset): each drawn row's real cost replaces its estimate."""
        return self.rows.estimated

    @lengths_estimated.setter
    def lengths_estimated(self, value: bool) -> None:
        self.rows.estimated = bool(value)

    def set_plan(self, plan: length_policy.BatchPlan) -> bool:
        """Use ``plan`` from now on; returns False when it is the current plan already.

        At the start of an epoch the epoch is laid out again (bucketing); later in an epoch the rest of the current
        order keeps its place and is cut by the new plan, and bucketing starts with the next epoch. Collective
        under data parallelism (every rank calls it at the same step boundary).
        """
        if plan == self.plan:
            return False
        self.lengths  # noqa: B018  (fail here, not in the middle of a step, when lengths are unavailable)
        self.cursor.plan = plan
        if self.position == 0 and self.redealt is None:
            self.shard.order = self.layout.lay_out(self.epoch, plan, self.batch_size, self.entries_per_step)
        self._replan()
        self._restart()
        return True

    def _plan_rest(self) -> list[int]:
        return self.layout.sizes(self.plan, self.shard.order, self.position, self.layout.chunks, self.batch_size,
                                 self.entries_per_step)

    def _replan(self) -> None:
        """Plan the rest of the epoch (:mod:`.planner`: agreed with the other ranks) and hand it to the cursor."""
        if self.plan is None:
            return
        if self.cuts_passes:
            lengths, vision = self.lengths, self.rows.vision
            max_rows = -(-self.batch_size // self.num_pieces) if self.num_pieces > 1 else None
            rest = self.shard.rest if self.remaining else []
            planned = plan_passes([lengths[i] for i in rest], self.batch_size * self.entries_per_step,
                                  self.pass_tokens, padding_free=self.plan.padding_free, max_rows=max_rows,
                                  equal_passes=self.equal_passes, vision=[vision[i] for i in rest] if vision else None)
            self.padding_passes = planned.padding
        else:
            planned = plan_micro_batches(self._plan_rest(), self.remaining, self.entries_per_step,
                                         balanced=self.plan.balanced)
        self.cursor.set(planned.sizes, planned.steps, planned.passes)

    def steps_to_budget(self, budget_epochs: float) -> int:
        """Optimizer steps still needed to use ``budget_epochs`` epochs of data (at the current batch size/plan).

        Without a plan :func:`~..policies.data_plan.steps_to_budget`; with one
        :func:`~..policies.data_plan.planned_steps_to_budget`, fed the planned sizes of the rest of this epoch and
        later epochs laid out and planned as they will be (without the cross-rank split, which may add a step under
        data parallelism): the most any rank needs (collective: every rank calls it at the same boundary). Inside a
        re-dealt epoch its rest counts first (:func:`~..policies.data_plan.redealt_to_draw`).
        """
        shard, batch, entries = self.shard, self.batch_size, self.entries_per_step
        redealt = shard.redealt
        if self.plan is None:
            if redealt is None:
                return steps_to_budget(shard.epoch, shard.position + shard.padding, self.epoch_size, budget_epochs,
                                       batch, entries)
            draw = redealt_to_draw(budget_epochs, shard.epoch, len(self.dataset), redealt['consumed'],
                                   redealt['dealt'], shard.span, shard.position + shard.padding)
            steps = steps_in_epoch(draw, batch, entries)
            if before(budget_epochs, shard.epoch + 1):
                return steps
            return steps + steps_to_budget(shard.epoch + 1, 0, self.epoch_size, budget_epochs, batch, entries)
        epoch_size = max(self.epoch_size, 1)
        sizes = self.budget_sizes()
        if redealt is None:
            steps = planned_steps_to_budget(shard.epoch, shard.position, epoch_size, budget_epochs, entries, sizes,
                                            self._epoch_sizes)
        else:  # the rest of the re-dealt epoch, then whole epochs
            draw = redealt_to_draw(budget_epochs, shard.epoch, len(self.dataset), redealt['consumed'],
                                   redealt['dealt'], len(shard.order), shard.position)
            steps = length_policy.steps_for(micro_batches_to(sizes, draw), entries)
            if not before(budget_epochs, shard.epoch + 1):
                steps += planned_steps_to_budget(shard.epoch, epoch_size, epoch_size, budget_epochs, entries, [],
                                                 self._epoch_sizes)
        return max(distributed.gather_objects(steps))  # the ranks' plans differ: the most any rank needs

    def _epoch_sizes(self, epoch: int) -> list[int]:
        """The micro-batch sizes of ``epoch`` from its start, laid out and planned by the current plan."""
        plan = self.plan
        order, chunks, _ = self.layout.order(epoch, plan if plan.lays_out else None, self.batch_size,
                                             self.entries_per_step)
        return self.layout.sizes(plan, order, 0, chunks, self.batch_size, self.entries_per_step)

    def budget_sizes(self) -> list[int]:
        """The micro-batch sizes the rest of the epoch counts as for the step budget (:class:`~.cursor.PlanCursor`)."""
        return self.cursor.budget_sizes(self.remaining, self.batch_size, self.entries_per_step)

    def over_budget(self) -> list[int]:
        """Dataset indices of this rank's epoch longer than the plan's ``max_tokens`` (each runs alone)."""
        if self.plan is None:
            return []
        lengths, order = self.lengths, self.shard.order
        return [order[k] for k in length_policy.over_budget((lengths[i] for i in order), self.plan)]

    def planned_padding(self) -> tuple[int, int, int]:
        """``(real, padded, micro_batches)`` of the rest of the epoch as planned."""
        lengths, order, start, batches = self.lengths, self.shard.order, self.position, []
        for size in self.cursor.sizes:
            batches.append([lengths[i] for i in order[start:start + size]])
            start += size
        _, padded = length_policy.padding(batches)
        real_tokens = self.real_tokens
        real = sum(real_tokens[i] for i in order[self.position:start])
        return real, real if self.plan.padding_free else padded, len(batches)

    def planned_spread(self) -> dict[str, float]:
        """Balanced steps: the mean rank work spread of the current layout's steps, and of the host-order deal of
        the same samples (empty otherwise)."""
        return self.layout.planned_spread()

    def take_spread_stats(self) -> tuple[float, float, int]:
        """``(sum of spreads, sum of unbalanced spreads, steps)`` of the balanced steps drawn since the last call."""
        return self.stats.take_spread_stats()

    def take_reports(self) -> BudgetReports:
        """The micro-batches drawn over the budget because length estimates were low, since the last call."""
        return self.stats.take_reports()

    def take_token_stats(self) -> tuple[int, int, int]:
        """``(real, padded, micro_batches)`` drawn since the last call (with a plan), and reset them."""
        return self.stats.take_token_stats()

    def _restart(self) -> None:
        """Drop what the workers prefetched; the next draw starts at ``position``, as planned then."""
        self.prefetch.restart()

    def close(self) -> None:
        """Shut the workers down now (persistent workers otherwise live until the loader is freed)."""
        self.prefetch.close()

    # ---- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {'batch_size': self.batch_size, 'num_pieces': self.num_pieces, 'pass_budget': self.pass_budget,
                 'entries_per_step': self.entries_per_step, **self.shard.state_dict(), **self.cursor.state_dict()}
        if self.plan is not None:
            state['order_plan'] = self.layout.plan.to_json() if self.layout.plan is not None else None
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get('redealt'):  # the epoch's order came from a re-deal: only the saved rest tells it
            self.resume_from_rests([state], rank=0, world=1)
            return
        order_plan = length_policy.BatchPlan.from_json(state['order_plan']) if state.get('order_plan') else None
        # balanced steps lay an epoch out for the batch it ran at (a change inside an epoch re-deals it)
        self.batch_size = int(state['batch_size'])
        self.entries_per_step = int(state.get('entries_per_step', self.entries_per_step))
        order = self.layout.lay_out(int(state['epoch']), order_plan, self.batch_size, self.entries_per_step)
        self.shard.load(state, order)
        self.cursor.load(state, self.remaining, self.entries_per_step)
        self.num_pieces = int(state.get('num_pieces', 1))
        self.pass_budget = state.get('pass_budget')
        self.prefetch.new_epoch()
        self._restart()

    def resume_from_rests(self, states: Sequence[Mapping[str, Any]], *, rank: int, world: int,
                          batch_size: int | None = None) -> dict[str, Any]:
        """Resume as rank ``rank`` of ``world`` from the loader states of every rank of the saved run.

        On another number of processes the samples the saved ranks left in the epoch are re-dealt
        (:func:`~..policies.data_plan.redeal`), laid out by the epoch's bucketing again and planned again at
        ``batch_size`` (default: the saved one). On the same number (an epoch that was re-dealt before, whose order
        only the saved rests tell) each rank continues with its own rest and its planned micro-batches. Returns what
        was dealt (for the decision record).

        Raises:
            StateError: a state without its rest (written before elastic resume), or one that does not fit the dataset.
        """
        saved = saved_rests(states, len(self.dataset))
        same_world = len(states) == world
        own = states[rank] if same_world else states[0]
        order_plan = length_policy.BatchPlan.from_json(own['order_plan']) if own.get('order_plan') else None
        self.batch_size = int(batch_size if batch_size is not None else own['batch_size'])
        self.shard.epoch = saved.epoch
        if same_world:
            share = saved.rests[rank]
            self.layout.set_current(order_plan)
            self.shard.take_share(share, consumed=saved.consumed, dealt=saved.left, world=world)
        elif order_plan is not None and order_plan.balanced:  # balanced steps for the new world
            self._take_balanced(redeal(saved.rests, 1)[0], order_plan, saved.consumed, rank, world)
        else:
            share, chunks = redeal(saved.rests, world)[rank], None
            if order_plan is not None and order_plan.bucketing:
                share, chunks = length_policy.epoch_layout(share, self.lengths, order_plan, saved.epoch)
            self.layout.set_current(order_plan, chunks)
            self.shard.take_share(share, consumed=saved.consumed, dealt=saved.left, world=world)
        self.num_pieces = int(own.get('num_pieces', 1))
        self.pass_budget = own.get('pass_budget')
        seen = [int(s.get('samples_seen', 0)) for s in states]
        self.shard.samples_seen = seen[rank] if same_world else (sum(seen) if rank == 0 else 0)
        saved_entries = int(own.get('entries_per_step', self.entries_per_step))
        unchanged = (self.batch_size, self.entries_per_step) == (int(own['batch_size']), saved_entries)
        plan = own.get('plan')
        if same_world and plan and unchanged:
            self.cursor.load(own, self.remaining, self.entries_per_step)
        else:
            self.cursor.plan = length_policy.BatchPlan.from_json(plan) if plan else None
            self._replan()
        self.prefetch.new_epoch()
        self._restart()
        return {'epoch': saved.epoch, 'consumed_in_epoch': saved.consumed, 'left_in_epoch': saved.left,
                'share': self.remaining}

    # ---- drawing -----------------------------------------------------------------------------------
    def next_step(self, entries: int) -> list[tuple[list[int], Any]]:
        """Draw the micro-batches of one optimizer step: ``entries`` pairs ``(indices, batch)``.

        Pairs whose size is 0 (short last step of an epoch) are ``([], EmptyMicroBatch())``; passes cut here come
        grouped into HF's slots (:func:`~.slots.group_passes`). The epoch must not be complete (call
        :meth:`start_next_epoch` first).
        """
        if self.epoch_complete:
            raise RuntimeError('next_step() called on a complete epoch; call start_next_epoch() first')
        self.set_entries_per_step(entries)
        self.prefetch.start()
        planned = self.plan is not None
        slots = None
        if planned:
            sizes, slots = self.cursor.next_step(entries)
            self.step_spread = self.layout.step_spread(self.position // max(self.batch_size * entries, 1))
            if self.step_spread is not None:
                self.stats.count_step_spread(self.step_spread)
        else:
            sizes = step_sizes(self.remaining, self.batch_size, entries)
            # the samples the largest shard takes in this step; a shorter shard lacks at most one of them
            self.shard.pad(self.batch_size * entries, sum(sizes))
        out: list[tuple[list[int], Any]] = []
        for size in sizes:
            if size == 0:
                out.append(([], EmptyMicroBatch()))
                continue
            out.append(self._draw(size, planned))
        if planned:
            self.cursor.advance(entries)
        if self.epoch_complete:
            self.prefetch.restart()
        return out if slots is None else group_passes(out, slots)

    def _draw(self, size: int, planned: bool) -> tuple[list[int], Any]:
        """The next micro-batch of ``size`` samples from the workers, checked against the shard's order."""
        indices, batch, costs = self.prefetch.next()
        expected = self.shard.upcoming(size)
        if list(indices) != expected:
            raise RuntimeError(f'elastic loader out of step: drew indices {indices[:8]}... but the plan expected '
                               f'{expected[:8]}... (epoch {self.epoch}, position {self.position})')
        self.shard.advance(size)
        if planned:
            if self.rows.estimated:
                self.rows.refine(indices, costs)
                self._note_over_estimate(indices, costs)
            lengths = [self.lengths[i] for i in indices]
            real = sum(self.real_tokens[i] for i in indices)
            self.stats.count_batch(real, real if self.plan.padding_free else len(lengths) * max(lengths))
        return list(indices), batch

    def _note_over_estimate(self, indices: list[int], costs: list[int | None]) -> None:
        """A token-budget micro-batch whose real padded tokens exceed the budget (the estimates were low)."""
        known = [c for c in costs if c is not None]
        if known and self.plan.length_mode.sizes_by_tokens and len(indices) > 1:
            padded = len(indices) * max(known)
            if padded > self.plan.max_tokens:
                self.stats.over_estimates.append({'indices': list(indices), 'padded': padded})

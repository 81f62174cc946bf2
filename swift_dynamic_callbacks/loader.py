"""The elastic training loader: exactly-once epochs at a batch size that may change between optimizer steps.

:class:`ElasticDataLoader` owns the position in the data, counted in samples (``epoch``, ``position`` in this
rank's shard of the epoch order). For each optimizer step the integration calls :meth:`next_step`, which
cuts the next samples of the epoch order into micro-batches (``policies.data_plan``) and returns them
collated, each with the dataset indices it holds. Only consumed samples move the position, so a change of
batch size, a restart of the workers or a resume never drops or repeats a sample.

Under the hood one torch ``DataLoader`` (the host's collate function, workers, pin-memory and prefetch
settings) runs over a batch sampler that reads the current plan whenever an iterator is created. Workers
prefetch ahead; when the batch size changes, the iterator is recreated from the current position and
prefetched batches of the old size are discarded (never trained on), so a change is never delayed.

HF sees this object as ``train_dataloader``. It deliberately has no length: the number of steps in an
epoch depends on batch sizes chosen while it runs, so the integration makes HF take its ``max_steps`` path
and ends each epoch itself (``control.should_epoch_stop``).

Length-aware batching (:meth:`ElasticDataLoader.set_plan`, a :class:`~.policies.length.BatchPlan`): the epoch order
may be laid out in shuffled chunks of similar length, and the rest of the epoch is planned as a list of micro-batch
sizes decided from the samples' lengths (token budget or rules, at most ``batch_size`` samples each) before any of
them is collated. The plan is made again (from the current position) at every epoch start, batch-size change and
plan change; under data parallelism the ranks then agree on the number of optimizer steps left in the epoch
(:func:`~.policies.length.agreed_steps`) and a rank with fewer splits its largest micro-batches
(:func:`~.policies.length.equalize_steps`), so no rank waits in an all-reduce for another. The remaining sizes are
part of the state, so a resume continues with exactly the micro-batches the interrupted run would have drawn.

Balanced global steps (a plan with ``mode: balanced``, :mod:`.policies.balance`): every rank lays the whole epoch
(all ranks' samples, ``global_order``) out the same way and takes its share, so each optimizer step holds exactly the
global batch, of samples of similar length, dealt so the ranks' work is even. When the batch size changes inside an
epoch, the samples all ranks have left are laid out again for the new size (collective; the epoch then counts as
re-dealt, like a resume on another number of processes, and its order is in the state).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from . import distributed
from .policies import length as length_policy
from .policies.balance import DEFAULT_WORK_COEF, balanced_layout, pass_slots, rank_sizes, step_passes
from .policies.data_plan import epoch_steps, redeal, step_sizes
from .loader_budget import LoaderBudget
from .loader_state import LoaderState
from .rows import item_lengths, row_cost
from .slots import EmptyMicroBatch, group_passes
from .train_loader import BudgetReports


class _IndexedDataset(Dataset):

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]


class _IndexedCollate:

    def __init__(self, collate_fn: Callable[[list], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[tuple[int, Any]]) -> tuple[list[int], Any, list[int | None]]:
        costs = []
        for i, x in items:  # the real costs of the encoded rows (they refine estimated lengths)
            try:
                costs.append(row_cost(item_lengths(x, i)))
            except (ValueError, TypeError):
                costs.append(None)
        return [i for i, _ in items], self.collate_fn([x for _, x in items]), costs


class _PlannedBatchSampler:
    """Yields the index lists of the rest of the epoch, as planned at the moment ``iter()`` is called."""

    def __init__(self, loader: 'ElasticDataLoader') -> None:
        # a proxy, not a reference: a cycle would leave the workers to the cyclic GC, after their queues closed
        self.loader = weakref.proxy(loader)

    def __iter__(self) -> Iterator[list[int]]:
        if self.loader.plan is not None:  # a snapshot now: the plan of the rest of the epoch
            return self._planned(self.loader._order, self.loader.position, list(self.loader._sizes))
        return self._even()

    @staticmethod
    def _planned(order: list[int], start: int, sizes: list[int]) -> Iterator[list[int]]:
        for size in sizes:
            yield order[start:start + size]
            start += size

    def _even(self) -> Iterator[list[int]]:
        order, start = self.loader._order, self.loader.position
        batch_size, entries = self.loader.batch_size, self.loader.entries_per_step
        for sizes in epoch_steps(len(order) - start, batch_size, entries):
            for size in sizes:
                if size:
                    yield order[start:start + size]
                    start += size

    def __len__(self) -> int:
        if self.loader.plan is not None:
            return len(self.loader._sizes)
        remaining = len(self.loader._order) - self.loader.position
        return sum(1 for sizes in epoch_steps(remaining, self.loader.batch_size, self.loader.entries_per_step)
                   for s in sizes if s)


class ElasticDataLoader(LoaderState, LoaderBudget):
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
        work_coef: ``a`` of a row's work ``a x L + L^2`` (:func:`~.policies.balance.work_coefficient`).

    State (``state_dict``): ``epoch``, ``position`` (samples of this rank's epoch shard consumed),
    ``batch_size``, ``num_pieces``, ``entries_per_step``, ``samples_seen`` (this rank, all epochs), ``rest`` (this
    rank's unconsumed samples of the epoch, packed: what a resume on another number of processes re-deals); with a
    batch plan also ``plan``, ``order_plan`` (the plan that laid out the current epoch's order) and ``plan_sizes``
    (the micro-batch sizes left in the epoch, run-length encoded); after such a re-deal, ``redealt`` (the epoch's
    samples consumed before it, how many it dealt, over how many processes).
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
                 work_coef: float = DEFAULT_WORK_COEF) -> None:
        self.dataset = dataset
        self._global_order = global_order
        self.work_coef = float(work_coef)
        #: balanced steps: per step of the current layout, (rank work spread, spread of the host-order deal)
        self._spreads: list[tuple[float, float]] = []
        #: the spreads of the step drawn last (balanced steps), read by the integration's metrics
        self.step_spread: tuple[float, float] | None = None
        self.collate_fn = collate_fn
        self._epoch_order = epoch_order
        self.batch_size = batch_size
        self.entries_per_step = entries_per_step
        self.num_pieces = 1
        self.epoch = 0
        self.position = 0
        self.samples_seen = 0
        self.loader_kwargs = dict(loader_kwargs or {})
        self.num_workers = int(self.loader_kwargs.get('num_workers', 0))
        self._order: list[int] = list(epoch_order(0))
        # Under data parallelism the ranks' shards differ by a sample (``rank::world``). Steps are counted on the
        # largest shard (``span``, agreed once here), so every rank ends each epoch at the same optimizer step: a
        # rank whose shard is a sample short runs its last step with fewer samples, or as placeholders only
        # (``padding`` counts the samples it lacked). Without a batch plan; a plan agrees its own step counts.
        self._span = max(distributed.gather_objects(len(self._order)))
        self._full_span, self._full_len = self._span, len(self._order)  # of an epoch that was not re-dealt
        self._padding = 0
        #: the current epoch was re-dealt at a resume on another number of processes (:meth:`resume_from_rests`):
        #: ``consumed`` (samples of the epoch before it, all ranks), ``dealt`` (samples it dealt), ``world``
        self.redealt: dict[str, int] | None = None
        self._lengths_fn = lengths
        self._lengths: list[int] | None = None
        self._real_fn = real_tokens
        self._real: list[int] | None = None
        #: the lengths are estimates (a lazy dataset): each drawn row's real cost replaces its estimate
        self.lengths_estimated = False
        #: micro-batches drawn whose real padded tokens exceed the budget (estimates were low), taken by the integration
        self.over_estimates: list[dict[str, Any]] = []
        self.plan: length_policy.BatchPlan | None = None
        self._order_plan: length_policy.BatchPlan | None = None  # the plan that laid out this epoch's order
        self._chunks: list[int] | None = None  # chunk sizes of this epoch's bucketed order
        self._sizes: list[int] = []  # planned micro-batch sizes left in the epoch (with a plan; passes: pass sizes)
        self._passes: list[int] = []  # passes of each step left in the epoch (a plan that cuts passes)
        self._plan_steps = 0  # optimizer steps left in the epoch, agreed by all ranks (with a plan)
        self.token_stats = [0, 0, 0]  # real tokens, padded tokens, micro-batches drawn since the last read
        self.spread_stats = [0.0, 0.0, 0]  # balanced steps: spread, unbalanced spread, steps since the last read
        self._sampler = _PlannedBatchSampler(self)
        # Every DataLoader iterator draws its base seed from a generator. A plain loader draws it from the global
        # torch RNG once per epoch (when the epoch's iterator starts); this one restarts its iterator on every
        # batch change, so it draws from its own generator, seeded by one global draw per epoch. The global RNG
        # (dropout masks) then advances exactly as in a plain run, and a resume (which restores the global RNG
        # after the first draw) matches an uninterrupted run.
        self._generator = torch.Generator()
        self._needs_epoch_seed = True
        self._loader = DataLoader(
            _IndexedDataset(dataset),
            batch_sampler=self._sampler,
            collate_fn=_IndexedCollate(collate_fn),
            generator=self._generator,
            **self.loader_kwargs)
        self._iterator: Iterator | None = None

    # ---- what HF and callbacks see -------------------------------------------------------------------
    def __len__(self) -> int:
        raise TypeError('ElasticDataLoader has no fixed length: the batch size may change inside an epoch')

    def __iter__(self) -> Iterator[Any]:
        """A read-only preview of the rest of the epoch at the current batch size (does not move the position).

        The HF loop creates this iterator every epoch but never reads it: the integration's
        ``get_batch_samples`` draws from :meth:`next_step`. Code that inspects the loader (token counting)
        gets real batches.
        """
        order, start = list(self._order), self.position
        if self.plan is not None:
            for size in list(self._sizes):
                yield self.collate_fn([self.dataset[i] for i in order[start:start + size]])
                start += size
            return
        for sizes in epoch_steps(len(order) - start, self.batch_size, self.entries_per_step):
            for size in sizes:
                if size:
                    yield self.collate_fn([self.dataset[i] for i in order[start:start + size]])
                    start += size

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the data epoch is counted here (HF's epoch counter restarts at 0 after a resume)."""

    # ---- position ----------------------------------------------------------------------------------
    @property
    def epoch_size(self) -> int:
        """Samples of a whole epoch as steps count them: the largest rank's shard (this rank's own without peers)."""
        return self._full_span if self.plan is None else self._full_len

    @property
    def remaining(self) -> int:
        return len(self._order) - self.position

    @property
    def epoch_complete(self) -> bool:
        if self.plan is not None:
            return self.position >= len(self._order) and self._plan_steps <= 0
        return self.position >= len(self._order) and self.position + self._padding >= self._span

    @property
    def epoch_progress(self) -> float:
        """Data epochs done, fractional (``epoch + position / epoch_size``; the same on every rank)."""
        return self.epoch + self.coverage

    @property
    def coverage(self) -> float:
        """The fraction of the current epoch's data used (a re-dealt epoch counts what was used before it)."""
        if self.plan is None:
            done = (self.position + self._padding) / self._span if self._span else 1.0
        elif self.epoch_complete or not self._order:
            done = 1.0
        else:
            done = min(self.position / len(self._order), 1.0 - 1e-6)  # not done while steps are left
        if self.redealt is None:
            return done
        total = max(len(self.dataset), 1)
        covered = (self.redealt['consumed'] + done * self.redealt['dealt']) / total
        return covered if done >= 1.0 else min(covered, 1.0 - 1e-6)

    def skip_to(self, consumed: int) -> None:
        """Resume by HF's arithmetic (a checkpoint without the pack's state): ``consumed`` samples, at a constant
        batch size, are behind."""
        epoch, position = divmod(consumed, max(self.epoch_size, 1))
        for _ in range(epoch):
            self.start_next_epoch()
        self.position, self.samples_seen = position, consumed

    def start_next_epoch(self) -> None:
        self.epoch += 1
        self.position = self._padding = 0
        self._span, self.redealt = self._full_span, None
        self._order_plan = self.plan if self.plan is not None and self.plan.lays_out else None
        self._order, self._chunks = self._layout(self.epoch, self._order_plan, keep=True)
        self._needs_epoch_seed = True
        self._replan()
        self._restart()

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
        if self._order_plan is None or not self._order_plan.balanced:
            return
        positions = distributed.gather_objects(self.position)  # every rank, so every rank takes the same branch
        if self.redealt is None and not any(positions):
            self._order, self._chunks = self._layout(self.epoch, self._order_plan, keep=True)
            return
        rests = distributed.gather_objects(self._order[self.position:])
        consumed = int((self.redealt or {}).get('consumed', 0)) + sum(positions)
        merged = redeal(rests, 1)[0]  # the order in which the ranks would have drawn them
        self._chunks = None
        self._take_share(self._balanced(merged, self.epoch, salt=consumed, keep=True), consumed=consumed,
                         dealt=len(merged), world=distributed.world_size())

    # ---- length-aware batching ---------------------------------------------------------------------------
    @property
    def order_bucketed(self) -> bool:
        """Whether the current epoch's order was laid out by a plan (bucketing or balanced steps)."""
        return self._order_plan is not None

    @property
    def balanced_steps(self) -> bool:
        """Whether the current epoch is laid out in balanced global steps."""
        return self._order_plan is not None and self._order_plan.balanced

    @property
    def cuts_passes(self) -> bool:
        """Whether each step's share is cut into passes by a token budget here (``pass_tokens``)."""
        return self.plan is not None and self.plan.cuts_passes

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

    @property
    def lengths(self) -> list[int]:
        """Tokens of every dataset index (computed once, by the ``lengths`` callable)."""
        if self._lengths is None:
            if self._lengths_fn is None:
                raise ValueError('a batch plan needs the samples\' lengths, but this loader was built without them')
            lengths = [int(x) for x in self._lengths_fn()]
            if len(lengths) != len(self.dataset):
                raise ValueError(f'got {len(lengths)} lengths for a dataset of {len(self.dataset)} samples')
            self._lengths = lengths
            real = self._real_fn() if self._real_fn is not None else None
            self._real = [int(x) for x in real] if real is not None else lengths
        return self._lengths

    @property
    def real_tokens(self) -> list[int]:
        """Real tokens of every dataset index (the lengths, unless a sample is several rows)."""
        self.lengths  # noqa: B018
        return self._real if self._real is not None else self._lengths

    def set_plan(self, plan: length_policy.BatchPlan) -> bool:
        """Use ``plan`` from now on; returns False when it is the current plan already.

        At the start of an epoch the epoch is laid out again (bucketing); later in an epoch the rest of the current
        order keeps its place and is cut by the new plan, and bucketing starts with the next epoch. Collective
        under data parallelism (every rank calls it at the same step boundary).
        """
        if plan == self.plan:
            return False
        self.lengths  # noqa: B018  (fail here, not in the middle of a step, when lengths are unavailable)
        self.plan = plan
        if self.position == 0 and self.redealt is None:
            self._order_plan = plan if plan.lays_out else None
            self._order, self._chunks = self._layout(self.epoch, self._order_plan, keep=True)
        self._replan()
        self._restart()
        return True

    def _layout(self, epoch: int, plan: length_policy.BatchPlan | None, *,
                keep: bool = False) -> tuple[list[int], list[int] | None]:
        """This rank's order of ``epoch`` and its chunks; ``keep``: it becomes the current layout (balanced steps
        keep their spreads)."""
        if plan is not None and plan.balanced:
            order = self._global_order or (self._epoch_order if distributed.world_size() == 1 else None)
            if order is None:
                raise ValueError('balanced steps under several processes need the epoch order of every rank '
                                 '(global_order); this loader was built without it')
            return self._balanced(list(order(epoch)), epoch, plan=plan, keep=keep), None
        base = list(self._epoch_order(epoch))
        if plan is None or not plan.bucketing:
            return base, None
        return length_policy.epoch_layout(base, self.lengths, plan, epoch)

    def _balanced(self, order: list[int], epoch: int, *, plan: length_policy.BatchPlan | None = None, salt: int = 0,
                  keep: bool) -> list[int]:
        """This rank's share of ``order`` (all ranks' samples) laid out in balanced steps at the current size."""
        plan = plan or self._order_plan
        layout = balanced_layout(order, self.lengths, world=distributed.world_size(), batch=self.batch_size,
                                 entries=self.entries_per_step, seed=plan.seed + salt, epoch=epoch,
                                 jitter=plan.bucket_width, coef=self.work_coef, padding_free=plan.padding_free)
        if keep:
            self._spreads = list(zip(layout.spread, layout.unbalanced))
        return layout.shares[distributed.rank()]

    def _sizes_for(self, order: Sequence[int], start: int, chunks: Sequence[int] | None) -> list[int]:
        """The plan's micro-batch sizes of ``order`` from ``start``."""
        if self.plan.balanced:
            return rank_sizes(len(order) - start, self.batch_size, self.entries_per_step)
        lengths = self.lengths
        return length_policy.plan_sizes([lengths[i] for i in order], start, chunks, self.plan, self.batch_size)

    def _plan_rest(self) -> list[int]:
        return self._sizes_for(self._order, self.position, self._chunks)

    def _replan(self) -> None:
        """Plan the rest of the epoch's micro-batches; under data parallelism agree on its optimizer steps."""
        if self.plan is None:
            return
        if self.cuts_passes:
            self._plan_passes()
            return
        self._passes = []
        sizes = self._plan_rest()
        entries = self.entries_per_step
        counts = distributed.gather_objects((len(sizes), self.remaining))
        steps = max((length_policy.steps_for(m, entries) for m, _ in counts), default=0)
        # a rank with too few samples to fill as many steps (a shard a sample short, every sample alone) runs each
        # of its samples alone and then placeholder steps, so every rank still ends the epoch at the same step
        own = min(steps, length_policy.steps_for(self.remaining, entries))
        if self.plan.balanced:  # the steps are the layout's: a rank with fewer ends with placeholder steps
            own = length_policy.steps_for(len(sizes), entries)
        self._sizes = length_policy.equalize_steps(sizes, entries, own)
        self._plan_steps = steps

    def _plan_passes(self) -> None:
        """The rest of the epoch as steps of passes (:func:`~.policies.balance.step_passes`); every rank then runs
        as many steps as the rank that needs most (a rank with fewer ends with steps of empty slots). Collective."""
        lengths, plan = self.lengths, self.plan
        max_rows = -(-self.batch_size // self.num_pieces) if self.num_pieces > 1 else None
        steps = step_passes([lengths[i] for i in self._order[self.position:]], self.batch_size * self.entries_per_step,
                            plan.pass_tokens, padding_free=plan.padding_free, max_rows=max_rows) \
            if self.remaining else []
        agreed = max(distributed.gather_objects(len(steps)))
        steps += [[] for _ in range(agreed - len(steps))]
        self._sizes = [rows for step in steps for rows in step]
        self._passes = [len(step) for step in steps]
        self._plan_steps = agreed

    def budget_sizes(self) -> list[int]:
        """The micro-batch sizes the rest of the epoch counts as for the step budget: the plan's, or, when passes
        are cut here, micro-batches of the per-device size (the steps are the same: a step's passes are its
        share, whatever their number)."""
        if self.cuts_passes:
            return rank_sizes(self.remaining, self.batch_size, self.entries_per_step)
        return list(self._sizes)

    def over_budget(self) -> list[int]:
        """Dataset indices of this rank's epoch longer than the plan's ``max_tokens`` (each runs alone)."""
        if self.plan is None:
            return []
        lengths = self.lengths
        return [self._order[k] for k in length_policy.over_budget((lengths[i] for i in self._order), self.plan)]

    def planned_padding(self) -> tuple[int, int, int]:
        """``(real, padded, micro_batches)`` of the rest of the epoch as planned."""
        lengths, start, batches = self.lengths, self.position, []
        for size in self._sizes:
            batches.append([lengths[i] for i in self._order[start:start + size]])
            start += size
        _, padded = length_policy.padding(batches)
        real_tokens = self.real_tokens
        real = sum(real_tokens[i] for i in self._order[self.position:start])
        return real, real if self.plan.padding_free else padded, len(batches)

    def planned_spread(self) -> dict[str, float]:
        """Balanced steps: the mean rank work spread of the current layout's steps, and of the host-order deal of
        the same samples (empty otherwise)."""
        if not self._spreads:
            return {}
        n = len(self._spreads)
        return {'planned_rank_work_spread': round(sum(s for s, _ in self._spreads) / n, 6),
                'unbalanced_rank_work_spread': round(sum(u for _, u in self._spreads) / n, 6)}

    def take_spread_stats(self) -> tuple[float, float, int]:
        """``(sum of spreads, sum of unbalanced spreads, steps)`` of the balanced steps drawn since the last call."""
        stats, self.spread_stats = tuple(self.spread_stats), [0.0, 0.0, 0]
        return stats

    def _refine(self, indices: list[int], costs: list[int | None]) -> None:
        """Replace estimated lengths by the real costs of rows just encoded; note a micro-batch over the budget."""
        for i, cost in zip(indices, costs):
            if cost is not None:
                self._lengths[i] = cost
                if self._real is not self._lengths and self._real is not None:
                    self._real[i] = cost
        known = [c for c in costs if c is not None]
        if known and self.plan.mode == 'token_budget' and len(indices) > 1:
            padded = len(indices) * max(known)
            if padded > self.plan.max_tokens:
                self.over_estimates.append({'indices': list(indices), 'padded': padded})

    def take_reports(self) -> BudgetReports:
        """The micro-batches drawn over the budget because length estimates were low, since the last call."""
        reports, self.over_estimates = BudgetReports(over_estimates=self.over_estimates), []
        return reports

    def take_token_stats(self) -> tuple[int, int, int]:
        """``(real, padded, micro_batches)`` drawn since the last call (with a plan), and reset them."""
        stats, self.token_stats = tuple(self.token_stats), [0, 0, 0]
        return stats

    def _restart(self) -> None:
        """Drop the running iterator (and whatever its workers prefetched); the next draw starts at ``position``."""
        self._iterator = None

    def close(self) -> None:
        """Shut the workers down now (persistent workers otherwise live until the loader is freed)."""
        self._iterator = None
        self._loader._iterator = None

    # ---- drawing -----------------------------------------------------------------------------------
    def next_step(self, entries: int) -> list[tuple[list[int], Any]]:
        """Draw the micro-batches of one optimizer step: ``entries`` pairs ``(indices, batch)``.

        Pairs whose size is 0 (short last step of an epoch) are ``([], EmptyMicroBatch())``.
        The epoch must not be complete (call :meth:`start_next_epoch` first).
        """
        if self.epoch_complete:
            raise RuntimeError('next_step() called on a complete epoch; call start_next_epoch() first')
        self.set_entries_per_step(entries)
        if self._iterator is None:
            if self._needs_epoch_seed:
                self._generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
                self._needs_epoch_seed = False
            self._iterator = iter(self._loader)
        out: list[tuple[list[int], Any]] = []
        slots = None
        if self.plan is not None:
            planned = self._sizes[:self._passes[0] if self.cuts_passes else entries]
            if self.cuts_passes:  # every pass its own collated batch; HF's slots filled empty ones first
                slots = pass_slots(len(planned), entries)
                sizes = tuple(planned)
            else:
                sizes = (0, ) * (entries - len(planned)) + tuple(planned)  # a short last step: empty ones first
            self.step_spread = None
            if self._order_plan is not None and self._order_plan.balanced and self._spreads:
                step = min(self.position // max(self.batch_size * entries, 1), len(self._spreads) - 1)
                self.step_spread = self._spreads[step]
                self.spread_stats = [self.spread_stats[0] + self.step_spread[0],
                                     self.spread_stats[1] + self.step_spread[1], self.spread_stats[2] + 1]
        else:
            sizes = step_sizes(self.remaining, self.batch_size, entries)
            # the samples the largest shard takes in this step; a shorter shard lacks at most one of them
            self._padding += min(self._span - self.position - self._padding, self.batch_size * entries) - sum(sizes)
        for size in sizes:
            if size == 0:
                out.append(([], EmptyMicroBatch()))
                continue
            indices, batch, costs = next(self._iterator)
            expected = self._order[self.position:self.position + size]
            if list(indices) != expected:
                raise RuntimeError(f'elastic loader out of step: drew indices {indices[:8]}... but the plan expected '
                                   f'{expected[:8]}... (epoch {self.epoch}, position {self.position})')
            self.position += size
            self.samples_seen += size
            if self.plan is not None and self.lengths_estimated:
                self._refine(indices, costs)
            if self.plan is not None:
                lengths = [self.lengths[i] for i in indices]
                real = sum(self.real_tokens[i] for i in indices)
                self.token_stats[0] += real
                self.token_stats[1] += real if self.plan.padding_free else len(lengths) * max(lengths)
                self.token_stats[2] += 1
            out.append((list(indices), batch))
        if self.plan is not None:
            del self._sizes[:len(planned)]
            if self.cuts_passes:
                del self._passes[:1]
            self._plan_steps -= 1
        if self.epoch_complete:
            self._iterator = None
        return out if slots is None else group_passes(out, slots)


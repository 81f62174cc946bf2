"""How an epoch's samples are ordered on this rank: the host's order, shuffled chunks of similar length (bucketing),
or this rank's share of balanced global steps; and how a batch plan cuts such an order into micro-batches.

:class:`EpochLayout` computes layouts (pure given the epoch, the plan and the batch) and remembers the current
epoch's: the plan that laid it out, its chunks and, for balanced steps, each step's rank work spread.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .. import distributed
from ..policies import length as length_policy
from ..policies.balance import DEFAULT_WORK_COEF, balanced_layout, rank_sizes
from .rows import RowLengths

Order = Callable[[int], Sequence[int]]


class EpochLayout:
    """This rank's order of each epoch under a batch plan.

    Args:
        epoch_order: ``epoch -> this rank's share of the epoch in the host's order``.
        global_order: ``epoch -> every rank's samples in the host's order`` (balanced steps under several processes;
            one process: ``epoch_order``).
        rows: the dataset's row costs.
        work_coef: ``a`` of a row's work ``a x L + L^2`` (:func:`~..policies.balance.work_coefficient`).

    State: ``plan`` (the plan that laid out the current epoch, None: the host's order), ``chunks`` (its chunk sizes,
    bucketing), ``spreads`` (per step: rank work spread, spread of the host-order deal; balanced steps). The loader
    saves ``plan`` as ``order_plan``; chunks and spreads are computed again from it.
    """

    def __init__(self, epoch_order: Order, global_order: Order | None, rows: RowLengths, *,
                 work_coef: float = DEFAULT_WORK_COEF) -> None:
        self.epoch_order = epoch_order
        self._global_order = global_order
        self.rows = rows
        self.work_coef = float(work_coef)
        self.plan: length_policy.BatchPlan | None = None
        self.chunks: list[int] | None = None
        self.spreads: list[tuple[float, float]] = []

    @property
    def bucketed(self) -> bool:
        """Whether the current epoch's order was laid out by a plan (bucketing or balanced steps)."""
        return self.plan is not None

    @property
    def balanced(self) -> bool:
        """Whether the current epoch is laid out in balanced global steps."""
        return self.plan is not None and self.plan.balanced

    def order(self, epoch: int, plan: length_policy.BatchPlan | None, batch: int,
              entries: int) -> tuple[list[int], list[int] | None, list[tuple[float, float]]]:
        """``(order, chunks, spreads)`` of ``epoch`` laid out by ``plan`` (None or a plan that lays nothing out: the
        host's order); does not change the current layout."""
        if plan is not None and plan.balanced:
            source = self._global_order or (self.epoch_order if distributed.data_world() == 1 else None)
            if source is None:
                raise ValueError('balanced steps under several processes need the epoch order of every rank '
                                 '(global_order); this loader was built without it')
            order, spreads = self.balanced_share(list(source(epoch)), epoch, plan, batch, entries)
            return order, None, spreads
        base = list(self.epoch_order(epoch))
        if plan is None or not plan.bucketing:
            return base, None, []
        order, chunks = length_policy.epoch_layout(base, self.rows.costs, plan, epoch)
        return order, chunks, []

    def lay_out(self, epoch: int, plan: length_policy.BatchPlan | None, batch: int, entries: int) -> list[int]:
        """Lay ``epoch`` out by ``plan`` (only a plan that lays out counts) and make it the current layout; its
        order."""
        plan = plan if plan is not None and plan.lays_out else None
        order, self.chunks, self.spreads = self.order(epoch, plan, batch, entries)
        self.plan = plan
        return order

    def balanced_share(self, order: list[int], epoch: int, plan: length_policy.BatchPlan, batch: int, entries: int, *,
                       salt: int = 0, rank: int | None = None,
                       world: int | None = None) -> tuple[list[int], list[tuple[float, float]]]:
        """Rank ``rank``'s share of ``order`` (all ranks' samples) laid out in balanced steps over ``world`` ranks,
        and the steps' spreads (``None``: this process's rank and world size)."""
        world = distributed.data_world() if world is None else world
        rank = distributed.data_rank() if rank is None else rank
        layout = balanced_layout(order, self.rows.costs, world=world, batch=batch,
                                 entries=entries, seed=plan.seed + salt, epoch=epoch, jitter=plan.bucket_width,
                                 coef=self.work_coef, padding_free=plan.padding_free)
        return layout.shares[rank], list(zip(layout.spread, layout.unbalanced))

    def set_current(self, plan: length_policy.BatchPlan | None, chunks: list[int] | None = None,
                    spreads: Sequence[tuple[float, float]] = ()) -> None:
        """The current epoch was laid out elsewhere (a re-deal): by ``plan``, in ``chunks``, with ``spreads``."""
        self.plan, self.chunks, self.spreads = plan, chunks, list(spreads)

    def sizes(self, plan: length_policy.BatchPlan, order: Sequence[int], start: int, chunks: Sequence[int] | None,
              batch: int, entries: int) -> list[int]:
        """The micro-batch sizes ``plan`` cuts ``order`` into from ``start`` (``chunks``: its bucketing chunks)."""
        if plan.balanced:
            return rank_sizes(len(order) - start, batch, entries)
        costs = self.rows.costs
        return length_policy.plan_sizes([costs[i] for i in order], start, chunks, plan, batch)

    def step_spread(self, step: int) -> tuple[float, float] | None:
        """The spreads of step ``step`` of the current balanced layout (None: not balanced steps)."""
        if not self.balanced or not self.spreads:
            return None
        return self.spreads[min(step, len(self.spreads) - 1)]

    def planned_spread(self) -> dict[str, float]:
        """Balanced steps: the mean rank work spread of the current layout's steps, and of the host-order deal of the
        same samples (empty otherwise)."""
        if not self.spreads:
            return {}
        n = len(self.spreads)
        return {'planned_rank_work_spread': round(sum(s for s, _ in self.spreads) / n, 6),
                'unbalanced_rank_work_spread': round(sum(u for _, u in self.spreads) / n, 6)}

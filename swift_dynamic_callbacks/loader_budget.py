"""The elastic loader's epoch-budget arithmetic: optimizer steps still needed to use a number of epochs of data.

A mixin of :class:`~.loader.ElasticDataLoader` (it reads the loader's position, order, plan and re-deal record,
and lays later epochs out with the loader's own ``_layout``); the budget part of the integration
(``integrations/budget.py``) calls :meth:`LoaderBudget.steps_to_budget` whenever the batch size or plan changes, to
set HF's ``max_steps``.
"""

from __future__ import annotations

from typing import Callable

from . import distributed
from .policies import length as length_policy
from .policies.data_plan import before, steps_in_epoch, steps_to_budget, tolerant_ceil


class LoaderBudget:
    """``steps_to_budget`` of the elastic loader (one process or several; with or without a plan; inside a re-dealt
    epoch)."""

    def steps_to_budget(self, budget_epochs: float) -> int:
        """Optimizer steps still needed to use ``budget_epochs`` epochs of data (at the current batch size/plan).

        With a plan, the rest of this epoch is counted from the planned sizes and later epochs are laid out and
        planned as they will be (without the cross-rank split, which may add a step under data parallelism); the
        most any rank needs (collective: every rank calls it at the same boundary).
        """
        entries = self.entries_per_step
        if self.plan is None:
            if self.redealt is not None:
                steps = self._redealt_steps(budget_epochs, self._span, self.position + self._padding,
                                            lambda samples: steps_in_epoch(samples, self.batch_size, entries))
                if before(budget_epochs, self.epoch + 1):
                    return steps
                return steps + steps_to_budget(self.epoch + 1, 0, self.epoch_size, budget_epochs, self.batch_size,
                                               entries)
            return steps_to_budget(self.epoch, self.position + self._padding, self.epoch_size, budget_epochs,
                                   self.batch_size, entries)
        epoch_size = max(self.epoch_size, 1)
        epoch, position, sizes, steps = self.epoch, self.position, self.budget_sizes(), 0
        if self.redealt is not None:  # the rest of the re-dealt epoch, then whole epochs as below

            def planned(target: int) -> int:
                count, taken = 0, 0
                for size in sizes:
                    if taken >= target:
                        break
                    taken += size
                    count += 1
                return length_policy.steps_for(count, entries)

            steps = self._redealt_steps(budget_epochs, len(self._order), self.position, planned)
            if before(budget_epochs, self.epoch + 1):
                return max(distributed.gather_objects(steps))
            position = epoch_size
        while before(epoch + position / epoch_size, budget_epochs):
            if position >= epoch_size:
                epoch += 1
                order, chunks = self._layout(epoch, self.plan if self.plan.lays_out else None)
                sizes = self._sizes_for(order, 0, chunks)
                position = 0
                continue
            fraction = min(budget_epochs - epoch, 1.0)
            target = min(epoch_size, tolerant_ceil(fraction * epoch_size))
            count = 0
            for size in sizes:
                if position >= target:
                    break
                position += size
                count += 1
            steps += length_policy.steps_for(count, entries)
            if target < epoch_size:
                break
            position = epoch_size
        return max(distributed.gather_objects(steps))  # the ranks' plans differ: the most any rank needs

    def _redealt_steps(self, budget_epochs: float, size: int, done: int, steps_for: Callable[[int], int]) -> int:
        """Steps left in a re-dealt epoch (``size`` samples on this rank, ``done`` used) to reach the budget:
        ``steps_for(samples still to draw)``."""
        target = size
        if before(budget_epochs, self.epoch + 1):  # the budget ends inside this epoch
            need = tolerant_ceil((budget_epochs - self.epoch) * len(self.dataset)) - self.redealt['consumed']
            target = min(size, -(-max(need, 0) * size // max(self.redealt['dealt'], 1)))
        return steps_for(max(target - done, 0))

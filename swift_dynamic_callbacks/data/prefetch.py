"""The torch ``DataLoader`` under the elastic loader: workers collate the rest of the epoch as it is planned when their
iterator starts, and a change of plan drops what they prefetched.

Every DataLoader iterator draws its base seed from a generator. A plain loader draws it from the global torch RNG once
per epoch (when the epoch's iterator starts); this one restarts its iterator on every batch change, so it draws from
its own generator, seeded by one global draw per epoch. The global RNG (dropout masks) then advances exactly as in a
plain run, and a resume (which restores the global RNG after the first draw) matches an uninterrupted run.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, Dataset

from .rows import item_lengths, row_cost

#: ``() -> (order, start, sizes)``: the rest of the epoch, micro-batches of ``sizes`` samples of ``order`` from
#: ``start``
RestBatches = Callable[[], tuple[list[int], int, list[int]]]


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

    def __init__(self, rest_batches: RestBatches) -> None:
        # a weak method, not a reference: a cycle would leave the workers to the cyclic GC, after their queues closed
        self._rest = weakref.WeakMethod(rest_batches)

    def __iter__(self) -> Iterator[list[int]]:
        return self._batches(*self._rest()())  # a snapshot now, at iter(): the plan of the rest of the epoch

    @staticmethod
    def _batches(order: list[int], start: int, sizes: list[int]) -> Iterator[list[int]]:
        for size in sizes:
            yield order[start:start + size]
            start += size

    def __len__(self) -> int:
        return len(self._rest()()[2])


class Prefetch:
    """Micro-batches collated ahead by the host's ``DataLoader`` settings (workers, pin memory, prefetch).

    Args:
        dataset: the training dataset (map-style).
        collate_fn: the host's collate function.
        rest_batches: a bound method giving the rest of the epoch as planned now (held weakly).
        loader_kwargs: ``torch.utils.data.DataLoader`` settings.

    State: none saved; ``new_epoch`` marks that the next iterator draws the epoch's seed from the global RNG.
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any], rest_batches: RestBatches,
                 loader_kwargs: Mapping[str, Any]) -> None:
        self._generator = torch.Generator()
        self._needs_seed = True
        self._loader = DataLoader(_IndexedDataset(dataset), batch_sampler=_PlannedBatchSampler(rest_batches),
                                  collate_fn=_IndexedCollate(collate_fn), generator=self._generator, **loader_kwargs)
        self._iterator: Iterator | None = None

    def new_epoch(self) -> None:
        """The next iterator starts an epoch: it seeds the workers from one draw of the global RNG."""
        self._needs_seed = True

    def start(self) -> None:
        """Start the workers on the rest of the epoch as planned now, unless they run already."""
        if self._iterator is None:
            if self._needs_seed:
                self._generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
                self._needs_seed = False
            self._iterator = iter(self._loader)

    def next(self) -> tuple[list[int], Any, list[int | None]]:
        """``(indices, batch, row costs)`` of the next planned micro-batch (:meth:`start` first)."""
        return next(self._iterator)

    def restart(self) -> None:
        """Drop the running iterator and whatever its workers prefetched."""
        self._iterator = None

    def close(self) -> None:
        """Shut the workers down now (persistent workers otherwise live until the loader is freed)."""
        self._iterator = None
        self._loader._iterator = None

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
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from .policies.data_plan import epoch_steps, step_sizes


class EmptyMicroBatch(dict):
    """Placeholder for a micro-batch with no sample (only in the short last step of an epoch)."""


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

    def __call__(self, items: list[tuple[int, Any]]) -> tuple[list[int], Any]:
        return [i for i, _ in items], self.collate_fn([x for _, x in items])


class _PlannedBatchSampler:
    """Yields the index lists of the rest of the epoch, as planned at the moment ``iter()`` is called."""

    def __init__(self, loader: 'ElasticDataLoader') -> None:
        # a proxy, not a reference: a cycle would leave the workers to the cyclic GC, after their queues closed
        self.loader = weakref.proxy(loader)

    def __iter__(self) -> Iterator[list[int]]:
        order, start = self.loader._order, self.loader.position
        batch_size, entries = self.loader.batch_size, self.loader.entries_per_step
        for sizes in epoch_steps(len(order) - start, batch_size, entries):
            for size in sizes:
                if size:
                    yield order[start:start + size]
                    start += size

    def __len__(self) -> int:
        remaining = len(self.loader._order) - self.loader.position
        return sum(1 for sizes in epoch_steps(remaining, self.loader.batch_size, self.loader.entries_per_step)
                   for s in sizes if s)


class ElasticDataLoader:
    """Training loader whose per-device batch size can change at any optimizer-step boundary.

    Args:
        dataset: the trainer's training dataset (map-style).
        collate_fn: the host's collate function.
        epoch_order: ``epoch -> list of dataset indices`` of this rank's share of the epoch, in training order.
        batch_size: initial per-device micro-batch size.
        entries_per_step: micro-batches per optimizer step (HF's ``gradient_accumulation_steps``).
        loader_kwargs: extra ``torch.utils.data.DataLoader`` settings (workers, pin memory, prefetch ...).

    State (``state_dict``): ``epoch``, ``position`` (samples of this rank's epoch shard consumed),
    ``batch_size``, ``num_pieces``, ``samples_seen`` (this rank, all epochs).
    """

    state_key = 'integration.data'

    def __init__(self,
                 dataset: Any,
                 collate_fn: Callable[[list], Any],
                 epoch_order: Callable[[int], Sequence[int]],
                 *,
                 batch_size: int,
                 entries_per_step: int,
                 loader_kwargs: Mapping[str, Any] | None = None) -> None:
        self.dataset = dataset
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
        return len(self._order)

    @property
    def remaining(self) -> int:
        return len(self._order) - self.position

    @property
    def epoch_complete(self) -> bool:
        return self.position >= len(self._order)

    @property
    def epoch_progress(self) -> float:
        """Data epochs done, fractional (``epoch + position / epoch_size``)."""
        return self.epoch + (self.position / len(self._order) if self._order else 1.0)

    def start_next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._order = list(self._epoch_order(self.epoch))
        self._needs_epoch_seed = True
        self._restart()

    def set_batch_size(self, batch_size: int) -> None:
        if batch_size != self.batch_size:
            self.batch_size = batch_size
            self._restart()

    def set_entries_per_step(self, entries: int) -> None:
        if entries != self.entries_per_step:
            self.entries_per_step = entries
            self._restart()

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
        for size in step_sizes(self.remaining, self.batch_size, entries):
            if size == 0:
                out.append(([], EmptyMicroBatch()))
                continue
            indices, batch = next(self._iterator)
            expected = self._order[self.position:self.position + size]
            if list(indices) != expected:
                raise RuntimeError(f'elastic loader out of step: drew indices {indices[:8]}... but the plan expected '
                                   f'{expected[:8]}... (epoch {self.epoch}, position {self.position})')
            self.position += size
            self.samples_seen += size
            out.append((list(indices), batch))
        if self.epoch_complete:
            self._iterator = None
        return out

    # ---- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            'epoch': self.epoch,
            'position': self.position,
            'batch_size': self.batch_size,
            'num_pieces': self.num_pieces,
            'samples_seen': self.samples_seen,
            'epoch_size': len(self._order),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from .state import StateError
        epoch, position = int(state['epoch']), int(state['position'])
        order = list(self._epoch_order(epoch))
        if int(state.get('epoch_size', len(order))) != len(order):
            raise StateError(f'the checkpoint was written for an epoch of {state["epoch_size"]} samples on this rank, '
                             f'but the training dataset now gives {len(order)}; resume with the same dataset')
        if not 0 <= position <= len(order):
            raise StateError(f'corrupt loader state: position {position} outside the epoch of {len(order)} samples')
        self.epoch, self._order, self.position = epoch, order, position
        self._needs_epoch_seed = True
        self.batch_size = int(state['batch_size'])
        self.num_pieces = int(state.get('num_pieces', 1))
        self.samples_seen = int(state.get('samples_seen', 0))
        self._restart()

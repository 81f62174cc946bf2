"""ElasticDataLoader: exactly-once epochs while the batch size changes between optimizer steps."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset

from swift_dynamic_callbacks.data.elastic import ElasticDataLoader
from swift_dynamic_callbacks.data.slots import EmptyMicroBatch
from swift_dynamic_callbacks.policies.data_plan import step_sizes
from swift_dynamic_callbacks.state import StateError

OFFSET = 1000  # dataset item i is OFFSET + i, so a batch's values tell which indices it holds


class IntDataset(Dataset):
    """Map-style dataset of ints (module level so it pickles into workers)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return OFFSET + index


def collate(items: list) -> torch.Tensor:
    return torch.tensor(items, dtype=torch.long)


class SeededOrder:
    """A seeded permutation of ``range(n)`` per epoch (different for every epoch)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        self.seed = seed

    def __call__(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        return torch.randperm(self.n, generator=generator).tolist()


def make_loader(n: int, *, seed: int = 0, batch_size: int = 2, entries: int = 1, **loader_kwargs):
    return ElasticDataLoader(
        IntDataset(n),
        collate,
        SeededOrder(n, seed),
        batch_size=batch_size,
        entries_per_step=entries,
        loader_kwargs=loader_kwargs or None)


def check_step(loader, out, batch_size, entries, remaining_before):
    """One step's pairs: planned sizes, batches holding exactly their indices, in epoch order."""
    expected_sizes = step_sizes(remaining_before, batch_size, entries)
    assert [len(indices) for indices, _ in out] == list(expected_sizes)
    drawn = []
    for indices, batch in out:
        if not indices:
            assert isinstance(batch, EmptyMicroBatch)
            continue
        assert isinstance(batch, torch.Tensor)
        assert batch.tolist() == [OFFSET + i for i in indices]
        drawn.extend(indices)
    return drawn


def run_epoch(loader, changes, start=0):
    """Draw a whole epoch, applying ``changes[k] = (batch_size, entries)`` before step k (cycling)."""
    seen = []
    k = start
    while not loader.epoch_complete:
        batch_size, entries = changes[k % len(changes)]
        loader.set_batch_size(batch_size)
        before = loader.remaining
        position = loader.position
        out = loader.next_step(entries)
        drawn = check_step(loader, out, batch_size, entries, before)
        assert drawn == loader.layout.epoch_order(loader.epoch)[position:position + len(drawn)]
        assert loader.position == position + len(drawn)
        seen.extend(drawn)
        k += 1
    return seen, k


changes_st = st.lists(st.tuples(st.integers(1, 7), st.integers(1, 3)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 40), seed=st.integers(0, 5), changes=changes_st, epochs=st.integers(1, 3))
def test_exactly_once_with_random_batch_changes(n, seed, changes, epochs):
    loader = make_loader(n, seed=seed, batch_size=changes[0][0], entries=changes[0][1])
    order = SeededOrder(n, seed)
    k = 0
    total = 0
    for epoch in range(epochs):
        assert loader.epoch == epoch
        assert loader.position == 0
        seen, k = run_epoch(loader, changes, k)
        assert sorted(seen) == list(range(n))  # every index exactly once
        assert seen == order(epoch)  # in the epoch order
        total += n
        assert loader.samples_seen == total
        assert loader.epoch_complete
        assert loader.remaining == 0
        assert loader.epoch_progress == pytest.approx(epoch + 1)
        loader.start_next_epoch()
    assert loader.epoch == epochs


def test_short_last_step_has_empty_micro_batches():
    loader = make_loader(2, batch_size=4, entries=3)
    out = loader.next_step(3)
    assert [len(indices) for indices, _ in out] == [0, 1, 1]
    assert out[0] == ([], EmptyMicroBatch())
    assert isinstance(out[0][1], EmptyMicroBatch)
    assert sorted(out[1][0] + out[2][0]) == [0, 1]
    assert loader.epoch_complete


def test_next_step_on_complete_epoch_raises_and_next_epoch_permutes():
    n = 9
    order = SeededOrder(n, 3)
    assert order(0) != order(1)  # the seeded orders differ per epoch
    loader = make_loader(n, seed=3, batch_size=4)
    seen, _ = run_epoch(loader, [(4, 1)])
    assert seen == order(0)
    with pytest.raises(RuntimeError, match='complete epoch'):
        loader.next_step(1)
    assert loader.position == n  # the failed call moved nothing
    assert loader.samples_seen == n
    loader.start_next_epoch()
    assert loader.epoch == 1
    assert loader.position == 0
    assert loader.remaining == n
    assert loader.epoch_progress == 1.0
    out = loader.next_step(1)
    assert out[0][0] == order(1)[:4]
    assert out[0][1].tolist() == [OFFSET + i for i in order(1)[:4]]


def test_entries_change_between_steps():
    n = 20
    loader = make_loader(n, seed=1, batch_size=2, entries=1)
    order = SeededOrder(n, 1)(0)
    assert [len(i) for i, _ in loader.next_step(1)] == [2]
    out = loader.next_step(3)
    assert [len(i) for i, _ in out] == [2, 2, 2]
    assert loader.entries_per_step == 3
    assert sum((i for i, _ in out), []) == order[2:8]
    loader.set_batch_size(5)
    out = loader.next_step(2)
    assert [len(i) for i, _ in out] == [5, 5]
    assert sum((i for i, _ in out), []) == order[8:18]
    out = loader.next_step(3)  # 2 left over 3 entries
    assert [len(i) for i, _ in out] == [0, 1, 1]
    assert sum((i for i, _ in out), []) == order[18:20]
    assert loader.epoch_complete


# ---- workers ---------------------------------------------------------------------------------------------


def shutdown_workers(loader):
    """Drop the worker iterator by reference count, while its queues are intact (see test_loader_is_not_cyclic)."""
    loader.prefetch.close()


@pytest.fixture
def worker_loader():
    made = []

    def make(*args, **kwargs):
        loader = make_loader(*args, **kwargs)
        made.append(loader)
        return loader

    yield make
    for loader in made:
        shutdown_workers(loader)


def test_loader_is_not_cyclic():
    loader = make_loader(6, batch_size=2)
    loader.next_step(1)
    ref = weakref.ref(loader)
    gc.disable()
    try:
        del loader
        assert ref() is None  # freed by reference counting, like a plain DataLoader
    finally:
        gc.enable()


@pytest.mark.parametrize('persistent', [True, False])
def test_workers_change_takes_effect_on_next_step(worker_loader, persistent):
    """With prefetching workers, a new size applies to the very next step; no old-size batch leaks."""
    plan = [(2, 1), (5, 1), (1, 2), (1, 2), (3, 2), (7, 1), (2, 1)]
    n = sum(b * e for b, e in plan)  # 26: the plan ends the epoch exactly
    order = SeededOrder(n, 2)
    loader = worker_loader(n, seed=2, batch_size=2, entries=1, num_workers=2, persistent_workers=persistent,
                           prefetch_factor=2)
    seen = []
    for batch_size, entries in plan:
        loader.set_batch_size(batch_size)
        position = loader.position
        out = loader.next_step(entries)
        drawn = check_step(loader, out, batch_size, entries, n - position)
        assert [len(i) for i, _ in out] == [batch_size] * entries  # the new size, right away
        assert drawn == order(0)[position:position + len(drawn)]
        seen.extend(drawn)
    assert loader.epoch_complete
    assert seen == order(0)
    loader.start_next_epoch()
    loader.set_batch_size(4)
    out = loader.next_step(1)
    assert out[0][0] == order(1)[:4]
    assert out[0][1].tolist() == [OFFSET + i for i in order(1)[:4]]


def test_workers_exactly_once_across_epochs_persistent(worker_loader):
    n = 17
    order = SeededOrder(n, 4)
    loader = worker_loader(n, seed=4, batch_size=3, entries=2, num_workers=2, persistent_workers=True)
    changes = [(3, 2), (1, 1), (4, 2), (2, 3)]
    k = 0
    for epoch in range(2):
        seen, k = run_epoch(loader, changes, k)
        assert seen == order(epoch)
        loader.start_next_epoch()
    assert loader.samples_seen == 2 * n


# ---- state -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize('epoch', [0, 1])
def test_state_round_trip_resumes_at_unseen_samples(epoch):
    n = 23
    order = SeededOrder(n, 7)
    loader = make_loader(n, seed=7, batch_size=3, entries=2)
    for _ in range(epoch):
        run_epoch(loader, [(3, 2)])
        loader.start_next_epoch()
    seen = []
    for _ in range(2):
        seen += sum((i for i, _ in loader.next_step(2)), [])
    loader.set_batch_size(2)
    seen += sum((i for i, _ in loader.next_step(2)), [])
    assert seen == order(epoch)[:16]
    state = json.loads(json.dumps(loader.state_dict()))  # survives the JSON checkpoint file
    assert state['epoch'] == epoch
    assert state['position'] == 16
    assert state['batch_size'] == 2
    assert state['samples_seen'] == epoch * n + 16
    assert state['epoch_size'] == n

    fresh = make_loader(n, seed=7, batch_size=6, entries=1)
    fresh.load_state_dict(state)
    assert fresh.epoch == epoch
    assert fresh.position == 16
    assert fresh.batch_size == 2
    assert fresh.samples_seen == epoch * n + 16
    assert fresh.state_dict() == state
    rest, _ = run_epoch(fresh, [(2, 2), (5, 1)])
    assert rest == order(epoch)[16:]
    assert sorted(seen + rest) == list(range(n))
    assert fresh.samples_seen == (epoch + 1) * n


def test_state_round_trip_with_persistent_workers(worker_loader):
    n = 12
    order = SeededOrder(n, 8)
    loader = make_loader(n, seed=8, batch_size=3)
    seen = sum((i for i, _ in loader.next_step(1)), [])
    state = loader.state_dict()
    fresh = worker_loader(n, seed=8, batch_size=1, num_workers=2, persistent_workers=True)
    fresh.next_step(1)  # a running iterator with prefetched batches from position 0
    fresh.load_state_dict(state)
    rest, _ = run_epoch(fresh, [(4, 1)])
    assert seen + rest == order(0)


def test_load_state_with_other_dataset_size_raises():
    loader = make_loader(10, batch_size=2)
    loader.next_step(1)
    state = loader.state_dict()
    other = make_loader(11, batch_size=2)
    with pytest.raises(StateError, match='10'):
        other.load_state_dict(state)


# ---- what HF sees ----------------------------------------------------------------------------------------


def test_len_raises_type_error():
    from transformers.trainer_utils import has_length
    loader = make_loader(10)
    with pytest.raises(TypeError):
        len(loader)
    assert has_length(loader) is False


def test_iter_previews_without_moving_position():
    n = 11
    order = SeededOrder(n, 5)(0)
    loader = make_loader(n, seed=5, batch_size=3, entries=2)
    loader.next_step(2)  # 6 consumed
    assert loader.position == 6
    preview = [b.tolist() for b in iter(loader)]
    # 5 left, entries 2: one short step of (2, 3)
    assert preview == [[OFFSET + i for i in order[6:8]], [OFFSET + i for i in order[8:11]]]
    assert loader.position == 6
    assert loader.samples_seen == 6
    assert [b.tolist() for b in loader] == preview  # again, identical
    out = loader.next_step(2)
    assert [b.tolist() for _, b in out] == preview  # the real draw matches the preview
    assert loader.epoch_complete
    assert list(iter(loader)) == []
    loader.set_epoch(5)  # ignored
    assert loader.epoch == 0

"""Resume on another number of processes (elastic resume), with fakes: the samples the saved ranks left in the epoch
are re-dealt to the new ranks, none repeated or skipped, and the next epochs are whole again.

The real multi-process runs (2 -> 1, 2 -> 3, 1 -> 2 under DDP on CPU) are in ``test_engines.py``.
"""

from __future__ import annotations

import random

import pytest

from swift_dynamic_callbacks.errors import StateError
from swift_dynamic_callbacks.data.elastic import ElasticDataLoader
from swift_dynamic_callbacks.policies.data_plan import per_device_batch, redeal
from swift_dynamic_callbacks.policies.length import BatchPlan
from swift_dynamic_callbacks.state import pack_indices, unpack_indices

N = 23


def _order(rank: int, world: int):
    def order(epoch: int) -> list[int]:
        perm = list(range(N))
        random.Random(100 + epoch).shuffle(perm)
        return perm[rank::world]
    return order


def _loaders(world: int, batch_size: int, entries: int = 2, plan: BatchPlan | None = None):
    lengths = [10 + (7 * i) % 40 for i in range(N)]
    loaders = [ElasticDataLoader(list(range(N)), lambda items: items, _order(r, world), batch_size=batch_size,
                                 entries_per_step=entries, lengths=lambda: lengths) for r in range(world)]
    if plan is not None:
        for loader in loaders:
            loader.set_plan(plan)
    return loaders


def _draw(loaders, steps: int | None = None) -> list[int]:
    """Steps on every rank (all at once, as the ranks do) until the epoch ends or ``steps`` were taken."""
    seen = []
    taken = 0
    while not all(loader.epoch_complete for loader in loaders) and (steps is None or taken < steps):
        for loader in loaders:
            if not loader.epoch_complete:
                seen.extend(i for indices, _ in loader.next_step(loader.entries_per_step) for i in indices)
        taken += 1
    return seen


def test_redeal_deals_every_sample_left_once_and_keeps_the_same_world_identity():
    rests = [[1, 2, 3], [4, 5], [6, 7, 8]]
    for world in (1, 2, 3, 5):
        shares = redeal(rests, world)
        assert sorted(sum(shares, [])) == [1, 2, 3, 4, 5, 6, 7, 8]
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert redeal([[1, 3, 5], [2, 4]], 2) == [[1, 3, 5], [2, 4]]  # the same world: each rank keeps its own rest
    with pytest.raises(ValueError, match='world must be >= 1'):
        redeal(rests, 0)


def test_per_device_batch_keeps_the_global_batch_or_says_it_cannot():
    assert per_device_batch(8, 1, 2) == (4, True)
    assert per_device_batch(12, 3, 1) == (4, True)
    assert per_device_batch(8, 3, 1) == (3, False)  # 9 samples a step: the nearest
    assert per_device_batch(2, 4, 1) == (1, False)


def test_packed_indices_round_trip_and_refuse_garbage():
    values = list(range(1000))
    random.Random(0).shuffle(values)
    assert unpack_indices(pack_indices(values)) == values and unpack_indices(pack_indices([])) == []
    with pytest.raises(StateError, match='corrupt index list'):
        unpack_indices('not base64 at all!')


@pytest.mark.parametrize('old,new', [(2, 1), (1, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize('plan', [None, BatchPlan(max_tokens=120, bucketing=True)], ids=['batches', 'token_budget'])
def test_a_resume_on_another_world_trains_every_sample_of_the_epoch_once(old, new, plan):
    before = _loaders(old, batch_size=2, plan=plan)
    first = _draw(before, steps=1)
    states = [loader.state_dict() for loader in before]
    after = _loaders(new, batch_size=2, plan=plan)
    dealt = [loader.resume_from_rests(states, rank=r, world=new) for r, loader in enumerate(after)]
    assert all(d['consumed_in_epoch'] == len(first) and d['left_in_epoch'] == N - len(first) for d in dealt)
    assert all(0 < loader.epoch_progress < 1 for loader in after)
    rest = _draw(after)
    assert sorted(first + rest) == list(range(N))  # the epoch exactly once over both runs
    assert all(loader.epoch_progress == 1.0 for loader in after)
    assert sum(loader.samples_seen for loader in after) == N
    for loader in after:
        loader.start_next_epoch()
    assert sorted(_draw(after)) == list(range(N))  # the next epoch is whole, dealt over the new world


def test_a_redealt_epoch_saved_again_resumes_on_the_same_and_on_another_world():
    before = _loaders(2, batch_size=2)
    first = _draw(before, steps=1)
    states = [loader.state_dict() for loader in before]
    middle = _loaders(3, batch_size=1)
    for r, loader in enumerate(middle):
        loader.resume_from_rests(states, rank=r, world=3)
    second = _draw(middle, steps=2)
    saved = [loader.state_dict() for loader in middle]
    assert all(s['redealt']['consumed'] == len(first) for s in saved)
    same = _loaders(3, batch_size=1)
    for r, loader in enumerate(same):
        loader.resume_from_rests(saved, rank=r, world=3)
    assert [loader.shard.order for loader in same] == [unpack_indices(s['rest']) for s in saved]  # each its own rest
    assert sorted(first + second + _draw(same)) == list(range(N))
    single = _loaders(1, batch_size=4)
    single[0].resume_from_rests(saved, rank=0, world=1)
    assert sorted(first + second + _draw(single)) == list(range(N))


def test_steps_to_budget_in_a_redealt_epoch_count_the_rest_then_whole_epochs():
    before = _loaders(2, batch_size=2, entries=1)
    _draw(before, steps=3)  # 12 of 23 used
    after = _loaders(1, batch_size=4, entries=1)
    after[0].resume_from_rests([b.state_dict() for b in before], rank=0, world=1, batch_size=4)
    assert after[0].steps_to_budget(2.0) == 3 + 6  # 11 left at 4 a step, then a whole epoch of 23
    assert after[0].steps_to_budget(1.0) == 3


def test_a_state_from_before_elastic_resume_or_of_another_dataset_is_refused():
    before = _loaders(2, batch_size=2)
    _draw(before, steps=1)
    states = [loader.state_dict() for loader in before]
    old = [{k: v for k, v in s.items() if k != 'rest'} for s in states]
    with pytest.raises(StateError, match='resume it with the number of processes that wrote it'):
        _loaders(1, batch_size=2)[0].resume_from_rests(old, rank=0, world=1)
    short = [dict(states[0]), dict(states[1], rest=pack_indices(unpack_indices(states[1]['rest'])[:-1]))]
    with pytest.raises(StateError, match='dataset of 22 samples'):
        _loaders(1, batch_size=2)[0].resume_from_rests(short, rank=0, world=1)


@pytest.mark.e2e
def test_a_resume_with_other_gradient_accumulation_keeps_the_global_batch(tmp_path, tiny_llama, gsm8k_16):
    """A real ``swift sft`` run (batch 2 x GA 2, a table 2 -> 4 at step 3, 2 epochs) resumed from step 2 with GA 1:
    the per-device batch is derived again (2 -> 4, then the table's 4 -> 8) so every step takes the samples it took
    in the uninterrupted run, one ``elastic_resume`` record says so, every sample of each epoch is used once over both
    runs, and the LR at every step is the uninterrupted run's."""
    import json
    import os
    import shutil

    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_runs import decisions, indices_by_epoch, run_sft, sample_trace, train_logs
    run = dict(per_device_train_batch_size=2, num_train_epochs=2, max_steps=-1, save_steps=2, learning_rate=1e-3,
               lr_scheduler_type='linear', warmup_steps=0)
    pack = dict(batch_schedule={'schedule': {0: 2, 3: 4}}, integration={'record_samples': True})
    try:
        sdc.register(**pack)
        full = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'full'), callbacks=['batch_schedule'],
                       gradient_accumulation_steps=2, **run)
        target = str(tmp_path / 'resumed')
        shutil.copytree(full, target)
        before = [row for row in sample_trace(target) if row['step'] <= 2]
        written = len(sample_trace(target))
        sdc.register(**pack)
        run_sft(tiny_llama, 'llama', gsm8k_16, target, callbacks=['batch_schedule'], fresh=False,
                gradient_accumulation_steps=1, resume_from_checkpoint=os.path.join(target, 'checkpoint-2'), **run)
    finally:
        plugin.unregister()
    after = sample_trace(target)[written:]
    (record, ) = [d for d in decisions(target) if d['kind'] == 'elastic_resume']
    assert (record['values']['old_entries'], record['values']['new_entries'], record['values']['old_batch_size'],
            record['values']['new_batch_size'], record['values']['global_batch_kept']) == (2, 1, 2, 4, True)
    by_step = {row['step']: sum(len(b) for b in row['batches']) for row in before + after}
    assert by_step == {row['step']: sum(len(b) for b in row['batches']) for row in sample_trace(full)}
    assert [len(row['batches']) for row in after] == [1] * len(after)  # one micro-batch a step now
    epochs = indices_by_epoch(before + after)
    assert sorted(epochs) == [0, 1] and all(sorted(epochs[e]) == list(range(16)) for e in epochs)
    def step(row):
        return int(row['global_step/max_steps'].split('/')[0])

    lrs = {step(row): row['learning_rate'] for row in train_logs(full)}
    resumed = train_logs(target)[len(lrs):]
    assert [step(row) for row in resumed] == sorted(s for s in lrs if s > 2)
    assert all(row['learning_rate'] == pytest.approx(lrs[step(row)], rel=1e-6) for row in resumed)
    state = json.loads(open(os.path.join(target, f'checkpoint-{max(by_step)}', 'dynamic_callbacks_state.json')).read())
    assert state['components']['integration']['layout'] == {'world': 1, 'entries': 2, 'batch': 2}
    # another per_device_train_batch_size at resume does not change the run's batch: said, never silent
    again = str(tmp_path / 'again')
    shutil.copytree(full, again)
    try:
        sdc.register(**pack)
        run_sft(tiny_llama, 'llama', gsm8k_16, again, callbacks=['batch_schedule'], fresh=False,
                gradient_accumulation_steps=2, resume_from_checkpoint=os.path.join(again, 'checkpoint-2'),
                **{**run, 'per_device_train_batch_size': 3})
    finally:
        plugin.unregister()
    (said, ) = [d for d in decisions(again) if d['reason'] == 'batch_setting']
    assert (said['values']['run'], said['values']['now'], said['values']['batch_size']) == (2, 3, 2)


class _Counting(list):
    """A dataset that counts the rows read (encoding a lazily tokenised row is what a resume must not repeat)."""

    reads = 0

    def __getitem__(self, index):
        _Counting.reads += 1
        return list.__getitem__(self, index)


@pytest.mark.parametrize('path', ['position', 'rests'])
def test_a_resume_mid_epoch_reads_no_sample_before_the_position(path):
    """No O(n) skip: resuming at sample 9,990 of 10,000 (from the position, or from the saved rests as on another
    number of processes) reads only the rows the next step trains on."""
    n = 10_000
    data = _Counting(range(n))
    loader = ElasticDataLoader(data, lambda items: items, lambda epoch: list(range(n)), batch_size=5,
                               entries_per_step=2)
    state = dict(loader.state_dict(), position=n - 10, samples_seen=n - 10,
                 rest=pack_indices(list(range(n - 10, n))))
    fresh = ElasticDataLoader(data, lambda items: items, lambda epoch: list(range(n)), batch_size=5,
                              entries_per_step=2)
    if path == 'position':
        fresh.load_state_dict(state)
    else:
        fresh.resume_from_rests([state], rank=0, world=1)
    _Counting.reads = 0
    pairs = fresh.next_step(2)
    assert [i for indices, _ in pairs for i in indices] == list(range(n - 10, n))
    assert _Counting.reads == 10


@pytest.mark.parametrize('new', [2, 3])
def test_balanced_steps_resumed_on_another_world_deal_by_the_given_rank(new):
    """``resume_from_rests(rank=, world=)`` under balanced steps lays the rest out for the world and rank it is given
    (as the other layouts do), not this process's: here one process plays every rank of the new world."""
    plan = BatchPlan(mode='balanced', bucketing=True)
    before = _loaders(1, batch_size=2, plan=plan)
    first = _draw(before, steps=2)
    states = [loader.state_dict() for loader in before]
    after = _loaders(new, batch_size=2)
    for rank, loader in enumerate(after):
        loader.resume_from_rests(states, rank=rank, world=new)
    shares = [loader.remaining for loader in after]
    assert sum(shares) == N - len(first) and max(shares) - min(shares) <= 2  # dealt over the ranks, not all to each
    rest = _draw(after)
    assert sorted(first + rest) == list(range(N))  # the epoch exactly once

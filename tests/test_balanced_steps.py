"""Balanced global steps (``length_batching`` ``mode: balanced``): the pure layout (exactly once, the global batch in
every step, even rank work), the loader (one and two ranks, a batch change inside an epoch, resume), the settings, and
a real swift sft run."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset

from swift_dynamic_callbacks import distributed
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.config.length_batching import LengthBatchingConfig
from swift_dynamic_callbacks.data.elastic import ElasticDataLoader
from swift_dynamic_callbacks.policies.balance import (balanced_layout, batch_work, deal, rank_sizes, rank_work,
                                                       share_counts, work_coefficient, work_spread)
from swift_dynamic_callbacks.policies.length import BatchPlan
from swift_dynamic_callbacks.data.rows import dataset_lengths


def lognormal_lengths(n, seed=0):
    rng = random.Random(seed)
    return [max(8, min(4096, int(rng.lognormvariate(5.3, 0.8)))) for _ in range(n)]


# ---- pure policy ---------------------------------------------------------------------------------------------

def test_work_coefficient_matches_the_7b_figure_and_falls_back():
    assert work_coefficient(4096, 11008) == pytest.approx(24704)  # verl's 24576 for a 7B decoder
    assert work_coefficient(576, 1536) == pytest.approx(3456)  # SmolLM2-135M
    assert work_coefficient(None, 1536) == 24576.0
    assert batch_work([10, 20], 100) == 2 * (100 * 20 + 400)
    assert batch_work([10, 20], 100, padding_free=True) == 100 * 30 + 900
    assert work_spread([1.0, 1.0]) == 0 and work_spread([3.0, 1.0]) == pytest.approx(0.5) and work_spread([5]) == 0


@settings(max_examples=120, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=150), world=st.integers(1, 4),
       batch=st.integers(1, 6), entries=st.integers(1, 3), seed=st.integers(0, 5), epoch=st.integers(0, 2),
       jitter=st.sampled_from([0.0, 0.03, 0.5]))
def test_layout_is_exactly_once_with_the_global_batch_in_every_step(lengths, world, batch, entries, seed, epoch,
                                                                    jitter):
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    layout = balanced_layout(order, lengths, world=world, batch=batch, entries=entries, seed=seed, epoch=epoch,
                             jitter=jitter, coef=1000.0)
    assert sorted(i for share in layout.shares for i in share) == list(range(len(lengths)))
    per_step = batch * entries
    for k, counts in enumerate(layout.steps):
        last = k == len(layout.steps) - 1
        assert sum(counts) == world * per_step or last  # the global batch, but in the short last step
        assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    for rank, share in enumerate(layout.shares):
        assert len(share) == sum(c[rank] for c in layout.steps)
        assert sum(rank_sizes(len(share), batch, entries)) == len(share)
        assert all(0 < s <= batch for s in rank_sizes(len(share), batch, entries))
    again = balanced_layout(order, lengths, world=world, batch=batch, entries=entries, seed=seed, epoch=epoch,
                            jitter=jitter, coef=1000.0)
    assert again == layout  # every rank computes the same layout


def test_deal_balances_the_ranks_and_the_layout_beats_the_host_order():
    lengths = lognormal_lengths(512, seed=1)
    order = list(range(512))
    random.Random(0).shuffle(order)
    layout = balanced_layout(order, lengths, world=2, batch=4, entries=2, seed=0, epoch=0, jitter=0.03, coef=3456.0)
    mean = sum(layout.spread) / len(layout.spread)
    unbalanced = sum(layout.unbalanced) / len(layout.unbalanced)
    assert mean <= 0.02 < unbalanced  # figures in docs/throughput.md come from the benchmark, not from here
    # each rank's share of a step is ordered longest first: its micro-batches hold similar lengths
    share = layout.shares[0][:8]
    assert [lengths[i] for i in share] == sorted((lengths[i] for i in share), reverse=True)
    with pytest.raises(ValueError, match='do not add up'):
        deal([0, 1, 2], lengths, [1, 1], 1.0)
    assert share_counts(5, 2) == [3, 2] and share_counts(1, 3) == [1, 0, 0]


def test_rank_work_counts_padding():
    assert rank_work([10, 10, 30, 5], 2, 0.0) == 2 * 100 + 2 * 900
    assert rank_work([10, 10, 30, 5], 2, 0.0, padding_free=True) == 400 + 35 * 35


def test_jitter_and_epochs_change_the_steps():
    lengths = lognormal_lengths(200, seed=2)
    order = list(range(200))
    first = balanced_layout(order, lengths, world=2, batch=4, entries=1, seed=0, epoch=0, jitter=0.05, coef=1.0)
    second = balanced_layout(order, lengths, world=2, batch=4, entries=1, seed=0, epoch=1, jitter=0.05, coef=1.0)
    assert first.shares != second.shares


# ---- the loader ----------------------------------------------------------------------------------------------

class LengthDataset(Dataset):

    def __init__(self, lengths):
        self.lengths = list(lengths)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return i


def collate(items):
    return list(items)


def make_loader(lengths, *, batch_size=4, entries=1, seed=0, global_order=None):
    def order(epoch):
        return torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed * 100 + epoch)).tolist()

    dataset = LengthDataset(lengths)
    return ElasticDataLoader(dataset, collate, order, batch_size=batch_size, entries_per_step=entries,
                             lengths=lambda: dataset_lengths(dataset), global_order=global_order, work_coef=500.0)


def draw_epoch(loader, entries, sizes_by_step=None):
    steps = []
    k = 0
    while not loader.epoch_complete:
        if sizes_by_step:
            loader.set_batch_size(sizes_by_step[min(k, len(sizes_by_step) - 1)])
        steps.append([indices for indices, _ in loader.next_step(entries) if indices])
        k += 1
    return steps


PLAN = BatchPlan(mode='balanced', seed=1, bucket_width=0.03)


def test_one_rank_keeps_the_global_batch_and_cuts_padding():
    lengths = lognormal_lengths(98, seed=3)
    loader = make_loader(lengths, batch_size=4, entries=2)
    assert loader.set_plan(PLAN)
    assert loader.steps_to_budget(1) == 13
    steps = draw_epoch(loader, 2)
    assert [sum(map(len, s)) for s in steps] == [8] * 12 + [2]  # every step the global batch; the rest last
    assert sorted(i for s in steps for b in s for i in b) == list(range(98))
    real, padded, _ = loader.take_token_stats()
    assert 1 - real / padded < 0.05
    loader.start_next_epoch()
    again = draw_epoch(loader, 2)
    assert sorted(i for s in again for b in s for i in b) == list(range(98)) and again != steps


def test_two_ranks_share_every_step_exactly_once(monkeypatch):
    lengths = lognormal_lengths(101, seed=4)

    def every(epoch):
        return torch.randperm(101, generator=torch.Generator().manual_seed(epoch)).tolist()

    monkeypatch.setattr(distributed, 'world_size', lambda: 2)
    monkeypatch.setattr(distributed, 'gather_objects', lambda value: [value, value])
    epochs = []
    for rank in (0, 1):
        monkeypatch.setattr(distributed, 'rank', lambda rank=rank: rank)
        loader = make_loader(lengths, batch_size=3, entries=2, global_order=every)
        loader.set_plan(PLAN)
        epochs.append(draw_epoch(loader, 2))
    first, second = epochs
    assert len(first) == len(second) == 9  # ceil(101 / 12): the ranks run the same steps
    for a, b in zip(first[:-1], second[:-1]):
        assert sum(map(len, a)) == sum(map(len, b)) == 6
    union = [i for s in first + second for b in s for i in b]
    assert sorted(union) == list(range(101))


def test_a_batch_change_inside_the_epoch_lays_the_rest_out_again_and_resumes():
    lengths = lognormal_lengths(90, seed=5)
    loader = make_loader(lengths, batch_size=2, entries=1)
    loader.set_plan(PLAN)
    head = [loader.next_step(1) for _ in range(5)]
    loader.set_batch_size(4)  # growth: the rest of the epoch in steps of 4
    assert loader.redealt == {'consumed': 10, 'dealt': 80, 'world': 1}
    state = json.loads(json.dumps(loader.state_dict()))
    rest = draw_epoch(loader, 1)
    assert [sum(map(len, s)) for s in rest] == [4] * 20
    seen = [i for step in head for indices, _ in step for i in indices] + [i for s in rest for b in s for i in b]
    assert sorted(seen) == list(range(90))
    resumed = make_loader(lengths, batch_size=2, entries=1)
    resumed.load_state_dict(state)
    assert draw_epoch(resumed, 1) == rest  # the same micro-batches after a resume


def test_resume_inside_an_epoch_draws_the_same_micro_batches():
    lengths = lognormal_lengths(60, seed=6)
    full = make_loader(lengths, batch_size=3, entries=2)
    full.set_plan(PLAN)
    whole = draw_epoch(full, 2)
    part = make_loader(lengths, batch_size=3, entries=2)
    part.set_plan(PLAN)
    head = [[i for i, _ in part.next_step(2) if i] for _ in range(4)]
    state = json.loads(json.dumps(part.state_dict()))
    resumed = make_loader(lengths, batch_size=7, entries=2)
    resumed.load_state_dict(state)
    assert head + draw_epoch(resumed, 2) == whole
    assert resumed.step_spread is not None


# ---- settings ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('settings_, match', [
    ({'mode': 'balanced', 'split': 'passes', 'bucketing': False}, 'mode: balanced'),
    ({'mode': 'balanced', 'bucketing': False}, 'bucketing: true'),
    ({'padding_free': True, 'split': 'passes', 'bucketing': False}, 'padding_free: true needs split'),
    ({'mode': 'balanced', 'micro_batch_tokens': 100}, 'micro_batch_tokens'),
    ({'padding_free': 'yes'}, 'padding_free'),
])
def test_bad_settings_are_refused_naming_the_setting(settings_, match):
    with pytest.raises(ConfigError, match=match):
        LengthBatchingConfig(**settings_)


def test_balanced_plan_round_trips_and_a_stream_refuses_it():
    plan = LengthBatchingConfig(**{'mode': 'balanced', 'padding_free': True}).plan(3)
    assert plan.balanced and plan.padding_free and BatchPlan.from_json(plan.to_json()) == plan
    from swift_dynamic_callbacks.data.stream import StreamLoader
    stream = StreamLoader.__new__(StreamLoader)
    stream.plan = None
    with pytest.raises(ConfigError, match='streaming'):
        stream.set_plan(plan)


# ---- end to end ----------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_swift_sft_balanced_steps_keep_the_global_batch(tmp_path, tiny_llama):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    from swift_runs import decisions, indices_by_epoch, run_sft, sample_trace, train_logs
    n = 22
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=n))
    try:
        sdc.register(length_batching={'mode': 'balanced'}, integration={'record_samples': True})
        out = run_sft(tiny_llama, 'llama', data, str(tmp_path / 'out'), callbacks=['length_batching'], max_steps=-1,
                      num_train_epochs=1, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                      max_length=2048)
    finally:
        plugin.unregister()
    trace = sample_trace(out)
    assert sorted(indices_by_epoch(trace)[0]) == list(range(n))
    assert [sum(map(len, row['batches'])) for row in trace] == [4] * 5 + [2]  # the global batch; the rest last
    logs = train_logs(out)
    assert len(logs) == 6 and all(row['dynamic/padding_fraction'] < 0.2 for row in logs)
    [plan] = [d for d in decisions(out) if d['kind'] == 'batch_plan']
    assert plan['values']['new']['mode'] == 'balanced' and plan['values']['planned_rank_work_spread'] == 0.0


def test_resume_on_one_process_lays_two_ranks_rests_out_again(monkeypatch):
    """Two ranks stop after 3 steps; one process resumes from both states: the samples they left are laid out in
    balanced steps of the new global batch, each used once."""
    lengths = lognormal_lengths(70, seed=7)

    def every(epoch):
        return torch.randperm(70, generator=torch.Generator().manual_seed(epoch)).tolist()

    monkeypatch.setattr(distributed, 'world_size', lambda: 2)
    monkeypatch.setattr(distributed, 'gather_objects', lambda value: [value, value])
    states, seen = [], []
    for rank in (0, 1):
        monkeypatch.setattr(distributed, 'rank', lambda rank=rank: rank)
        loader = make_loader(lengths, batch_size=3, entries=1, global_order=every)
        loader.set_plan(PLAN)
        for _ in range(3):
            seen += [i for indices, _ in loader.next_step(1) for i in indices]
        states.append(json.loads(json.dumps(loader.state_dict())))
    monkeypatch.setattr(distributed, 'world_size', lambda: 1)
    monkeypatch.setattr(distributed, 'rank', lambda: 0)
    monkeypatch.setattr(distributed, 'gather_objects', lambda value: [value])
    resumed = make_loader(lengths, batch_size=3, entries=1)
    dealt = resumed.resume_from_rests(states, rank=0, world=1, batch_size=6)
    assert dealt['left_in_epoch'] == 70 - 18 and resumed.plan == PLAN
    rest = draw_epoch(resumed, 1)
    assert [sum(map(len, s)) for s in rest] == [6] * 8 + [4]  # the global batch of 6 kept, the rest last
    assert sorted(seen + [i for s in rest for b in s for i in b]) == list(range(70))
    assert resumed.step_spread == (0.0, 0.0)  # one rank: nothing to balance, but the layout's figures are there

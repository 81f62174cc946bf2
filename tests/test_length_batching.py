"""Length-aware batching: pure policies (bucketed order, token budget, rules, rank equalisation), the loader with a
plan (exactly-once, resume at the exact sample, cap changes, rank agreement), the callback, and a real swift sft run."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.callbacks.length_batching import LengthBatchingCallback, LengthBatchingConfig
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.data.elastic import ElasticDataLoader
from swift_dynamic_callbacks.data.slots import EmptyMicroBatch
from swift_dynamic_callbacks.data.rows import dataset_lengths
from swift_dynamic_callbacks.policies.length import (BatchPlan, agreed_steps, epoch_layout, equalize_steps, even_split,
                                                      greedy_pieces, over_budget, padding, padding_fraction,
                                                      plan_sizes)
from swift_dynamic_callbacks.policies.length_modes import LENGTH_MODES
from swift_dynamic_callbacks.policies.length_modes.rules import rule_size
from swift_dynamic_callbacks.state import StateError

# ---- pure policies -------------------------------------------------------------------------------------------

lengths_st = st.lists(st.integers(1, 3000), min_size=1, max_size=120)
plan_st = st.builds(
    BatchPlan,
    mode=st.sampled_from(['token_budget', 'rules']),
    max_tokens=st.integers(64, 8192),
    rules=st.sampled_from([((0, 8), (1024, 2)), ((0, 16), (256, 4), (2048, 1)), ((0, 3), )]),
    bucketing=st.booleans(),
    bucket_width=st.sampled_from([0.0, 0.05, 0.2, 1.0]),
    seed=st.integers(0, 3),
)


def cut(order, sizes):
    out, at = [], 0
    for size in sizes:
        out.append(order[at:at + size])
        at += size
    return out


def micro_batches(lengths, plan, cap, epoch=0, indices=None):
    indices = list(range(len(lengths))) if indices is None else indices
    order, chunks = epoch_layout(indices, lengths, plan, epoch)
    sizes = plan_sizes([lengths[i] for i in order], 0, chunks, plan, cap)
    return order, cut(order, sizes)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, plan=plan_st, cap=st.integers(1, 64), epoch=st.integers(0, 3))
def test_every_index_exactly_once_per_epoch(lengths, plan, cap, epoch):
    base = list(range(len(lengths)))
    random.Random(epoch).shuffle(base)  # the host's order
    order, batches = micro_batches(lengths, plan, cap, epoch, base)
    assert sorted(order) == list(range(len(lengths)))
    assert [i for b in batches for i in b] == order
    assert all(1 <= len(b) <= cap for b in batches)
    if not plan.bucketing:
        assert order == base  # the host's random order is kept


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, plan=plan_st, cap=st.integers(1, 64))
def test_no_batch_over_the_budget_unless_one_sample_is(lengths, plan, cap):
    plan = BatchPlan(**{**plan.to_json(), 'mode': 'token_budget'})
    _, batches = micro_batches(lengths, plan, cap)
    too_long = {i for i, n in enumerate(lengths) if n > plan.max_tokens}
    assert set(over_budget(lengths, plan)) == too_long  # the ones the warning record names
    for batch in batches:
        padded = len(batch) * max(lengths[i] for i in batch)
        if padded > plan.max_tokens:
            assert len(batch) == 1 and batch[0] in too_long  # alone
        assert not (len(batch) > 1 and too_long & set(batch))


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_st, plan=plan_st, cap=st.integers(1, 64))
def test_rules_bound_every_batch_by_its_longest_sample(lengths, plan, cap):
    plan = BatchPlan(**{**plan.to_json(), 'mode': 'rules'})
    _, batches = micro_batches(lengths, plan, cap)
    for batch in batches:
        assert len(batch) <= min(cap, rule_size(plan.rules, max(lengths[i] for i in batch)))


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, plan=plan_st, cap=st.integers(1, 64), epoch=st.integers(0, 3))
def test_same_seed_same_batches(lengths, plan, cap, epoch):
    assert micro_batches(lengths, plan, cap, epoch) == micro_batches(list(lengths), BatchPlan(**plan.to_json()),
                                                                     cap, epoch)


def test_epochs_and_seeds_give_different_bucketed_orders():
    rng = random.Random(0)
    lengths = [rng.randint(50, 2000) for _ in range(200)]
    plan = BatchPlan(max_tokens=4096)
    first = micro_batches(lengths, plan, 64, epoch=0)
    assert micro_batches(lengths, plan, 64, epoch=1) != first
    assert micro_batches(lengths, BatchPlan(max_tokens=4096, seed=1), 64, epoch=0) != first
    # the chunk order is shuffled: consecutive micro-batches are not sorted by length
    longest = [max(lengths[i] for i in b) for b in first[1]]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_bucketing_cuts_padding():
    rng = random.Random(3)
    lengths = [int(rng.lognormvariate(5.5, 0.8)) + 20 for _ in range(2000)]
    plan = BatchPlan(max_tokens=8192)
    bucketed = padding([[lengths[i] for i in b] for b in micro_batches(lengths, plan, 64)[1]])
    unbucketed = padding([[lengths[i] for i in b]
                          for b in micro_batches(lengths, BatchPlan(max_tokens=8192, bucketing=False), 64)[1]])
    assert padding_fraction(*bucketed) < 0.03 < 0.3 < padding_fraction(*unbucketed)


def test_seed_rules_table():
    rules = BatchPlan(mode='rules').rules
    assert rules == ((0, 8), (1024, 2))
    assert [rule_size(rules, n) for n in (1, 1024, 1025, 5000)] == [8, 8, 2, 2]
    plan = BatchPlan(mode='rules', bucketing=False)
    # short samples 8 a batch; one long sample makes its batch 2
    assert greedy_pieces([100] * 10, plan) == [8, 2]
    assert greedy_pieces([100, 2000, 100, 100], plan) == [2, 2]
    assert greedy_pieces([100] * 4, plan, cap=3) == [3, 1]


def test_token_budget_table():
    plan = BatchPlan(max_tokens=1000)
    assert greedy_pieces([100] * 12, plan) == [10, 2]
    assert greedy_pieces([100, 300, 300, 300, 2000, 50], plan) == [3, 1, 1, 1]  # 4 x 300 > 1000; 2000 alone
    assert over_budget([100, 2000, 50], plan) == [1]
    assert even_split(10, 4) == [4, 3, 3]
    assert plan_sizes([100] * 12, 0, None, plan, 4) == [4, 3, 3, 2]


def test_every_length_mode_is_one_strategy_the_settings_read():
    """``policies/length_modes/``: the settings' choices and ``reads`` table come from the registry, and the loaders,
    the integration and the settings ask a mode's properties instead of its name."""
    assert list(LENGTH_MODES) == ['token_budget', 'rules', 'balanced']
    [reads] = [r.by for r in LengthBatchingConfig.reads if r.selector == 'mode']
    assert reads == {'token_budget': ('micro_batch_tokens', ), 'rules': ('rules', ), 'balanced': ('pass_tokens', )}
    assert [m.name for m in LENGTH_MODES.values() if m.sizes_by_tokens] == ['token_budget']
    assert [m.name for m in LENGTH_MODES.values() if m.balances_steps] == ['balanced']
    for name, mode in LENGTH_MODES.items():
        plan = BatchPlan(mode=name)
        assert plan.length_mode is mode and plan.balanced == mode.balances_steps
        assert all(plan.limit(n) >= 1 for n in (1, 100, 5000))
        assert LengthBatchingConfig(mode=name).length_mode is mode
    messages = {name: BatchPlan(mode=name, max_tokens=4096, padding_free=True, bucketing=name == 'balanced')
                for name in LENGTH_MODES}
    assert {name: plan.length_mode.describe(plan) for name, plan in messages.items()} == {
        'token_budget': 'token_budget: max 4096 real tokens per micro-batch, bucketing off',
        'rules': 'rules: sizes by >0: 8, >1024: 2 per micro-batch, bucketing off',
        'balanced': 'balanced: every step the global batch, of similar lengths (jitter 0.03), ranks\' work even, '
                    'micro-batches of the per-device size'}
    with pytest.raises(ValueError, match='mode: must be one of token_budget, rules, balanced'):
        BatchPlan(mode='sorted')
    with pytest.raises(ConfigError, match="mode: must be one of 'token_budget', 'rules', 'balanced'"):
        LengthBatchingConfig(mode='sorted')
    with pytest.raises(ValueError, match='balanced has no pass limit'):
        LENGTH_MODES['balanced'].pass_limit(BatchPlan(mode='balanced'))


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1, 20), min_size=0, max_size=30), entries=st.integers(1, 4),
       extra=st.integers(0, 10))
def test_equalize_steps_splits_into_sub_batches(sizes, entries, extra):
    steps = -(-len(sizes) // entries) + extra
    if sum(sizes) < (steps - 1) * entries + 1 and steps:
        with pytest.raises(ValueError):
            equalize_steps(sizes, entries, steps)
        return
    out = equalize_steps(sizes, entries, steps)
    assert sum(out) == sum(sizes)
    assert -(-len(out) // entries) == steps or (steps == 0 and out == [])
    # every new micro-batch lies inside an old one (so it keeps the old one's budget)
    old_ends = {sum(sizes[:k]) for k in range(len(sizes) + 1)}
    new_ends = {sum(out[:k]) for k in range(len(out) + 1)}
    assert old_ends <= new_ends


def test_agreed_steps_is_the_maximum_and_checks_short_ranks():
    assert agreed_steps([(5, 40), (7, 41), (6, 40)], 2) == 4
    assert agreed_steps([(0, 0), (0, 0)], 3) == 0
    with pytest.raises(ValueError, match='rank'):
        agreed_steps([(4, 4), (2, 2)], 1)


@pytest.mark.parametrize('settings_,field', [
    ({'mode': 'sorted'}, 'mode'),
    ({'micro_batch_tokens': 0}, 'micro_batch_tokens'),
    ({'rules': {512: 4}}, 'rules'),
    ({'rules': {0: 0}}, 'rules'),
    ({'bucket_width': -0.1}, 'bucket_width'),
    ({'bucketing': 'yes'}, 'bucketing'),
    ({'seed': 1.5}, 'seed'),
    ({'split': 'rows'}, 'split'),
    ({'split': 'passes'}, 'bucketing'),  # passes keep the host's micro-batches: bucketing does not apply
    ({'split': 'passes', 'bucketing': False, 'bucket_width': 0.1}, 'bucket_width'),
])
def test_bad_config_names_the_field(settings_, field):
    with pytest.raises(ConfigError) as e:
        LengthBatchingConfig(**settings_)
    assert str(e.value).startswith(f'{field}:'), str(e.value)


def test_config_from_yaml_mapping_and_protocol_check():
    config = LengthBatchingCallback.config_from_mapping({'mode': 'rules', 'rules': {'0': 8, '1024': 2}})
    assert config.plan(7) == BatchPlan(mode='rules', rules=((0, 8), (1024, 2)), seed=7)
    with pytest.raises(ConfigError, match='length_batching: unknown'):
        LengthBatchingCallback.config_from_mapping({'budget': 3})
    with pytest.raises(ValueError, match='new_batch_plan'):
        protocol.check_batch_plan({'mode': 'token_budget', 'max_tokens': -1})


# ---- the callback --------------------------------------------------------------------------------------------


class Control:
    pass


class Args:
    data_seed = None
    seed = 5


class State:
    global_step = 0


def test_callback_requests_the_plan_once_and_survives_resume():
    cb = LengthBatchingCallback(LengthBatchingConfig(micro_batch_tokens=4096))
    control = Control()
    cb.on_train_begin(Args(), State(), control)
    request = protocol.pending_request(control)
    assert request.batch_plan == BatchPlan(max_tokens=4096, seed=5).to_json()
    [record] = protocol.drain_decisions(control)
    assert (record.source, record.kind, record.reason) == ('length_batching', 'batch_plan', 'start')
    resumed = LengthBatchingCallback(LengthBatchingConfig(micro_batch_tokens=4096))
    resumed.load_state_dict(json.loads(json.dumps(cb.state_dict())))
    control = Control()
    resumed.on_train_begin(Args(), State(), control)
    assert not protocol.has_pending_request(control)  # the loader's state already has the plan
    changed = LengthBatchingCallback(LengthBatchingConfig(micro_batch_tokens=2048))
    changed.load_state_dict(cb.state_dict())
    changed.on_train_begin(Args(), State(), control)
    assert protocol.pending_request(control).batch_plan['max_tokens'] == 2048
    assert protocol.drain_decisions(control)[0].reason == 'settings_changed'


def test_split_passes_requests_a_pass_limit_not_a_plan():
    cb = LengthBatchingCallback(LengthBatchingConfig(split='passes', bucketing=False, micro_batch_tokens=1024))
    control = Control()
    cb.on_train_begin(Args(), State(), control)
    request = protocol.pending_request(control)
    assert request.batch_plan is None and request.batch_size is None  # the micro-batches stay as configured
    assert request.pass_limit == {'samples': None, 'tokens': 1024, 'rules': []}
    [record] = protocol.drain_decisions(control)
    assert (record.kind, record.reason, record.values['new']['split']) == ('pass_limit', 'start', 'passes')
    resumed = LengthBatchingCallback(cb.config)
    resumed.load_state_dict(json.loads(json.dumps(cb.state_dict())))
    control = Control()
    resumed.on_train_begin(Args(), State(), control)
    assert not protocol.has_pending_request(control)  # the integration's state holds the limit
    rules = LengthBatchingConfig(split='passes', bucketing=False, mode='rules', rules={0: 8, 1024: 2})
    assert rules.pass_limit() == {'samples': 8, 'tokens': None, 'rules': [[1024, 2]]}


def test_split_passes_runs_under_sharded_engines():
    """Passes of a pass limit run under FSDP2 and DeepSpeed (every rank runs the same number of passes a step)."""
    from swift_dynamic_callbacks.config.engines import check_engine, requested_features
    pack = {'length_batching': {'split': 'passes', 'bucketing': False}}
    assert requested_features(pack, ['length_batching']) == {'pass_limit': 'dynamic_callbacks.length_batching.split'}
    assert requested_features({'length_batching': {}}, ['length_batching']) == {}  # micro_batches: no pass cap
    for engine in ('fsdp2', 'deepspeed', 'ddp'):
        check_engine(engine, pack, ['length_batching'])


def test_swift_dynamic_check_passes_split_passes_under_deepspeed(tmp_path, capsys):
    from swift_dynamic_callbacks import cli
    path = tmp_path / 'run.yaml'
    path.write_text('model: m\ntuner_type: lora\ndataset: d.jsonl\ncallbacks: [length_batching]\n'
                    'deepspeed: zero2\ndynamic_callbacks:\n  length_batching: {split: passes, bucketing: false}\n')
    assert cli.main(['check', str(path)]) == 0
    capsys.readouterr()
    path.write_text(path.read_text().replace('callbacks: [length_batching]',
                                             'callbacks: [length_batching, memory_backoff]')
                    + '  memory_backoff: {probe: cpu, cpu_budget_gib: 8.0}\n')
    assert cli.main(['check', str(path)]) == 2
    assert ('length_batching.split: passes sets the pass limit, which memory_backoff also sets'
            in capsys.readouterr().err)


# ---- the loader ----------------------------------------------------------------------------------------------


class LengthDataset(Dataset):
    """Item i is ``{'input_ids': [i] * length_i}`` (module level so it pickles into workers)."""

    def __init__(self, lengths):
        self.lengths_ = list(lengths)

    def __len__(self):
        return len(self.lengths_)

    def __getitem__(self, i):
        return {'input_ids': [i] * self.lengths_[i]}


def collate(items):
    return [item['input_ids'][0] if item['input_ids'] else None for item in items]


def random_lengths(n, seed=0):
    rng = random.Random(seed)
    return [int(rng.lognormvariate(5, 0.9)) + 5 for _ in range(n)]


def make_loader(lengths, *, batch_size=8, entries=1, seed=0, **kwargs):
    def order(epoch):
        return torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed * 100 + epoch)).tolist()

    dataset = LengthDataset(lengths)
    return ElasticDataLoader(dataset, collate, order, batch_size=batch_size, entries_per_step=entries,
                             loader_kwargs=kwargs or None, lengths=lambda: dataset_lengths(dataset))


def draw_epoch(loader, entries, sizes_by_step=None):
    """All (indices) micro-batches of the rest of the epoch, checking each collated batch holds its indices."""
    batches, k = [], 0
    while not loader.epoch_complete:
        if sizes_by_step:
            loader.set_batch_size(sizes_by_step[k % len(sizes_by_step)])
        out = loader.next_step(entries)
        assert len(out) == entries
        for indices, batch in out:
            if not indices:
                assert isinstance(batch, EmptyMicroBatch)
                continue
            assert batch == indices
            batches.append(indices)
        assert out[-1][0], 'the last micro-batch of a step (the DDP sync point) is never empty'
        k += 1
    return batches, k


@pytest.mark.parametrize('bucketing', [True, False])
def test_loader_plan_exactly_once_within_budget_across_epochs(bucketing):
    lengths = random_lengths(97)
    loader = make_loader(lengths, batch_size=16, entries=2)
    plan = BatchPlan(max_tokens=1024, bucketing=bucketing, seed=3)
    assert loader.set_plan(plan) and not loader.set_plan(plan)
    orders = []
    for epoch in range(3):
        steps_expected = loader.steps_to_budget(epoch + 1)
        batches, steps = draw_epoch(loader, 2)
        assert steps == steps_expected
        assert sorted(i for b in batches for i in b) == list(range(97))
        for b in batches:
            assert len(b) <= 16
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 1024
        orders.append([i for b in batches for i in b])
        real, padded, count = loader.take_token_stats()
        assert count == len(batches) and real == sum(lengths)
        loader.start_next_epoch()
    assert orders[0] != orders[1] != orders[2]


@pytest.mark.parametrize('plan', [BatchPlan(max_tokens=1024, bucketing=True, seed=3), BatchPlan(max_tokens=1024),
                                  BatchPlan(mode='balanced', seed=1, bucket_width=0.03)])
def test_a_resume_by_step_arithmetic_plans_the_rest_of_the_epoch_again(plan):
    """A checkpoint without the pack's state (``skip_to``) under an active plan: the rest of the epoch is planned from
    the new position, each of its samples once (before, the plan of the whole epoch ran on past the epoch's end)."""
    lengths = random_lengths(97)
    loader = make_loader(lengths, batch_size=8, entries=2)
    loader.set_plan(plan)
    rest = {}
    for epoch in (1, 2):  # the samples after position 32 in epochs 1 and 2, drawn from the start
        loader.start_next_epoch()
        rest[epoch] = set(loader.shard.order[32:])
    resumed = make_loader(lengths, batch_size=8, entries=2)
    resumed.set_plan(plan)
    resumed.skip_to(97 + 32)  # 8 steps of 16 samples
    assert (resumed.epoch, resumed.position) == (1, 32)
    batches, _ = draw_epoch(resumed, 2)
    drawn = [i for b in batches for i in b]
    assert len(drawn) == len(set(drawn)) == 97 - 32 and set(drawn) == rest[1]
    further = make_loader(lengths, batch_size=8, entries=2)  # two epochs on: straight there, planned once
    further.set_plan(plan)
    plans = []
    replan = further._replan
    further._replan = lambda: (plans.append(further.epoch), replan())[1]
    further.skip_to(2 * 97 + 32)
    assert (further.epoch, further.position, plans) == (2, 32, [2])
    batches, _ = draw_epoch(further, 2)
    assert sorted(i for b in batches for i in b) == sorted(rest[2])


def test_loader_cap_change_replans_the_rest_exactly_once():
    lengths = random_lengths(120, seed=1)
    loader = make_loader(lengths, batch_size=16)
    loader.set_plan(BatchPlan(max_tokens=2048))
    batches, _ = draw_epoch(loader, 1, sizes_by_step=[16, 16, 3, 5, 2, 16])
    assert sorted(i for b in batches for i in b) == list(range(120))
    assert any(len(b) > 5 for b in batches) and all(len(b) <= 16 for b in batches)


def test_plan_set_mid_epoch_keeps_the_rest_of_the_order():
    lengths = random_lengths(40, seed=2)
    loader = make_loader(lengths, batch_size=4)
    first = loader.next_step(1)[0][0]
    order = loader.layout.epoch_order(0)
    loader.set_plan(BatchPlan(max_tokens=800))
    assert not loader.order_bucketed
    rest, _ = draw_epoch(loader, 1)
    assert first + [i for b in rest for i in b] == order
    loader.start_next_epoch()
    assert loader.order_bucketed


@pytest.mark.parametrize('at_step', [0, 3, 7])
def test_plan_state_resumes_at_the_exact_sample(at_step):
    lengths = random_lengths(60, seed=4)
    plan = BatchPlan(max_tokens=900, seed=1)
    full = make_loader(lengths, batch_size=12, entries=2)
    full.set_plan(plan)
    full_batches, _ = draw_epoch(full, 2)
    full.start_next_epoch()
    full_next, _ = draw_epoch(full, 2)

    part = make_loader(lengths, batch_size=12, entries=2)
    part.set_plan(plan)
    seen = []
    for _ in range(at_step):
        seen += [i for i, _ in part.next_step(2) if i]
    state = json.loads(json.dumps(part.state_dict()))
    assert state['plan'] == plan.to_json() and state['position'] == sum(len(b) for b in seen)

    resumed = make_loader(lengths, batch_size=5, entries=2)  # no plan yet, another batch size: state decides
    resumed.load_state_dict(state)
    assert resumed.plan == plan and resumed.state_dict() == state
    rest, _ = draw_epoch(resumed, 2)
    assert seen + rest == full_batches  # the same micro-batches, from the exact sample on
    resumed.start_next_epoch()
    assert draw_epoch(resumed, 2)[0] == full_next


def test_plan_state_with_wrong_sizes_raises():
    loader = make_loader(random_lengths(20), batch_size=4)
    loader.set_plan(BatchPlan(max_tokens=500))
    state = loader.state_dict()
    state['plan_sizes'] = [[1, 3]]
    with pytest.raises(StateError, match='planned micro-batches'):
        make_loader(random_lengths(20), batch_size=4).load_state_dict(state)


def test_ranks_agree_on_the_steps_of_the_epoch(monkeypatch):
    """A rank that plans fewer micro-batches splits its largest ones until it runs as many steps as the others."""
    from swift_dynamic_callbacks import distributed
    lengths = random_lengths(50, seed=5)
    loader = make_loader(lengths, batch_size=16, entries=2)
    gathered = []

    def gather(value):
        gathered.append(value)
        return [value, (value[0] + 9, value[1] + 1)]  # another rank needs 9 more micro-batches

    monkeypatch.setattr(distributed, 'gather_objects', gather)
    loader.set_plan(BatchPlan(max_tokens=1024, seed=2))
    own = gathered[-1][0]
    steps = -(-(own + 9) // 2)
    batches, drawn_steps = draw_epoch(loader, 2)
    assert drawn_steps == steps
    assert sorted(i for b in batches for i in b) == list(range(50))
    assert all(len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 1024 for b in batches)


def test_loader_plan_with_workers():
    lengths = random_lengths(30, seed=6)
    loader = make_loader(lengths, batch_size=6, num_workers=1, persistent_workers=False)
    try:
        loader.set_plan(BatchPlan(max_tokens=700))
        batches, _ = draw_epoch(loader, 1, sizes_by_step=[6, 6, 2])
        assert sorted(i for b in batches for i in b) == list(range(30))
    finally:
        loader.close()


def test_dataset_lengths_from_columns_or_measured_once():
    class Columns(list):
        column_names = ['input_ids', 'lengths']

        def __getitem__(self, key):
            return [[3, 9], 4, 7] if key == 'lengths' else super().__getitem__(key)

    # a list per row: one entry a row, each padded to the longest
    assert dataset_lengths(Columns([0, 1, 2])) == [18, 4, 7]

    class Counting(LengthDataset):
        reads = 0

        def __getitem__(self, i):
            type(self).reads += 1
            return super().__getitem__(i)

    dataset = Counting([5, 2, 8])
    assert dataset_lengths(dataset) == [5, 2, 8] and Counting.reads == 3
    assert dataset_lengths(dataset) == [5, 2, 8] and Counting.reads == 3  # cached with the dataset


# ---- end to end ----------------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_token_budget_run_covers_every_sample_once_and_logs_padding(tmp_path, tiny_llama):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    from swift_runs import decisions, indices_by_epoch, run_sft, sample_trace, train_logs
    n, budget = 12, 1200  # rows of ~100 to ~1,300 tokens: some are over the budget
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=n))
    try:
        sdc.register(length_batching={'max_tokens': budget}, integration={'record_samples': True})
        out = run_sft(tiny_llama, 'llama', data, str(tmp_path / 'out'), callbacks=['length_batching'], max_steps=-1,
                      num_train_epochs=1, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                      lr_scheduler_type='linear', max_length=2048)
    finally:
        plugin.unregister()
    trace = sample_trace(out)
    assert sorted(indices_by_epoch(trace)[0]) == list(range(n))  # exactly once
    batches = [row['batches'][0] for row in trace]  # gradient_accumulation_steps 1: one micro-batch a step
    assert max(map(len, batches)) > 1  # the size follows the lengths
    logs = train_logs(out)
    assert len(logs) == len(trace)  # the LR horizon / max_steps follow the plan: one epoch, every step logged
    assert logs[-1]['learning_rate'] < logs[0]['learning_rate']
    records = decisions(out)
    [plan] = [d for d in records if d['kind'] == 'batch_plan']
    assert plan['source'] == 'length_batching' and plan['values']['new']['max_tokens'] == budget
    assert plan['values']['micro_batches_left'] == len(trace)
    [warning] = [d for d in records if d['kind'] == 'over_budget']
    assert warning['values']['samples'] >= 1 and warning['values']['longest'] > budget
    for batch, row in zip(batches, logs):
        assert 0 <= row['dynamic/padding_fraction'] < 1
        if row['dynamic/tokens_per_batch'] > budget:  # only a sample over the budget, alone
            assert len(batch) == 1 and batch[0] in warning['values']['indices']
    # the logged padding, summed over the epoch, is the padding the plan announced
    real = sum(row['dynamic/tokens_per_batch'] * (1 - row['dynamic/padding_fraction']) for row in logs)
    padded = sum(row['dynamic/tokens_per_batch'] for row in logs)
    assert 1 - real / padded == pytest.approx(plan['values']['planned_padding_fraction'], abs=1e-3)


@pytest.mark.e2e
def test_split_passes_keeps_the_samples_per_step_and_cuts_passes(tmp_path, tiny_llama):
    """verl-style dynamic batch size: every optimizer step takes batch x accumulation samples (as without the
    pack), long micro-batches run as several passes under the token budget; the epoch has the same steps."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    from swift_runs import decisions, indices_by_epoch, run_sft, sample_trace, train_logs
    n, budget, batch = 12, 1500, 4
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=n))
    try:
        sdc.register(length_batching={'split': 'passes', 'bucketing': False, 'max_tokens': budget},
                     integration={'record_samples': True})
        out = run_sft(tiny_llama, 'llama', data, str(tmp_path / 'out'), callbacks=['length_batching'], max_steps=-1,
                      num_train_epochs=1, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                      max_length=2048)
    finally:
        plugin.unregister()
    trace = sample_trace(out)
    assert sorted(indices_by_epoch(trace)[0]) == list(range(n))  # exactly once
    assert [len(row['batches'][0]) for row in trace] == [batch] * (n // batch)  # samples a step: as configured
    logs = train_logs(out)
    assert len(logs) == n // batch
    assert min(row['dynamic/pass_size'] for row in logs) < batch  # long rows: the micro-batch ran in passes
    assert all(row['dynamic/batch_size'] == batch for row in logs)
    [record] = [d for d in decisions(out) if d['source'] == 'length_batching']
    assert record['kind'] == 'pass_limit' and record['values']['new']['tokens'] == budget

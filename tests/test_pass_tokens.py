"""Balanced steps cut into passes by a token budget (``length_batching`` ``mode: balanced``, ``pass_tokens``): the pure
cut, the slots HF runs, the loader (the same steps as plain balanced steps, exact resume, a batch change, the row cap
of ``num_pieces``), the settings and engines that refuse it, and real swift sft runs whose gradient is the one of the
same steps in micro-batches of the per-device size, with and without injected OOMs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swift_dynamic_callbacks import distributed
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.config.length_batching import LengthBatchingConfig
from swift_dynamic_callbacks.data.slots import EmptyMicroBatch, PassGroup, slot_batches
from swift_dynamic_callbacks.policies.balance import pass_slots, step_passes
from swift_dynamic_callbacks.policies.pass_cost import pass_cost
from swift_dynamic_callbacks.policies.length import BatchPlan
from test_balanced_steps import lognormal_lengths, make_loader

# ---- pure policy ---------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), max_size=80), per_step=st.integers(1, 20),
       budget=st.integers(1, 8000), padding_free=st.booleans(), max_rows=st.one_of(st.none(), st.integers(1, 8)))
def test_passes_partition_each_step_within_the_budget_and_no_pass_could_take_the_next_row(
        lengths, per_step, budget, padding_free, max_rows):
    steps = step_passes(lengths, per_step, budget, padding_free=padding_free, max_rows=max_rows)
    assert len(steps) == -(-len(lengths) // per_step)
    start = 0
    for k, passes in enumerate(steps):
        share = lengths[k * per_step:(k + 1) * per_step]
        assert sum(passes) == len(share) and all(p >= 1 for p in passes)
        rows = 0
        for i, p in enumerate(passes):
            chunk = share[rows:rows + p]
            assert p == 1 or pass_cost(chunk, packed=padding_free) <= budget  # a row over it runs alone
            assert max_rows is None or p <= max_rows
            if i + 1 < len(passes):  # greedy: the next row did not fit
                grown = share[rows:rows + p + 1]
                assert (max_rows is not None and p == max_rows) or pass_cost(grown, packed=padding_free) > budget
            rows += p
        start += len(share)
    assert start == len(lengths)


@given(passes=st.integers(0, 40), entries=st.integers(1, 16))
def test_slots_hold_every_pass_empty_ones_first_and_the_last_slot_runs(passes, entries):
    slots = pass_slots(passes, entries)
    assert len(slots) == entries and sum(slots) == passes and list(slots) == sorted(slots)
    assert max(slots) - min(slots) <= 1
    assert passes == 0 or slots[-1] >= 1  # the slot whose backward synchronises gradients always runs a pass


def test_cost_and_cut_by_hand():
    assert pass_cost([300, 200, 100], packed=False) == 900
    assert pass_cost([300, 200, 100], packed=True) == 600
    assert step_passes([500, 400, 300, 300, 200, 100, 100, 50], 4, 1000) == [[2, 2], [4]]
    assert step_passes([3000, 10], 8, 1000) == [[1, 1]]  # too long for the budget: alone, never dropped
    assert step_passes([5] * 10, 10, 1000, max_rows=3) == [[3, 3, 3, 1]]
    with pytest.raises(ValueError, match='per_step, budget'):
        step_passes([1], 1, 0)


# ---- the loader ----------------------------------------------------------------------------------------------

PLAN = BatchPlan(mode='balanced', seed=1, bucket_width=0.03)


def passes_plan(tokens, **kw):
    return BatchPlan(mode='balanced', seed=1, bucket_width=0.03, pass_tokens=tokens, **kw)


def draw_slots(loader, entries):
    """Every step's slots as drawn: ``(indices, batch)`` pairs."""
    steps = []
    while not loader.epoch_complete:
        steps.append(loader.next_step(entries))
    return steps


def step_indices(slots):
    return sorted(i for indices, _ in slots for i in indices)


@pytest.mark.parametrize('tokens', [600, 2000, 20000])
def test_the_same_steps_as_balanced_micro_batches_in_fewer_or_more_passes(tokens):
    lengths = lognormal_lengths(98, seed=3)
    plain = make_loader(lengths, batch_size=4, entries=2)
    plain.set_plan(PLAN)
    cut = make_loader(lengths, batch_size=4, entries=2)
    cut.set_plan(passes_plan(tokens))
    assert cut.steps_to_budget(1) == plain.steps_to_budget(1) == 13
    plain_steps, cut_steps = draw_slots(plain, 2), draw_slots(cut, 2)
    assert [step_indices(s) for s in cut_steps] == [step_indices(s) for s in plain_steps]
    counts = []
    for slots in cut_steps:
        assert len(slots) == 2  # HF's slots: gradient_accumulation_steps of them, whatever they hold
        assert isinstance(slots[-1][1], (list, PassGroup)) and slots[-1][0]  # the last slot runs
        passes = [batch for _, slot in slots for batch in slot_batches(slot)]
        counts.append(len(passes))
        for batch in passes:
            assert len(batch) == 1 or pass_cost([lengths[i] for i in batch], packed=False) <= tokens
        for indices, slot in slots:
            assert isinstance(slot, EmptyMicroBatch) == (not indices)
            assert [i for b in slot_batches(slot) for i in b] == indices
    if tokens == 20000:  # short rows: the whole step in one pass, the first slot empty
        assert max(counts) == 1 and all(isinstance(s[0][1], EmptyMicroBatch) for s in cut_steps)
    if tokens == 600:  # long rows: more passes than slots, some slot holds several
        assert max(counts) > 2 and any(isinstance(slot, PassGroup) for s in cut_steps for _, slot in s)
    real, padded, passes = cut.take_token_stats()
    assert passes == sum(counts) and real <= padded


def test_two_ranks_cut_their_own_passes_and_run_the_same_steps(monkeypatch):
    lengths = lognormal_lengths(101, seed=4)

    def every(epoch):
        return torch.randperm(101, generator=torch.Generator().manual_seed(epoch)).tolist()

    monkeypatch.setattr(distributed, 'world_size', lambda: 2)
    shares = {}
    for rank in (0, 1):  # the ranks' step counts agree through gather_objects; fake it with both ranks' values
        monkeypatch.setattr(distributed, 'rank', lambda rank=rank: rank)
        monkeypatch.setattr(distributed, 'gather_objects', lambda value: [value, value])
        loader = make_loader(lengths, batch_size=3, entries=2, global_order=every)
        loader.set_plan(passes_plan(900))
        shares[rank] = draw_slots(loader, 2)
    assert len(shares[0]) == len(shares[1]) == 9
    union = [i for r in (0, 1) for slots in shares[r] for i in step_indices(slots)]
    assert sorted(union) == list(range(101))


def test_resume_inside_an_epoch_draws_the_same_passes():
    lengths = lognormal_lengths(60, seed=6)
    full = make_loader(lengths, batch_size=3, entries=2)
    full.set_plan(passes_plan(700))
    whole = [[i for i, _ in s] for s in draw_slots(full, 2)]
    part = make_loader(lengths, batch_size=3, entries=2)
    part.set_plan(passes_plan(700))
    head = [[i for i, _ in part.next_step(2)] for _ in range(4)]
    state = json.loads(json.dumps(part.state_dict()))
    assert 'plan_passes' in state
    resumed = make_loader(lengths, batch_size=7, entries=2)
    resumed.load_state_dict(state)
    assert head + [[i for i, _ in s] for s in draw_slots(resumed, 2)] == whole
    state['plan_passes'] = [[1, 1]]
    with pytest.raises(Exception, match='corrupt loader state'):
        make_loader(lengths, batch_size=3, entries=2).load_state_dict(state)


def test_a_batch_change_makes_larger_passes_and_keeps_every_sample_once():
    lengths = lognormal_lengths(90, seed=5)
    loader = make_loader(lengths, batch_size=2, entries=2)
    loader.set_plan(passes_plan(4000))
    head = [loader.next_step(2) for _ in range(5)]
    before = [len([b for _, s in slots for b in slot_batches(s)]) for slots in head]
    loader.set_batch_size(8)  # growth: steps of 16 samples, laid out again; a pass holds more rows, not more passes
    rest = draw_slots(loader, 2)
    seen = [i for slots in head + rest for i in step_indices(slots)]
    assert sorted(seen) == list(range(90))
    assert [len(step_indices(s)) for s in rest] == [16] * 4 + [6]
    rows_before = [len(b) for slots in head for _, s in slots for b in slot_batches(s)]
    rows = [len(b) for slots in rest for _, s in slots for b in slot_batches(s)]
    assert max(rows_before) <= 4 < max(rows)  # larger passes
    assert len(rows) / len(rest) < 4 * max(before)  # fewer than 4 times the passes for 4 times the samples


def test_num_pieces_caps_the_rows_of_a_pass():
    lengths = [50] * 32
    loader = make_loader(lengths, batch_size=8, entries=2)
    loader.set_plan(passes_plan(100000))
    assert [len(b) for _, s in loader.next_step(2) for b in slot_batches(s)] == [16]
    loader.set_num_pieces(4)  # a micro-batch cap of 2 rows (8 / 4): the runner cuts nothing more
    assert loader.pass_pieces == 1
    assert [len(b) for _, s in loader.next_step(2) for b in slot_batches(s)] == [2] * 8


# ---- settings and engines ------------------------------------------------------------------------------------

def test_pass_tokens_is_a_balanced_setting_and_runs_under_every_engine():
    with pytest.raises(ConfigError, match='pass_tokens: only read by mode: balanced'):
        LengthBatchingConfig(pass_tokens=4096)
    with pytest.raises(ConfigError, match='pass_tokens'):
        LengthBatchingConfig(mode='balanced', pass_tokens=0)
    with pytest.raises(ValueError, match='pass_tokens'):
        BatchPlan(mode='rules', pass_tokens=10)
    plan = LengthBatchingConfig(mode='balanced', pass_tokens=4096).plan(0)
    assert plan.cuts_passes and BatchPlan.from_json(plan.to_json()) == plan
    assert 'pass_tokens' not in PLAN.to_json()  # plans without it are written as before
    from swift_dynamic_callbacks.config.engines import check_engine
    pack = {'length_batching': {'mode': 'balanced', 'pass_tokens': 4096}}
    for engine in ('fsdp2', 'deepspeed', 'ddp'):  # every rank the same number of passes under the sharded ones
        check_engine(engine, pack, ['length_batching'])


# ---- end to end ----------------------------------------------------------------------------------------------

RUN = dict(max_steps=-1, num_train_epochs=1, per_device_train_batch_size=2, gradient_accumulation_steps=2,
           max_length=2048, lora_dropout=0.0, learning_rate=1e-3, lr_scheduler_type='constant', warmup_ratio=0.0,
           save_steps=1000, include_num_input_tokens_seen='non_padding')


def _train(tmp_path, model, data, name, length_batching, injector=None):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_runs import run_sft
    injector = injector or OomInjector()
    try:
        sdc.register(length_batching=length_batching, integration={'record_samples': True})
        with injector:
            out = run_sft(model, 'llama', data, str(tmp_path / name), callbacks=['length_batching'], **RUN)
    finally:
        plugin.unregister()
    return out, injector


def _adapter(out):
    from safetensors.torch import load_file
    [ckpt] = [d for d in os.listdir(out) if d.startswith('checkpoint-')]
    return load_file(os.path.join(out, ckpt, 'adapter_model.safetensors'))


def _trainer_state(out):
    [ckpt] = [d for d in os.listdir(out) if d.startswith('checkpoint-')]
    with open(os.path.join(out, ckpt, 'trainer_state.json'), encoding='utf-8') as f:
        return json.load(f)


def _same_training(a, b):
    from swift_runs import sample_trace, train_logs
    steps = [[sorted(i for batch in row['batches'] for i in batch)] for row in sample_trace(a)]
    assert steps == [[sorted(i for batch in row['batches'] for i in batch)] for row in sample_trace(b)]
    assert [r['loss'] for r in train_logs(a)] == pytest.approx([r['loss'] for r in train_logs(b)], rel=2e-4)
    first, second = _adapter(a), _adapter(b)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.allclose(first[key], second[key], atol=2e-5, rtol=0), key


@pytest.fixture(scope='module')
def mixed_rows(tmp_path_factory):
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    return str(write_mixed_length_dataset(tmp_path_factory.mktemp('pass_tokens') / 'mixed.jsonl', n=16))


@pytest.fixture(scope='module')
def padded_runs(tmp_path_factory, tiny_llama, mixed_rows):
    """The same balanced steps as micro-batches of the per-device size and as passes of at most 1,200 tokens."""
    root = tmp_path_factory.mktemp('padded')
    plain, _ = _train(root, tiny_llama, mixed_rows, 'plain', {'mode': 'balanced'})
    cut, injector = _train(root, tiny_llama, mixed_rows, 'cut', {'mode': 'balanced', 'pass_tokens': 1200})
    return plain, cut, injector


@pytest.mark.e2e
@pytest.mark.parametrize('padding_free', [False, True])
def test_swift_sft_passes_by_tokens_give_the_gradient_of_the_same_steps(tmp_path, tiny_llama, mixed_rows,
                                                                        padded_runs, padding_free):
    """The same steps run as micro-batches of the per-device size and as passes of at most 1,200 tokens: the same
    samples every step, the same losses and final LoRA weights; passes within the budget (a row over it alone),
    fewer than gradient_accumulation_steps where rows are short and more where they are long, as logged."""
    from swift_runs import decisions, train_logs
    if padding_free:
        base = {'mode': 'balanced', 'padding_free': True}
        plain, _ = _train(tmp_path, tiny_llama, mixed_rows, 'plain', base)
        cut, injector = _train(tmp_path, tiny_llama, mixed_rows, 'cut', {**base, 'pass_tokens': 1200})
    else:
        plain, cut, injector = padded_runs
    _same_training(plain, cut)
    for rows, tokens in injector.passes:  # what ran: (rows, tokens) of every forward
        assert rows == 1 or tokens <= 1200, (rows, tokens)
    logged = [row['dynamic/passes_per_step'] for row in train_logs(cut)]
    assert sum(logged) == len(injector.passes)  # one log line a step: the passes it ran
    ga = RUN['gradient_accumulation_steps']
    assert min(logged) < ga < max(logged)
    assert {row['dynamic/passes_per_step'] for row in train_logs(plain)} == {float(ga)}
    [plan] = [d for d in decisions(cut) if d['kind'] == 'batch_plan']
    assert plan['values']['new']['pass_tokens'] == 1200
    import transformers
    counted_per_slot = hasattr(transformers.Trainer, '_track_num_input_tokens')  # transformers 4.57 counts inline
    if not padding_free and counted_per_slot:  # HF's own counters: every pass of a several-pass slot, none of empty
        plain_state, cut_state = _trainer_state(plain), _trainer_state(cut)
        assert cut_state['num_input_tokens_seen'] == plain_state['num_input_tokens_seen'] == int(
            train_logs(cut)[-1]['dynamic/tokens_seen'])
        assert cut_state['total_flos'] > 0.9 * plain_state['total_flos']  # padding differs, the work does not


@pytest.mark.e2e
def test_swift_sft_passes_by_tokens_recover_from_ooms_with_the_same_result(tmp_path, tiny_llama, mixed_rows,
                                                                           padded_runs):
    """OOMs inside passes cut by tokens (a forward and a mid-backward one, in steps whose slots hold several passes):
    the run finishes with every sample once and the weights of the same run without them."""
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_runs import decisions, train_logs
    _, cut, _ = padded_runs
    out, injector = _train(tmp_path, tiny_llama, mixed_rows, 'oom', {'mode': 'balanced', 'pass_tokens': 1200},
                           OomInjector(forward_passes=(1, ), fail_passes=(4, )))
    assert injector.counts == {'forward': 1, 'backward': 1}, (injector.counts, injector.passes)
    assert [d for d in decisions(out) if d['kind'] == 'oom'] and train_logs(out)[-1]['dynamic/oom_count'] == 2
    _same_training(cut, out)

"""Two-process ``swift sft`` runs under real DDP on CPU (torchrun, gloo, ``use_cpu: true``): every pack decision is
agreed by both ranks.

Each test launches ``tests/distributed_driver.py`` through ``engine_runs.run_ranks`` on the tiny Qwen2 model and a
15-sample dataset (shards of 8 and 7 samples: the uneven case), under a timeout that kills the process group. Every
rank writes ``rank<R>.trace.json`` (the engine it trained under, its decision records and what the integration applied
at every step); ``dynamic_samples.rank<R>.jsonl`` holds the dataset indices each rank trained on. Every test asserts
the engine (``MULTI_CPU`` + ``DistributedDataParallel``: ``ddp_backend: gloo`` alone would give ``DistributedType.NO``,
no wrapper and no gradient averaging, which the pack now refuses) and that both ranks end with equal weights.
The weights-equal-one-process comparisons, the other engines and resume are in ``test_engines.py``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from engine_runs import assert_engine, assert_same_weights, decision_keys, run_ranks
from swift_runs import indices_by_epoch, read_jsonl, sample_trace

pytestmark = [pytest.mark.distributed, pytest.mark.engines, pytest.mark.e2e]

N_SAMPLES = 15  # odd: rank 0 gets 8 samples an epoch, rank 1 gets 7
ALL = ['batch_schedule', 'lr_schedule', 'memory_backoff', 'early_stopping', 'checkpoint_rotation', 'training_log']


@pytest.fixture(scope='module')
def dataset_15(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    return str(write_gsm8k_dataset(fixture_dir / 'gsm8k-15.jsonl', N_SAMPLES))


def run_two_ranks(tmp_path, model: str, dataset: str, *, callbacks: list[str], pack: dict[str, Any],
                  faults: dict[str, Any] | None = None, **sft: Any) -> str:
    """Both ranks under DDP; returns the output directory after checking the engine and equal weights."""
    out = run_ranks(str(tmp_path), model, dataset, engine='ddp', callbacks=callbacks, pack=pack, faults=faults, **sft)
    assert_engine(out, 'ddp')
    assert_same_weights(out)
    return out


def traces(out: str) -> list[dict[str, Any]]:
    return assert_engine(out, 'ddp')


def assert_same_steps(t0: dict[str, Any], t1: dict[str, Any]) -> None:
    """Same optimizer steps, and at each the same batch size, pieces, pass limit, LR and data epoch."""
    assert t0['global_step'] == t1['global_step'] and len(t0['steps']) == len(t1['steps'])
    assert [s['step'] for s in t0['steps']] == list(range(t0['global_step'] - len(t0['steps']) + 1,
                                                           t0['global_step'] + 1))
    applied = [[{k: v for k, v in s.items() if k != 'samples'} for s in t['steps']] for t in (t0, t1)]
    assert applied[0] == applied[1]


def assert_exactly_once(out: str, epochs: int) -> None:
    """Per epoch, the two ranks' samples are disjoint and together the dataset exactly once."""
    by_rank = [indices_by_epoch(sample_trace(out, rank)) for rank in (0, 1)]
    for epoch in range(epochs):
        a, b = by_rank[0].get(epoch, []), by_rank[1].get(epoch, [])
        assert not set(a) & set(b), f'epoch {epoch}: ranks share samples'
        assert sorted(a + b) == list(range(N_SAMPLES)), f'epoch {epoch}: not the dataset exactly once'
    assert set(by_rank[0]) | set(by_rank[1]) == set(range(epochs))


def test_all_callbacks_agree_at_every_step(tmp_path, tiny_llama, dataset_15):
    """Every pack callback on, changes forced at chosen steps: a batch-size table that shrinks to 1 (so rank 1's
    shard runs out a step before rank 0's: a placeholder step), LR restarts (a plateau judged on each rank's own
    loss), memory pressure seen by rank 1 only, checkpoint rotation. Both ranks apply the same thing at every
    step, run the same number of steps, and use every sample once per epoch; only rank 0 deletes checkpoints."""
    pack = {
        'integration': {'record_samples': True},
        'batch_schedule': {'schedule': {0: 2, 3: 1}},
        'lr_schedule': {'warmup': 1, 'hold': 0, 'min_delta': 1.0e9, 'patience': 2, 'cooldown': 0, 'smooth': 1,
                        'max_restarts': 2},
        'memory_backoff': {'clean_steps': 2},
        'early_stopping': {'monitor': 'loss', 'patience': 1000},
        'checkpoint_rotation': {'keep_last': 1, 'keep_best': 0},
        'training_log': {},
    }
    out = run_two_ranks(tmp_path, tiny_llama, dataset_15, callbacks=ALL, pack=pack,
                        faults={'1': {'memory': {2: 0.95}}}, num_train_epochs=2, max_steps=-1, save_steps=3)
    t0, t1 = traces(out)
    assert_same_steps(t0, t1)
    assert t0['global_step'] == 13  # 3 steps of 2 samples, then 1 a step: ceil(8 / 1) ... on the larger shard
    assert [s['samples'] for s in t1['steps']].count(0) == 2  # rank 1: one placeholder step at each epoch's end
    assert_exactly_once(out, epochs=2)
    # the same decisions on both ranks (deletions are rank 0's alone: files are written by rank 0 only)
    assert decision_keys(t0, skip_kinds=('delete_checkpoint', )) == decision_keys(t1)
    kinds = {(d['source'], d['kind']) for d in t0['decisions']}
    assert {('lr_schedule', 'lr_restart'), ('memory_backoff', 'pass_limit'), ('batch_schedule', 'batch_size'),
            ('integration', 'stop')} <= kinds
    backoff = [s['step'] for s in t0['steps'] if (s['pass_limit'] or {}).get('samples') == 1]
    assert backoff and backoff[0] == 3  # rank 1's pressure at the end of step 2: both ranks cap from step 3
    assert not [d for d in t1['decisions'] if d['kind'] == 'delete_checkpoint']
    written = read_jsonl(os.path.join(out, 'dynamic_decisions.jsonl'))
    assert [d['kind'] for d in written] == [d['kind'] for d in t0['decisions']]
    assert os.listdir(out).count('dynamic_decisions.jsonl') == 1 and not any(
        n.startswith('dynamic_decisions.rank') for n in os.listdir(out))
    assert sorted(n for n in os.listdir(out) if n.startswith('checkpoint-')) == ['checkpoint-13']


def test_oom_on_rank_1_backs_off_both_ranks(tmp_path, tiny_llama, dataset_15):
    """Rank 1 alone runs out of memory (passes of more than 500 padded tokens): it recovers, and from the next step
    on both ranks run with the same pass cap (the same budget, folded from rank 1's OOM on both ranks, grown back
    alike); rank 0's decision log holds rank 1's OOM record and the budget's."""
    pack = {'integration': {'record_samples': True}, 'batch_schedule': {'schedule': {0: 2}},
            'memory_backoff': {'clean_steps': 100}}
    out = run_two_ranks(tmp_path, tiny_llama, dataset_15, callbacks=['batch_schedule', 'memory_backoff'], pack=pack,
                        faults={'1': {'oom_token_budget': 500}}, max_steps=4, gradient_accumulation_steps=2)
    with open(os.path.join(out, 'rank1.injected.json'), encoding='utf-8') as f:
        assert json.load(f)['forward'] >= 1
    assert not os.path.exists(os.path.join(out, 'rank0.injected.json'))
    t0, t1 = traces(out)
    assert_same_steps(t0, t1)
    assert t0['global_step'] == 4
    caps = [(s['pass_limit'] or {}).get('samples') for s in t0['steps']]
    assert caps[0] is None and 1 in caps  # capped after rank 1's OOM (the same on both ranks: assert_same_steps)
    assert decision_keys(t0) == decision_keys(t1)
    records = read_jsonl(os.path.join(out, 'dynamic_decisions.jsonl'))
    ooms = [d for d in records if d['kind'] == 'oom']
    assert ooms and {d['values']['rank'] for d in ooms} == {1}
    budgets = [d for d in records if d['kind'] == 'pass_budget']
    assert budgets[0]['reason'] == 'oom' and budgets[0]['step'] == ooms[0]['step']  # one event, one step
    with open(os.path.join(out, 'rank1.injected.json'), encoding='utf-8') as f:
        injected = json.load(f)
    logged = [row['dynamic/oom_count'] for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'loss' in row]
    assert logged[-1] == injected['forward'] + injected['backward']  # rank 1's OOMs, in rank 0's log line
    assert logged[ooms[0]['step'] - 1] >= 1  # counted in the log line of the step it ran in
    assert_exactly_once(out, epochs=2)  # 4 steps of 2 x 2 samples: two epochs of the 8-sample shard


def test_early_stop_seen_by_rank_1_stops_both(tmp_path, tiny_llama, dataset_15):
    """Rank 1 alone sees its monitored loss diverge at step 4: both ranks stop after step 4, one checkpoint is
    saved (rank 0 writes the pack state into it), and the stop record carries rank 1's value."""
    pack = {'integration': {'record_samples': True}, 'batch_schedule': {'schedule': {0: 2}},
            'early_stopping': {'monitor': 'loss', 'patience': 1000, 'divergence': 1000.0},
            'checkpoint_rotation': {'keep_last': 1, 'keep_best': 0}, 'training_log': {}}
    out = run_two_ranks(tmp_path, tiny_llama, dataset_15,
                        callbacks=['batch_schedule', 'early_stopping', 'checkpoint_rotation', 'training_log'],
                        pack=pack, faults={'1': {'monitor_value': {4: 1.0e6}}}, num_train_epochs=3, max_steps=-1,
                        save_steps=1000)
    t0, t1 = traces(out)
    assert_same_steps(t0, t1)
    assert t0['global_step'] == t1['global_step'] == 4
    assert decision_keys(t0) == decision_keys(t1)
    stops = [d for d in read_jsonl(os.path.join(out, 'dynamic_decisions.jsonl')) if d['kind'] == 'stop']
    assert len(stops) == 1 and stops[0]['reason'] == 'divergence' and stops[0]['step'] == 4
    assert stops[0]['values']['value'] == 1.0e6 and stops[0]['values']['rank'] == 1
    assert sorted(n for n in os.listdir(out) if n.startswith('checkpoint-')) == ['checkpoint-4']
    assert os.path.exists(os.path.join(out, 'checkpoint-4', 'dynamic_callbacks_state.json'))

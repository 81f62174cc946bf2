"""Two-process ``swift sft`` runs on CPU (torchrun, gloo): every pack decision is agreed by both ranks.

Each test launches ``tests/distributed_driver.py`` under ``python -m torch.distributed.run --nproc_per_node 2``
with ``ddp_backend: gloo`` on the tiny Qwen2 model and a 15-sample dataset (shards of 8 and 7 samples: the
uneven case), with its own timeout (the process group is killed and the test fails instead of hanging).
Every rank writes ``rank<R>.trace.json`` (its decision records and what the integration applied at every step);
``dynamic_samples.rank<R>.jsonl`` holds the dataset indices each rank trained on.

On CPU, ms-swift + accelerate train with ``DistributedType.NO`` (no DDP wrapper: gradients are not
all-reduced), but the gloo process group exists, so the pack's own agreement (``distributed.py``) really
gathers and broadcasts across the two processes; this is what these tests check.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from swift_runs import indices_by_epoch, read_jsonl, sample_trace

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'distributed_driver.py')
TIMEOUT_S = 240
N_SAMPLES = 15  # odd: rank 0 gets 8 samples an epoch, rank 1 gets 7
ALL = ['batch_schedule', 'lr_schedule', 'memory_backoff', 'early_stopping', 'checkpoint_rotation', 'training_log']
# values measured on one rank (losses, memory) that may differ between ranks in an agreed decision's record
RANK_LOCAL = ('best', 'value', 'wait', 'grad_norm', 'rank', 'position')


@pytest.fixture(scope='module')
def dataset_15(fixture_dir):
    from swift_dynamic_callbacks.tiny import write_gsm8k_dataset
    return str(write_gsm8k_dataset(fixture_dir / 'gsm8k-15.jsonl', N_SAMPLES))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def run_two_ranks(tmp_path, model: str, dataset: str, *, callbacks: list[str], pack: dict[str, Any],
                  faults: dict[str, Any] | None = None, **sft: Any) -> str:
    """Run the driver on 2 ranks; return the output directory. Fails (and kills the group) after TIMEOUT_S."""
    from swift_dynamic_callbacks.tiny import offline_sft_kwargs
    out = str(tmp_path / 'out')
    kwargs = offline_sft_kwargs(model, dataset, out, arch='qwen2', callbacks=callbacks, ddp_backend='gloo',
                                lora_dropout=0.0, **sft)
    spec = tmp_path / 'spec.json'
    spec.write_text(json.dumps({'sft': kwargs, 'pack': pack, 'faults': faults or {}}))
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false',
           'PYTHONPATH': os.pathsep.join(p for p in (os.path.dirname(DRIVER), os.environ.get('PYTHONPATH')) if p)}
    command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_addr', '127.0.0.1',
               '--master_port', str(_free_port()), DRIVER, str(spec)]
    log = tmp_path / 'torchrun.log'
    start = time.monotonic()
    with open(log, 'w') as f:
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path),
                                   start_new_session=True)
        try:
            rc = process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f'2-process run did not finish in {TIMEOUT_S}s (a hang?); last output:\n{_tail(log)}')
    assert rc == 0, f'torchrun exited {rc} after {time.monotonic() - start:.0f}s:\n{_tail(log)}'
    return out


def _tail(path, lines: int = 60) -> str:
    with open(path, errors='replace') as f:
        return ''.join(f.readlines()[-lines:])


def traces(out: str) -> list[dict[str, Any]]:
    found = []
    for rank in (0, 1):
        with open(os.path.join(out, f'rank{rank}.trace.json'), encoding='utf-8') as f:
            found.append(json.load(f))
    assert [t['world_size'] for t in found] == [2, 2]
    return found


def decision_keys(trace: dict[str, Any], *, skip_kinds: tuple[str, ...] = ()) -> list[tuple]:
    """A rank's decisions without wall-clock time, messages and values measured on that rank."""
    keys = []
    for d in trace['decisions']:
        if d['kind'] in skip_kinds:
            continue
        values = {k: v for k, v in d['values'].items() if k not in RANK_LOCAL and not k.startswith('memory_')}
        keys.append((d['step'], d['source'], d['kind'], d['reason'], json.dumps(values, sort_keys=True)))
    return keys


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


def test_all_callbacks_agree_at_every_step(tmp_path, tiny_qwen, dataset_15):
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
        'checkpoint_rotation': {'keep_last': 1, 'keep_best': 0, 'metric': 'loss'},
        'training_log': {},
    }
    out = run_two_ranks(tmp_path, tiny_qwen, dataset_15, callbacks=ALL, pack=pack,
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


def test_oom_on_rank_1_backs_off_both_ranks(tmp_path, tiny_qwen, dataset_15):
    """Rank 1 alone runs out of memory (passes of more than 500 padded tokens): it recovers, and from the next step
    on both ranks run with the same pass cap; rank 0's decision log holds rank 1's OOM record."""
    pack = {'integration': {'record_samples': True}, 'batch_schedule': {'schedule': {0: 2}},
            'memory_backoff': {'clean_steps': 100}}
    out = run_two_ranks(tmp_path, tiny_qwen, dataset_15, callbacks=['batch_schedule', 'memory_backoff'], pack=pack,
                        faults={'1': {'oom_token_budget': 500}}, max_steps=4, gradient_accumulation_steps=2)
    with open(os.path.join(out, 'rank1.injected.json'), encoding='utf-8') as f:
        assert json.load(f)['forward'] >= 1
    assert not os.path.exists(os.path.join(out, 'rank0.injected.json'))
    t0, t1 = traces(out)
    assert_same_steps(t0, t1)
    assert t0['global_step'] == 4
    caps = [(s['pass_limit'] or {}).get('samples') for s in t0['steps']]
    first = caps.index(1)
    assert caps[first:] == [1] * (4 - first)
    assert decision_keys(t0) == decision_keys(t1)
    ooms = [d for d in read_jsonl(os.path.join(out, 'dynamic_decisions.jsonl')) if d['kind'] == 'oom']
    assert ooms and {d['values']['rank'] for d in ooms} == {1}
    assert_exactly_once(out, epochs=2)  # 4 steps of 2 x 2 samples: two epochs of the 8-sample shard


def test_early_stop_seen_by_rank_1_stops_both(tmp_path, tiny_qwen, dataset_15):
    """Rank 1 alone sees its monitored loss diverge at step 4: both ranks stop after step 4, one checkpoint is
    saved (rank 0 writes the pack state into it), and the stop record carries rank 1's value."""
    pack = {'integration': {'record_samples': True}, 'batch_schedule': {'schedule': {0: 2}},
            'early_stopping': {'monitor': 'loss', 'patience': 1000, 'divergence': 1000.0},
            'checkpoint_rotation': {'keep_last': 1, 'keep_best': 0, 'metric': 'loss'}, 'training_log': {}}
    out = run_two_ranks(tmp_path, tiny_qwen, dataset_15,
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


def test_resume_restores_the_state_on_both_ranks(tmp_path, tiny_qwen, dataset_15):
    """The callbacks not in the tests above (batch_growth, length_batching with a token budget and buckets) on 2
    ranks, saved at step 4 and resumed to step 9: the state written by rank 0 is restored on both ranks (both
    continue at their next unseen sample with the same plan and batch size), both ranks agree at every resumed step,
    and over both runs every epoch's samples are the dataset exactly once."""
    callbacks = ['batch_growth', 'length_batching', 'training_log']
    pack = {'integration': {'record_samples': True},
            'batch_growth': {'policy': 'interval', 'initial': 1, 'factor': 2, 'interval': 3, 'maximum': 4},
            'length_batching': {'mode': 'token_budget', 'max_tokens': 900, 'bucketing': True}, 'training_log': {}}
    common = dict(callbacks=callbacks, pack=pack, lr_scheduler_type='cosine', warmup_ratio=0.0, save_steps=4)
    out = run_two_ranks(tmp_path, tiny_qwen, dataset_15, max_steps=4, **common)
    first = traces(out)
    assert_same_steps(*first)
    assert sorted(n for n in os.listdir(out) if n.startswith('checkpoint-')) == ['checkpoint-4']
    out = run_two_ranks(tmp_path, tiny_qwen, dataset_15, max_steps=9,
                        resume_from_checkpoint=os.path.join(out, 'checkpoint-4'), **common)
    t0, t1 = traces(out)
    assert_same_steps(t0, t1)
    assert t0['global_step'] == 9 and [s['step'] for s in t0['steps']] == list(range(5, 10))
    assert decision_keys(t0) == decision_keys(t1)
    resumed = [d for d in t0['decisions'] if d['kind'] == 'resume']
    assert resumed and resumed[0]['reason'] == 'checkpoint'
    # the step after the save continues what the saved run was doing (batch size), on both ranks
    assert t0['steps'][0]['batch_size'] == first[0]['steps'][-1]['batch_size'] or any(
        d['kind'] == 'batch_size' and d['step'] == 4 for d in t0['decisions'])
    by_rank = [indices_by_epoch(sample_trace(out, rank)) for rank in (0, 1)]
    for epoch in sorted(set(by_rank[0]) & set(by_rank[1])):
        a, b = by_rank[0][epoch], by_rank[1][epoch]
        assert len(a) == len(set(a)) and len(b) == len(set(b)) and not set(a) & set(b), epoch
        last = epoch == max(by_rank[0])
        assert sorted(a + b) == list(range(N_SAMPLES)) or last, f'epoch {epoch}: not the dataset exactly once'
    assert len(by_rank[0]) >= 2  # the run went past an epoch end

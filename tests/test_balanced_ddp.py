"""``NPROC_PER_NODE=2 swift-dynamic sft run.yaml`` (the user's route; real DDP on CPU: ``use_cpu: true``) with balanced
global steps, padding-free micro-batches and a batch change inside the epoch: every sample exactly once over both
ranks, every step the global batch, the ranks' work spread logged, the engine DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from swift_runs import decisions, free_port, indices_by_epoch, read_jsonl, sample_trace, sft_kwargs

pytestmark = [pytest.mark.distributed, pytest.mark.engines, pytest.mark.e2e]


@pytest.mark.start_first
def test_two_processes_balanced_padding_free_with_a_batch_change(tmp_path, tiny_qwen):
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    n = 27
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=n))
    out = str(tmp_path / 'out')
    config = sft_kwargs(tiny_qwen, 'qwen2', data, out, max_steps=-1, num_train_epochs=1, max_length=2048,
                        per_device_train_batch_size=2, gradient_accumulation_steps=1, lora_dropout=0.0)
    config.update(report_to='none', use_cpu=True, ddp_backend='gloo', callbacks=['batch_schedule', 'length_batching'],
                  dynamic_callbacks={'batch_schedule': {'schedule': {0: 2, 2: 3}},
                                     'length_batching': {'mode': 'balanced', 'padding_free': True},
                                     'integration': {'record_samples': True}})
    path = tmp_path / 'run.yaml'
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, 'NPROC_PER_NODE': '2', 'MASTER_PORT': str(free_port()),
           'OMP_NUM_THREADS': '1'}
    result = subprocess.run([sys.executable, '-m', 'swift_dynamic_callbacks.cli', 'sft', str(path)],
                            capture_output=True, text=True, env=env, timeout=900, start_new_session=True)
    assert result.returncode == 0, result.stderr[-4000:]
    traces = [sample_trace(out, rank) for rank in (0, 1)]
    a, b = (indices_by_epoch(t)[0] for t in traces)
    assert not set(a) & set(b) and sorted(a + b) == list(range(n))  # exactly once over both ranks
    per_step = [sum(map(len, r0['batches'])) + sum(map(len, r1['batches'])) for r0, r1 in zip(*traces)]
    assert per_step[:2] == [4, 4] and set(per_step[2:-1]) == {6} and 0 < per_step[-1] <= 6  # the global batch
    records = decisions(out)
    [engine] = [d for d in records if d['kind'] == 'engine']
    assert engine['reason'] == 'ddp' and engine['values']['world_size'] == 2
    [change] = [d for d in records if d['kind'] == 'batch_size' and d['values']['old'] == 2]
    layout = change['values']['balanced_layout']
    assert layout['samples_left'] in (9, 10) and 'planned_rank_work_spread' in layout  # 19 left, laid out again
    [plan] = [d for d in records if d['kind'] == 'batch_plan']
    assert 0 <= plan['values']['planned_rank_work_spread'] <= plan['values']['unbalanced_rank_work_spread']
    logs = [row for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'loss' in row]
    assert all(row['dynamic/padding_fraction'] == 0.0 for row in logs)
    spread = [row['dynamic/rank_work_spread'] for row in logs]
    unbalanced = [row['dynamic/rank_work_spread_unbalanced'] for row in logs]
    assert all(0 <= s < 0.1 for s in spread[:-1])  # the last step: one sample on rank 0, none on rank 1 (spread 1)
    assert sum(spread) < sum(unbalanced)


def _two_processes(tmp_path, name, model, data, length_batching):
    out = str(tmp_path / name)
    config = sft_kwargs(model, 'qwen2', data, out, max_steps=-1, num_train_epochs=1, max_length=2048,
                        per_device_train_batch_size=2, gradient_accumulation_steps=2, lora_dropout=0.0,
                        learning_rate=1e-3, lr_scheduler_type='constant', warmup_ratio=0.0)
    config.update(report_to='none', use_cpu=True, ddp_backend='gloo', callbacks=['length_batching'],
                  include_num_input_tokens_seen=True,  # HF's collective a slot, while the ranks' slots differ
                  dynamic_callbacks={'length_batching': length_batching, 'integration': {'record_samples': True}})
    path = tmp_path / f'{name}.yaml'
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, 'NPROC_PER_NODE': '2', 'MASTER_PORT': str(free_port()), 'OMP_NUM_THREADS': '1'}
    result = subprocess.run([sys.executable, '-m', 'swift_dynamic_callbacks.cli', 'sft', str(path)],
                            capture_output=True, text=True, env=env, timeout=900, start_new_session=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.mark.slow  # DDP passes by tokens: test_engines.py's pass_tokens test in CI; padding-free: the test above
def test_two_processes_passes_by_tokens_train_the_same_steps(tmp_path, tiny_qwen):
    """Balanced steps under two DDP processes as micro-batches of the per-device size, as passes of at most 2,000
    padded tokens and as padding-free passes of 2,000 real tokens: every step the same samples over both ranks, the
    same loss and grad_norm, while each rank runs its share in its own passes (steps of fewer and of more passes than
    gradient_accumulation_steps, empty slots)."""
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=32))
    base = {'mode': 'balanced'}
    runs = [_two_processes(tmp_path, 'plain', tiny_qwen, data, base),
            _two_processes(tmp_path, 'padded', tiny_qwen, data, {**base, 'pass_tokens': 2000}),
            _two_processes(tmp_path, 'packed', tiny_qwen, data, {**base, 'pass_tokens': 2000, 'padding_free': True})]

    def steps(out):
        traces = [sample_trace(out, rank) for rank in (0, 1)]
        return [sorted(i for row in rows for batch in row['batches'] for i in batch) for rows in zip(*traces)]

    def logged(out, key):
        return [row[key] for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'loss' in row]

    assert steps(runs[1]) == steps(runs[0]) == steps(runs[2])
    for out in runs[1:]:
        assert logged(out, 'loss') == pytest.approx(logged(runs[0], 'loss'), rel=1e-4)
        assert logged(out, 'grad_norm') == pytest.approx(logged(runs[0], 'grad_norm'), rel=1e-3)
        for rank in (0, 1):  # each rank cuts its own share: steps of fewer and of more passes than GA, empty slots
            slots = [row['passes'] for row in sample_trace(out, rank)]
            assert min(map(sum, slots)) < 2 < max(map(sum, slots)) and min(map(min, slots)) == 0, slots
    assert {sum(row['passes']) for row in sample_trace(runs[0], 0)} == {2}  # gradient_accumulation_steps

    def tokens_seen(out):  # HF's count over both ranks (one gather a slot on every rank, whatever the slot holds)
        [ckpt] = [d for d in os.listdir(out) if d.startswith('checkpoint-')]
        with open(os.path.join(out, ckpt, 'trainer_state.json'), encoding='utf-8') as f:
            return json.load(f)['num_input_tokens_seen']

    for out in runs[:2]:  # every position of every pass, as the pack counts padded tokens
        assert tokens_seen(out) == int(logged(out, 'dynamic/padded_tokens_seen')[-1]) > 0

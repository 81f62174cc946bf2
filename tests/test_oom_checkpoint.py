"""The OOM state survives a checkpoint saved at the step of the OOM: every rank's OOM, folded into the pass budget
when the checkpoint is written, is in it; a run resumed from it continues with the same budget, records, losses and
weights as the uninterrupted run (one process, and two under DDP with the OOM on rank 1 only)."""

from __future__ import annotations

import os

import pytest
import torch

from swift_runs import decisions, read_jsonl, run_sft, train_logs


def _budget_records(out: str) -> list[tuple]:
    return [(d['step'], d['reason'], d['values']['unit'], d['values']['new'], d['values']['bad'])
            for d in decisions(out) if d['kind'] == 'pass_budget']


def _oom_records(out: str) -> list[tuple]:
    return [(d['step'], d['values']['rank'], d['values']['pass_size'], d['values']['pass_tokens'])
            for d in decisions(out) if d['kind'] == 'oom']


def _adapter(out: str, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(out, f'checkpoint-{step}', 'adapter_model.safetensors'))


@pytest.mark.e2e
# CI time: a token budget an OOM lowered, resumed from its checkpoint: test_pass_cost.py::
# test_swift_sft_a_lowered_budget_survives_a_resume; the checkpoint at the OOM step itself: the rows arm
@pytest.mark.parametrize('unit', ['rows', pytest.param('tokens', marks=pytest.mark.slow)])
def test_a_checkpoint_at_the_oom_step_resumes_as_the_uninterrupted_run(unit, tmp_path, tiny_llama, gsm8k_16):
    """``rows``: micro-batches of 4, an OOM in the first pass of step 3, the checkpoint at step 3. ``tokens``:
    ``pass_tokens: 1200`` on a device whose memory ends at 900 tokens a pass, the first OOM in step 2, the
    checkpoint at step 2. Resumed from that checkpoint: the same ``oom`` and ``pass_budget`` records, losses and
    final weights as the run that never stopped; no OOM again where the memory end persists (at 55fa141 the OOM
    record was lost and the token budget was back at the ceiling)."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    if unit == 'rows':
        data, at = gsm8k_16, 3
        pack = {'batch_schedule': {'schedule': {0: 4}}}
        callbacks, extra = ['batch_schedule'], dict(per_device_train_batch_size=4)
        inject = {'forward_passes': (4, )}  # two passes a step before the OOM: step 3's first
    else:
        data, at = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=24)), 2
        pack = {'length_batching': {'mode': 'balanced', 'pass_tokens': 1200}}
        callbacks = ['length_batching']
        extra = dict(per_device_train_batch_size=2, max_length=900, truncation_strategy='right')
        inject = {'token_budget': 900}

    def train(out, max_steps, injected, **more):
        try:
            sdc.register(**pack, integration={'oom_grow_back_steps': 1})
            with OomInjector(**(inject if injected else {})) as injector:
                run_sft(tiny_llama, 'llama', data, str(out), callbacks=callbacks, max_steps=max_steps,
                        gradient_accumulation_steps=2, lora_dropout=0.0, learning_rate=1e-3,
                        lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=at, **extra, **more)
        finally:
            plugin.unregister()
        return injector

    full, part = tmp_path / 'full', tmp_path / 'part'
    assert train(full, 6, True).counts['forward'] >= 1
    first = train(part, at, True)
    assert first.counts['forward'] >= 1 and _oom_records(str(part))  # the OOM came in the checkpoint's step
    persistent = unit == 'tokens'  # the memory end stays; a one-off OOM (rows) is not injected again
    resumed = train(part, 6, persistent, resume_from_checkpoint=str(part / f'checkpoint-{at}'), fresh=False)
    if persistent:
        assert resumed.counts == {'forward': 0, 'backward': 0}  # planned at the saved budget from its first step
    assert _oom_records(str(part)) == _oom_records(str(full))
    assert _budget_records(str(part)) == _budget_records(str(full)) and _budget_records(str(full))
    assert [r['loss'] for r in train_logs(str(part))] == pytest.approx([r['loss'] for r in train_logs(str(full))],
                                                                       abs=1e-5)
    a, b = _adapter(str(full), 6), _adapter(str(part), 6)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def _injected(out: str) -> dict:
    import json
    with open(os.path.join(out, 'rank1.injected.json'), encoding='utf-8') as f:
        return json.load(f)


@pytest.fixture(scope='module')
def dataset_15(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    return str(write_gsm8k_dataset(fixture_dir / 'gsm8k-15.jsonl', 15))


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.engines
@pytest.mark.slow  # CI time: one process above; rank 1's OOM and resume under engines: test_engines / SP tests
def test_two_processes_a_checkpoint_at_rank_1s_oom_resumes_with_its_budget(tmp_path, tiny_llama, dataset_15):
    """DDP on 2 processes, rank 1 alone out of memory (passes over 500 padded tokens) in step 1, the checkpoint at
    step 1 written by rank 0: rank 1's OOM is in it (exchanged when it was written), so the resumed run has rank 0's
    record of it, the same budget on both ranks, no OOM again, and the uninterrupted run's weights."""
    from engine_runs import assert_same_weights, max_difference, run_ranks, weights
    pack = {'integration': {'oom_grow_back_steps': 1}, 'batch_schedule': {'schedule': {0: 2}}}
    common = dict(callbacks=['batch_schedule'], pack=pack, faults={'1': {'oom_token_budget': 500}},
                  gradient_accumulation_steps=2, save_steps=1, max_steps=3)
    full = run_ranks(str(tmp_path / 'full'), tiny_llama, dataset_15, engine='ddp', **common)
    part = run_ranks(str(tmp_path / 'part'), tiny_llama, dataset_15, engine='ddp', stop_at=1, **common)
    assert _injected(part)['forward'] >= 1
    run_ranks(str(tmp_path / 'resumed'), tiny_llama, dataset_15, engine='ddp', output_dir=part,
              resume_from_checkpoint=os.path.join(part, 'checkpoint-1'), **common)
    assert _injected(part)['forward'] == 0  # no OOM again on rank 1: it planned at the saved budget
    records = {name: [(d['step'], d['kind'], d['reason'], d['values'].get('rank'), d['values'].get('new'))
                      for d in read_jsonl(os.path.join(out, 'dynamic_decisions.jsonl'))
                      if d['kind'] in ('oom', 'pass_budget')] for name, out in (('full', full), ('part', part))}
    assert records['part'] == records['full'] and any(r[1] == 'oom' and r[3] == 1 for r in records['full'])
    assert_same_weights(part)
    assert max_difference(weights(part), weights(full)) <= 1e-6

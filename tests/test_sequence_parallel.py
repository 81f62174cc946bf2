"""The pack under ms-swift's sequence parallelism (``sequence_parallel_size: 2``, Ulysses, on CPU processes over
gloo, ``attn_impl: sdpa``): the ranks of a group are one data rank (the same samples, passes and cuts), every pass
goes through ms-swift's own ``prepare_inputs`` (labels split across the group), an OOM ends the run with what to
lower (a pass holds the group's all-to-all) and the resumed run plans below it."""

from __future__ import annotations

import os

import pytest

from engine_runs import assert_same_steps, run_ranks, traces
from swift_runs import decisions, indices_by_epoch, read_jsonl, sample_trace

pytestmark = [pytest.mark.distributed, pytest.mark.engines, pytest.mark.e2e]

SP = dict(sequence_parallel_size=2, attn_impl='sdpa', padding_side='right', max_length=300,
          truncation_strategy='right', gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=4)


@pytest.fixture
def mixed_15(tmp_path):
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    return str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=15))


def _logs(out: str) -> list[dict]:
    return [row for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'loss' in row]


@pytest.mark.start_first
def test_passes_under_sequence_parallelism_keep_the_gradient(tmp_path, tiny_llama, mixed_15):
    """``mode: balanced`` with ``pass_tokens`` (several passes a step) against the same balanced steps in one pass a
    micro-batch, both under sequence parallelism on 2 processes (one data rank): the same samples, and every step's
    loss and grad_norm within 1e-5; both ranks of the group ran the same passes (the same trace). Then the run with
    passes killed right after its step-2 checkpoint and resumed: the uninterrupted run's samples and losses."""
    common = dict(engine='ddp', callbacks=['length_batching'], **SP)
    one = run_ranks(str(tmp_path / 'one'), tiny_llama, mixed_15,
                    pack={'integration': {'record_samples': True}, 'length_batching': {'mode': 'balanced'}},
                    **common)
    cut_pack = {'integration': {'record_samples': True}, 'length_batching': {'mode': 'balanced', 'pass_tokens': 200}}
    cut = run_ranks(str(tmp_path / 'cut'), tiny_llama, mixed_15, pack=cut_pack, save_steps=2, **common)
    for out in (one, cut):
        [mesh] = [d for d in decisions(out) if d['kind'] == 'sequence_parallel']
        assert mesh['values']['data_parallel_size'] == 1 and mesh['values']['sequence_parallel_size'] == 2
        t0, t1 = traces(out)
        assert_same_steps(t0, t1)
        assert sample_trace(out, 0) == [dict(r, rank=0) for r in sample_trace(out, 1)]  # one data rank
    assert [r['batches'] for r in sample_trace(one)] == [r['batches'] for r in sample_trace(cut)]
    passes = [sum(r['passes']) for r in sample_trace(cut)]
    assert max(passes) > 2, passes  # several passes a step (2 micro-batches a step)
    a, b = _logs(one), _logs(cut)
    assert len(a) == len(b) == SP['max_steps']
    for x, y in zip(a, b):
        assert y['loss'] == pytest.approx(x['loss'], rel=1e-5, abs=1e-6), (x, y)
        assert y['grad_norm'] == pytest.approx(x['grad_norm'], rel=1e-5, abs=1e-6), (x, y)
    [engine] = [d for d in decisions(cut) if d['kind'] == 'engine']
    assert engine['values']['oom_recovery'] is False and 'sequence_parallel_size: 2' in engine['values'][
        'oom_recovery_off']
    assert sorted(indices_by_epoch(sample_trace(cut))[0]) == list(range(15))
    # killed right after the step-2 checkpoint and resumed from it: the samples and losses of the run that never stopped
    part = str(tmp_path / 'part' / 'out')
    run_ranks(str(tmp_path / 'part'), tiny_llama, mixed_15, pack=cut_pack, stop_at=2, output_dir=part, save_steps=2,
              **common)
    run_ranks(str(tmp_path / 'part-resumed'), tiny_llama, mixed_15, pack=cut_pack, output_dir=part, save_steps=2,
              resume_from_checkpoint=os.path.join(part, 'checkpoint-2'), **common)
    assert [r['batches'] for r in sample_trace(part)] == [r['batches'] for r in sample_trace(cut)]
    assert [r['loss'] for r in _logs(part)] == pytest.approx([r['loss'] for r in b], rel=1e-5)


@pytest.fixture
def dataset_16(tmp_path):
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    return str(write_gsm8k_dataset(tmp_path / 'gsm8k-16.jsonl', 16))


def test_an_oom_on_one_rank_of_the_group_ends_the_run_and_it_resumes_below_it(tmp_path, tiny_llama, dataset_16):
    """Rank 1 alone runs out of memory in step 2 (its group partner waits in the all-to-all): every rank ends within
    60 s of the OOM with the message naming the pass and what to lower; the run resumed from the step-1 checkpoint
    plans both ranks of the group one sample a pass (the note folded), and finishes."""
    import json
    import time
    pack = {'integration': {'record_samples': True}, 'batch_schedule': {'schedule': {0: 2}}}
    common = dict(engine='ddp', callbacks=['batch_schedule'], pack=pack,
                  **{**SP, 'max_steps': 3, 'save_steps': 1})
    workdir = str(tmp_path / 'sp')
    # pass 4 is step 2's first: under DDP ms-swift checkpoints non-reentrantly, so the injector counts each of a step's
    # two micro-batches twice (its forward and gradient checkpointing's recomputation in backward)
    log = run_ranks(workdir, tiny_llama, dataset_16, faults={'1': {'oom_forward_passes': [4]}}, expect_failure=True,
                    **common)
    ended = time.time()
    with open(log, encoding='utf-8', errors='replace') as f:
        text = f.read()
    assert 'out of memory on rank 1 in a pass of 2 rows' in text and 'sequence_parallel_size: 2' in text
    out = os.path.join(workdir, 'out')
    with open(os.path.join(out, 'dynamic_oom.rank1.json'), encoding='utf-8') as f:
        note = json.load(f)
    assert note['step'] == 1 and note['pass_size'] == 2
    assert ended - note['time'] < 60, ended - note['time']
    run_ranks(workdir + '-resumed', tiny_llama, dataset_16, output_dir=out,
              resume_from_checkpoint=os.path.join(out, 'checkpoint-1'), **common)
    t0, t1 = traces(out)
    assert_same_steps(t0, t1)
    assert t0['global_step'] == 3 and (t0['steps'][0]['pass_limit'] or {}).get('samples') == 1
    assert (t1['steps'][0]['pass_limit'] or {}).get('samples') == 1  # the whole group cuts alike


def test_two_groups_of_two_deal_every_row_once_with_the_one_process_gradient(tmp_path, tiny_llama, mixed_15):
    """4 processes, ``sequence_parallel_size: 2``: two data ranks of two ranks each. Each group's ranks draw the same
    samples; the two groups every row of the epoch once between them, in balanced steps; the weights equal one
    process's over the same micro-batches a step (1e-5: the union of the two data ranks' samples)."""
    from engine_runs import assert_same_weights, reference
    pack = {'integration': {'record_samples': True}, 'length_batching': {'mode': 'balanced', 'pass_tokens': 200}}
    out = run_ranks(str(tmp_path / 'sp2x2'), tiny_llama, mixed_15, engine='ddp', callbacks=['length_batching'],
                    pack=pack, nproc=4, **{**SP, 'max_steps': 2})
    trace = [sample_trace(out, rank) for rank in range(4)]
    for a, b in ((0, 1), (2, 3)):  # one group: the same samples
        assert [r['batches'] for r in trace[a]] == [r['batches'] for r in trace[b]]
    first, second = (indices_by_epoch(trace[r])[0] for r in (0, 2))
    assert sorted(first + second) == list(range(15))  # 2 steps of 2 x GA 2 x 2 data ranks: the epoch, once
    [mesh] = [d for d in decisions(out) if d['kind'] == 'sequence_parallel']
    assert mesh['values']['data_parallel_size'] == 2
    ref = reference(str(tmp_path / 'ref'), tiny_llama, mixed_15, out, gradient_accumulation_steps=2, max_steps=2,
                    samples=[os.path.join(out, f'dynamic_samples.rank{r}.jsonl') for r in (0, 2)],
                    max_length=300, truncation_strategy='right')
    assert_same_weights(out, ref)

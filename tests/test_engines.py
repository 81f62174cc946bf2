"""The pack under real engines on 2 CPU processes (gloo): DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3.

Every run asserts the engine it claims (accelerate's distributed type and the wrapper class, so a silent fallback
fails), that both ranks end with equal trainable weights, and that those equal a one-process run over the same
micro-batches per step from the same starting weights (``engine_runs.reference``; fp32, 1e-5). The dataset has 15
samples, so the shards are uneven (8 and 7) and epochs end with a rank a sample short (placeholders).

FSDP2 on CPU is a test-only device: accelerate starts FSDP only on accelerators, so the driver lifts its ``MULTI_CPU``
state to ``FSDP`` and ``fully_shard`` runs over gloo. ``scripts/gpu_engines.sh`` runs the same checks on GPUs (NCCL).

Marked ``engines`` (and ``distributed``): run by ``.ci/run`` as its own step, not by the default ``pytest`` run.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from engine_runs import (assert_engine, assert_same_steps, assert_same_weights, build_once, decision_keys,
                         max_difference, reference, run_ranks, traces, weights)
from swift_runs import indices_by_epoch, read_jsonl, sample_trace

pytestmark = [pytest.mark.engines, pytest.mark.distributed, pytest.mark.e2e]

N_SAMPLES = 15  # rank 0 gets 8 samples an epoch, rank 1 gets 7


@pytest.fixture(scope='module')
def dataset_15(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    return str(write_gsm8k_dataset(fixture_dir / 'gsm8k-15.jsonl', N_SAMPLES))


def _deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def engine_param(name: str, slow: bool = False):
    """An engine as a test parameter; ``slow``: an arm whose path another engine's arm already takes (ZeRO-2 beside
    ZeRO-3: the same DeepSpeed checkpoint and end-of-run code), out of CI's engine run (``-m engines`` runs it)."""
    marks = [pytest.mark.skipif(not _deepspeed_available(),
                                reason='deepspeed is not installed (pip install .[deepspeed])')
             ] if name.startswith('zero') else []
    if slow:
        marks.append(pytest.mark.slow)
    return pytest.param(name, marks=marks, id=name)


def assert_exactly_once(out: str, *, complete_epochs: int) -> None:
    """Over both ranks, every epoch is the dataset exactly once (the last epoch may be partial), disjoint shards."""
    by_rank = [indices_by_epoch(sample_trace(out, rank)) for rank in (0, 1)]
    for epoch in sorted(set(by_rank[0]) | set(by_rank[1])):
        a, b = by_rank[0].get(epoch, []), by_rank[1].get(epoch, [])
        assert len(a) == len(set(a)) and len(b) == len(set(b)) and not set(a) & set(b), epoch
        if epoch < complete_epochs:
            assert sorted(a + b) == list(range(N_SAMPLES)), f'epoch {epoch}: not the dataset exactly once'


def placeholders(out: str) -> int:
    """Micro-batches without a sample (a rank a sample short at an epoch's end), over both ranks."""
    return sum(batch == [] for rank in (0, 1) for row in sample_trace(out, rank) for batch in row['batches'])


def test_ddp_growth_pieces_and_ooms_on_one_rank(tmp_path, tiny_llama, dataset_15):
    """DDP: batch growth 1 -> 2 -> 4 with GA 2 (micro-batches of 4 run as pieces), an epoch end where rank 1 is a sample
    short (a placeholder micro-batch), and rank 1 alone running out of memory in its very first forward and in a
    later one-sample forward (each run again as it was) and mid-backward in a pass of two (halved: both ranks cap
    their passes from the next step). No hang (the first-forward OOM used to deadlock on DDP's buffer broadcast),
    the same steps on both ranks, every sample once, and weights equal to one process with the same samples per
    step. (The injector counts first-layer forwards, gradient checkpointing's recomputation in backward included.)"""
    pack = {'integration': {'record_samples': True},
            'batch_growth': {'initial': 1, 'factor': 2, 'interval': 4, 'maximum': 4, 'micro_batch_cap': 2}}
    common = dict(max_steps=9, lr_scheduler_type='cosine', warmup_ratio=0.0)
    out = run_ranks(str(tmp_path / 'ddp'), tiny_llama, dataset_15, engine='ddp', callbacks=['batch_growth'],
                    pack=pack, faults={'1': {'oom_forward_passes': [0, 5], 'oom_backward_passes': [16]}},
                    gradient_accumulation_steps=2, **common)
    t0, t1 = assert_engine(out, 'ddp')
    assert_same_steps(t0, t1)
    assert t0['global_step'] == 9
    assert [s['batch_size'] for s in t0['steps']] == [1, 1, 1, 1, 2, 2, 2, 2, 4]
    with open(os.path.join(out, 'rank1.injected.json'), encoding='utf-8') as f:
        injected = json.load(f)
    assert injected['forward'] == 2 and injected['backward'] == 1
    ooms = [d for d in read_jsonl(os.path.join(out, 'dynamic_decisions.jsonl')) if d['kind'] == 'oom']
    found = [(d['values']['rank'], d['values']['pass_size'], d['values']['new_pass_cap']) for d in ooms]
    assert found == [(1, 1, None), (1, 1, None), (1, 2, 1)]  # two one-sample passes run again as they were, one halved
    caps = [(s['pass_limit'] or {}).get('samples') for s in t0['steps']]
    assert caps == [None] * 5 + [1] * 4  # rank 1's halving in step 5: both ranks cap their passes from step 6
    assert t0['steps'][-1]['num_pieces'] == 2
    assert decision_keys(t0) == decision_keys(t1)
    assert_exactly_once(out, complete_epochs=2)
    assert placeholders(out) == 1  # rank 1, step 4
    ref = reference(str(tmp_path / 'ref'), tiny_llama, dataset_15, out, gradient_accumulation_steps=2, **common)
    assert_same_weights(out, ref)


def test_ddp_noise_scale_reads_the_reduced_gradient(tmp_path, tiny_llama, dataset_15):
    """DDP: the gradient-noise probe's step gradient is the one the optimizer uses (after the all-reduce): the same on
    both ranks, and its squared norm is the logged ``grad_norm`` squared (it used to read each rank's own)."""
    pack = {'integration': {'record_samples': True},
            'batch_growth': {'policy': 'noise_scale', 'initial': 2, 'maximum': 4, 'interval': 100}}
    out = run_ranks(str(tmp_path / 'ddp'), tiny_llama, dataset_15, engine='ddp', callbacks=['batch_growth'],
                    pack=pack, max_steps=4, gradient_accumulation_steps=2)
    t0, t1 = assert_engine(out, 'ddp')
    measured = [(a['noise'], b['noise']) for a, b in zip(t0['steps'], t1['steps']) if 'noise' in a]
    assert len(measured) == 3  # every step but the last (read at the next boundary)
    logged = {row['global_step/max_steps'].split('/')[0]: row['grad_norm']
              for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'grad_norm' in row}
    for step, (a, b) in enumerate(measured, start=1):
        assert a['big_sqnorm'] == pytest.approx(b['big_sqnorm'], rel=1e-6)
        assert a['small_sqnorm'] != pytest.approx(b['small_sqnorm'], rel=1e-3)  # the first pass is each rank's own
        assert math.sqrt(a['big_sqnorm']) == pytest.approx(float(logged[str(step)]), rel=1e-4)


# CI time: DDP growth is the test above; ZeRO-3's passes, pieces and OOM note are tests below, its growth the slowest
# run of the stage (a sharded engine's growth, LR, resume and early stop: FSDP2's arm)
@pytest.mark.start_first
@pytest.mark.parametrize('engine', [engine_param('ddp', slow=True), engine_param('fsdp2'),
                                    engine_param('zero2', slow=True), engine_param('zero3', slow=True)])
def test_growth_token_budget_lr_schedule_resume_and_early_stop(engine, tmp_path, tiny_llama, dataset_15):
    """Every engine, every callback that is not refused there: batch growth with GA 2 and sqrt LR scaling, a token
    budget with bucketing on uneven shards (placeholder micro-batches on the short rank), warmup -> hold -> cosine,
    checkpoint rotation and the training log; killed after the checkpoint at step 4 and resumed, then stopped early at
    step 7 by a divergence rank 1 alone sees. Same steps and decisions on both ranks, every sample once per epoch over
    both runs, and the resumed run's weights equal one process's over the same 7 steps."""
    callbacks = ['batch_growth', 'length_batching', 'lr_schedule', 'early_stopping', 'checkpoint_rotation',
                 'training_log']
    pack = {'integration': {'record_samples': True},
            'batch_growth': {'initial': 1, 'factor': 2, 'interval': 2, 'maximum': 4},
            'length_batching': {'mode': 'token_budget', 'max_tokens': 900, 'bucketing': True},
            'lr_schedule': {'warmup': 2, 'hold': 2, 'min_ratio': 0.1, 'patience': 1000},
            'early_stopping': {'monitor': 'loss', 'patience': 1000, 'divergence': 1000.0},
            'checkpoint_rotation': {'keep_last': 1, 'keep_best': 0}, 'training_log': {}}
    common = dict(gradient_accumulation_steps=2, max_steps=12, save_steps=4)
    workdir = str(tmp_path / engine)
    out = run_ranks(workdir, tiny_llama, dataset_15, engine=engine, callbacks=callbacks, pack=pack, stop_at=4, **common)
    first = assert_engine(out, engine)
    assert_same_steps(*first)
    assert first[0]['global_step'] == 4 and os.path.isdir(os.path.join(out, 'checkpoint-4'))
    run_ranks(workdir + '-resumed', tiny_llama, dataset_15, engine=engine, callbacks=callbacks, pack=pack,
              faults={'1': {'monitor_value': {7: 1.0e6}}}, output_dir=out,
              resume_from_checkpoint=os.path.join(out, 'checkpoint-4'), **common)
    t0, t1 = assert_engine(out, engine)
    assert_same_steps(t0, t1)
    assert t0['global_step'] == 7 and [s['step'] for s in t0['steps']] == [5, 6, 7]
    assert decision_keys(t0, skip_kinds=('delete_checkpoint', )) == decision_keys(t1)
    stops = [d for d in read_jsonl(os.path.join(out, 'dynamic_decisions.jsonl')) if d['kind'] == 'stop']
    assert [(d['reason'], d['step'], d['values']['rank']) for d in stops] == [('divergence', 7, 1)]
    assert [s['batch_size'] for s in first[0]['steps'] + t0['steps']] == [1, 1, 2, 2, 4, 4, 4]
    lrs = [s['lr'] for s in first[0]['steps'] + t0['steps']]
    assert lrs[1] > lrs[0] and lrs[-1] < max(lrs)  # warmup, then the cosine (times the growth's sqrt scale)
    assert sorted(n for n in os.listdir(out) if n.startswith('checkpoint-')) == ['checkpoint-4', 'checkpoint-7']
    assert_exactly_once(out, complete_epochs=1)
    assert placeholders(out) >= 1
    ref = reference(str(tmp_path / f'{engine}-ref'), tiny_llama, dataset_15, out, gradient_accumulation_steps=2,
                    max_steps=12, stop_at=7)
    assert_same_weights(out, ref)


@pytest.mark.parametrize('engine,callbacks,pack,message', [
    pytest.param('fsdp2', ['batch_growth'], {'batch_growth': {'policy': 'noise_scale', 'initial': 1, 'maximum': 2}},
                 'dynamic_callbacks.batch_growth.policy: noise_scale is not supported under fsdp2',
                 id='fsdp2-noise_scale'),
    pytest.param('zero3', ['batch_growth'],
                 {'batch_growth': {'micro_batch_cap': 1}, 'integration': {'oom_recovery': True}},
                 'dynamic_callbacks.integration.oom_recovery: oom_recovery is not supported under deepspeed',
                 id='zero3-oom_recovery', marks=pytest.mark.skipif(not _deepspeed_available(), reason='no deepspeed')),
])
def test_sharded_engines_refuse_before_the_model_loads(engine, callbacks, pack, message, tmp_path, tiny_qwen,
                                                        dataset_15):
    """A feature the engine cannot run stops the run on the plugin route before any rank loads the model (ms-swift's
    parsed ``deepspeed`` / ``fsdp`` arguments name the engine), naming the setting and the engine, as ``swift-dynamic
    check`` does on the YAML (until this stop it was refused when training started, after the model and DeepSpeed
    loaded)."""
    log = run_ranks(str(tmp_path / engine), tiny_qwen, dataset_15, engine=engine, callbacks=callbacks, pack=pack,
                    max_steps=2, gradient_accumulation_steps=2, expect_failure=True)
    with open(log, encoding='utf-8', errors='replace') as f:
        text = f.read()
    assert 'ConfigError' in text and message in text
    # raised by the check ms-swift's _prepare_model_tokenizer runs first: no rank built the model (or its adapter)
    assert 'in check_pipeline' in text and 'PeftModelForCausalLM' not in text
    assert not os.path.exists(os.path.join(str(tmp_path / engine), 'out', 'rank0.trace.json')) or not traces(
        os.path.join(str(tmp_path / engine), 'out'))[0]['steps']


def _rows_by_rank(out: str, world: int) -> list[list[dict]]:
    return [read_jsonl(os.path.join(out, f'dynamic_samples.rank{r}.jsonl'))
            if os.path.exists(os.path.join(out, f'dynamic_samples.rank{r}.jsonl')) else [] for r in range(world)]


ELASTIC = {  # source world -> (per-device batch, resumed worlds); the global batch 6 (or 4) divides every new world
    2: (3, (1, 3)),
    1: (4, (2, )),
}


@pytest.fixture(scope='module')
def elastic_sources(tmp_path_factory, tiny_llama, dataset_15):
    """One uninterrupted DDP run per source world (2 epochs of 15 samples, checkpoint at step 2), built once for all
    pytest-xdist workers (the tests copy them; the tiny model's weights depend only on its seed)."""
    built: dict[int, str] = {}

    def source(world: int) -> str:  # built when a selected test first asks for it
        if world in built:
            return built[world]
        batch, _ = ELASTIC[world]

        def build(folder):
            return {'out': run_ranks(str(folder / f'elastic-{world}'), tiny_llama, dataset_15, engine='ddp',
                                     callbacks=['training_log'],
                                     pack={'integration': {'record_samples': True}, 'training_log': {}}, nproc=world,
                                     per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                                     num_train_epochs=2, max_steps=-1, save_steps=2, learning_rate=1e-3,
                                     lr_scheduler_type='linear', warmup_steps=0)}
        built[world] = build_once(tmp_path_factory, f'elastic-source-{world}', build)['out']
        return built[world]
    return source


@pytest.mark.parametrize('old,new', [(2, 1), pytest.param(2, 3, marks=pytest.mark.slow),  # CI time: 2to1 holds it
                                     pytest.param(1, 2, marks=pytest.mark.slow)], ids=['2to1', '2to3', '1to2'])
def test_resume_on_another_number_of_processes(old, new, elastic_sources, tmp_path, tiny_llama, dataset_15):
    """A DDP run (or one process) resumed from its step-2 checkpoint on another number of processes: an
    ``elastic_resume`` record, the global batch kept (per-device batch derived again), the same samples a step, every
    sample of every epoch once over both runs, the LR at every step the uninterrupted run's, the new ranks' weights
    equal, and (2 -> 1) equal to one process's over the same samples a step."""
    import shutil
    batch, _ = ELASTIC[old]
    source = elastic_sources(old)
    target = str(tmp_path / 'out')
    shutil.copytree(source, target)
    kept = [[row for row in rows if row['step'] <= 2] for rows in _rows_by_rank(target, old)]
    written = [len(rows) for rows in _rows_by_rank(target, new)]
    run_ranks(str(tmp_path / 'resumed'), tiny_llama, dataset_15, engine='ddp',
              callbacks=['training_log'], pack={'integration': {'record_samples': True}, 'training_log': {}},
              nproc=new, output_dir=target, resume_from_checkpoint=os.path.join(target, 'checkpoint-2'),
              per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_train_epochs=2, max_steps=-1,
              save_steps=2, learning_rate=1e-3, lr_scheduler_type='linear', warmup_steps=0)
    resumed = [rows[n:] for rows, n in zip(_rows_by_rank(target, new), written)]
    full = traces(source, old)
    now = traces(target, new)
    if new > 1:
        assert {(t['distributed_type'], t['wrapper']) for t in now} == {('MULTI_CPU', 'DistributedDataParallel')}
        assert_same_steps(*now[:2])
    (record, ) = [d for d in read_jsonl(os.path.join(target, 'dynamic_decisions.jsonl'))
                  if d['kind'] == 'elastic_resume']
    values = record['values']
    assert (values['old_world'], values['new_world'], values['global_batch_kept']) == (old, new, True)
    assert values['new_batch_size'] * new == batch * old
    per_step = {}
    for rows in kept + resumed:
        for row in rows:
            per_step.setdefault(row['epoch'], []).extend(i for b in row['batches'] for i in b)
            per_step[('step', row['step'])] = per_step.get(('step', row['step']), 0) + sum(map(len, row['batches']))
    assert sorted(per_step[0]) == list(range(N_SAMPLES)) and sorted(per_step[1]) == list(range(N_SAMPLES))
    expected = {}
    for rows in _rows_by_rank(source, old):
        for row in rows:
            expected[row['step']] = expected.get(row['step'], 0) + sum(map(len, row['batches']))
    assert {k[1]: v for k, v in per_step.items() if isinstance(k, tuple)} == expected  # the same samples a step
    lrs = {s['step']: s['lr'] for s in full[0]['steps']}
    assert [s['step'] for s in now[0]['steps']] == [s for s in sorted(lrs) if s > 2]
    assert all(s['lr'] == pytest.approx(lrs[s['step']], rel=1e-6) for s in now[0]['steps'])
    if new > 1:
        assert max_difference(weights(target, 0), weights(target, 1)) <= 1e-7
    if (old, new) == (2, 1):
        merged = str(tmp_path / 'merged.jsonl')
        with open(merged, 'w', encoding='utf-8') as f:
            for rows in kept + resumed:
                f.writelines(json.dumps(row) + '\n' for row in rows)
        ref = reference(str(tmp_path / 'ref'), tiny_llama, dataset_15, target, gradient_accumulation_steps=1,
                        max_steps=max(expected), world=old, samples=[merged], per_device_train_batch_size=batch,
                        learning_rate=1e-3, lr_scheduler_type='linear', warmup_steps=0)
        difference = max_difference(weights(target, 0), weights(ref, 0))
        assert difference <= 1e-5, f'{difference:.3g} from one process over the same samples a step'


def test_stream_resume_on_two_processes_draws_the_uninterrupted_rows(tmp_path, tiny_llama, dataset_15):
    """``streaming: true`` under DDP on 2 processes, batch growth, checkpointed at step 3 and resumed: every rank draws
    the rows (and batch sizes) of the uninterrupted run at every resumed step. On another number of processes the
    stream's position cannot be re-dealt: refused, naming why."""
    import shutil
    pack = {'integration': {'record_samples': True},
            'batch_growth': {'initial': 1, 'factor': 2, 'interval': 2, 'maximum': 2}}
    common = dict(streaming=True, dataset_shuffle=False, max_steps=6, save_steps=3, gradient_accumulation_steps=1)
    full = run_ranks(str(tmp_path / 'full'), tiny_llama, dataset_15, engine='ddp', callbacks=['batch_growth'],
                     pack=pack, **common)
    assert_same_steps(*assert_engine(full, 'ddp'))
    target = str(tmp_path / 'out')
    shutil.copytree(full, target)
    written = [len(rows) for rows in _rows_by_rank(target, 2)]
    run_ranks(str(tmp_path / 'resumed'), tiny_llama, dataset_15, engine='ddp', callbacks=['batch_growth'], pack=pack,
              output_dir=target, resume_from_checkpoint=os.path.join(target, 'checkpoint-3'), **common)
    assert_engine(target, 'ddp')
    for rank, (straight, now) in enumerate(zip(_rows_by_rank(full, 2), _rows_by_rank(target, 2))):
        resumed = [(r['step'], r['batch_size'], r['batches']) for r in now[written[rank]:]]
        assert resumed == [(r['step'], r['batch_size'], r['batches']) for r in straight if r['step'] > 3], rank
        assert len(resumed) == 3
    refused = shutil.copytree(full, str(tmp_path / 'one'))
    log = run_ranks(str(tmp_path / 'one-run'), tiny_llama, dataset_15, engine='ddp', callbacks=['batch_growth'],
                    pack=pack, nproc=1, output_dir=refused, expect_failure=True,
                    resume_from_checkpoint=os.path.join(refused, 'checkpoint-3'), **common)
    assert 'resume a streaming run with the same number of processes' in open(log).read()


# ---- passes under sharded engines (issue 47) -------------------------------------------------------------------
@pytest.fixture(scope='module')
def mixed_15(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    return str(write_mixed_length_dataset(fixture_dir / 'mixed-15.jsonl', n=15))


def _passes_by_rank(out: str) -> list[list[int]]:
    """Each rank's passes of data a step (the sample trace; padding passes are not in it)."""
    return [[sum(row['passes']) for row in sample_trace(out, rank)] for rank in (0, 1)]


@pytest.mark.parametrize('engine', [engine_param('ddp'), engine_param('fsdp2'), engine_param('zero2'),
                                    engine_param('zero3')])
def test_pass_tokens_on_ranks_with_other_pass_counts(engine, tmp_path, tiny_llama, mixed_15):
    """``pass_tokens`` on 15 rows of 1-6 problems (cut to 300 tokens): the ranks' shares of a step need different
    numbers of passes (most passes hold one row; the last step of an epoch deals 4 rows and 3). Under
    FSDP2 and ZeRO-2/3 (every pass communicates) the rank with fewer runs zero-weight padding passes, planned with the
    passes (no collective added: ``dynamic/padding_passes`` counts them); under DDP nothing is padded. Every engine's
    weights equal one process's over the same samples a step (1e-5: the gradient of the fixed layout)."""
    pack = {'integration': {'record_samples': True}, 'length_batching': {'mode': 'balanced', 'pass_tokens': 300}}
    common = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=4, max_length=300,
                  truncation_strategy='right')
    out = run_ranks(str(tmp_path / engine), tiny_llama, mixed_15, engine=engine, callbacks=['length_batching'],
                    pack=pack, **common)
    t0, t1 = assert_engine(out, engine)
    assert_same_steps(t0, t1)
    mine, theirs = _passes_by_rank(out)
    assert mine != theirs, (mine, theirs)  # the ranks' natural pass counts differ in some step
    padding = sum(row.get('dynamic/padding_passes', 0) for row in read_jsonl(os.path.join(out, 'logging.jsonl'))
                  if 'loss' in row)
    expected = sum(abs(a - b) for a, b in zip(mine, theirs))  # every step: the shorter rank pads up to the longer
    assert padding == (expected if engine != 'ddp' else 0), (padding, mine, theirs)
    for trace in (t0, t1):  # the pack's own collectives: none while passes run, whatever their number; after the
        # first step's set-up, one agreement a boundary (two where an epoch starts) — measured [5, 1, 2, 1]
        assert [s['pack_collectives_in_passes'] for s in trace['steps']] == [0] * len(trace['steps'])
        assert max(s['pack_collectives_boundary'] for s in trace['steps'][1:]) <= 2, trace['steps']
    ref = reference(str(tmp_path / f'{engine}-ref'), tiny_llama, mixed_15, out, gradient_accumulation_steps=2,
                    max_steps=4, max_length=300, truncation_strategy='right')
    assert_same_weights(out, ref)


@pytest.mark.start_first
@pytest.mark.parametrize('engine', [engine_param('fsdp2', slow=True), engine_param('zero3')])  # FSDP2 passes: below
def test_pieces_and_a_pass_cap_under_sharded_engines(engine, tmp_path, tiny_llama, dataset_15):
    """``micro_batch_cap`` pieces and ``memory_backoff``'s pass cap (a memory fraction seen by rank 1 alone) under a
    sharded engine: both ranks cut their micro-batches into the same number of passes (agreed at each step where a
    cap could cut them differently), a placeholder rank pads, and the weights equal one process's."""
    pack = {'integration': {'record_samples': True},
            'batch_growth': {'initial': 2, 'factor': 2, 'interval': 2, 'maximum': 4, 'micro_batch_cap': 2},
            'memory_backoff': {'clean_steps': 100}}
    common = dict(max_steps=5, lr_scheduler_type='cosine', warmup_ratio=0.0)
    out = run_ranks(str(tmp_path / engine), tiny_llama, dataset_15, engine=engine,
                    callbacks=['batch_growth', 'memory_backoff'], pack=pack,
                    faults={'1': {'memory': {'3': 0.99}}}, gradient_accumulation_steps=2, **common)
    t0, t1 = assert_engine(out, engine)
    assert_same_steps(t0, t1)
    caps = [(s['pass_limit'] or {}).get('samples') for s in t0['steps']]
    assert caps[-1] == 1 and t0['steps'][-1]['num_pieces'] == 2  # the cap from step 4 on, pieces after growth
    ref = reference(str(tmp_path / f'{engine}-ref'), tiny_llama, dataset_15, out, gradient_accumulation_steps=2,
                    **common)
    assert_same_weights(out, ref)


@pytest.fixture(scope='module')
def dataset_16(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    return str(write_gsm8k_dataset(fixture_dir / 'gsm8k-16.jsonl', 16))


@pytest.mark.parametrize('engine', [engine_param('fsdp2'), engine_param('zero2', slow=True), engine_param('zero3')])
def test_an_oom_on_one_rank_ends_the_run_and_the_checkpoint_resumes_below_it(engine, tmp_path, tiny_llama, dataset_16):
    """Under a sharded engine (no OOM recovery) rank 1 alone runs out of memory in step 2: every rank ends (no hang:
    the launcher is gone within 60 s of the OOM, the time in rank 1's note), the log names the pass, the budget and
    the setting to lower, and the run resumed from the step-1 checkpoint folds rank 1's note into a lower pass budget
    before its first step (an ``oom`` record with reason ``unrecovered`` and a ``pass_budget`` record), so it
    finishes."""
    import time
    pack = {'integration': {'record_samples': True}, 'batch_schedule': {'schedule': {0: 2}}}
    common = dict(gradient_accumulation_steps=2, max_steps=3, save_steps=1)
    workdir = str(tmp_path / engine)
    start = time.monotonic()
    log = run_ranks(workdir, tiny_llama, dataset_16, engine=engine, callbacks=['batch_schedule'], pack=pack,
                    faults={'1': {'oom_forward_passes': [2]}}, expect_failure=True, **common)
    failed_in, ended = time.monotonic() - start, time.time()
    with open(log, encoding='utf-8', errors='replace') as f:
        text = f.read()
    assert 'out of memory on rank 1 in a pass of 2 rows' in text and 'Lower per_device_train_batch_size' in text
    out = os.path.join(workdir, 'out')
    with open(os.path.join(out, 'dynamic_oom.rank1.json'), encoding='utf-8') as f:
        note = json.load(f)
    assert note['step'] == 1 and note['pass_size'] == 2 and note['engine'] in ('fsdp2', 'deepspeed')
    assert failed_in < 240, failed_in  # start-up, one step, then every rank ended (never the 300 s timeout)
    assert ended - note['time'] < 60, ended - note['time']  # every rank and the launcher gone within 60 s of the OOM
    run_ranks(workdir + '-resumed', tiny_llama, dataset_16, engine=engine, callbacks=['batch_schedule'], pack=pack,
              output_dir=out, resume_from_checkpoint=os.path.join(out, 'checkpoint-1'), **common)
    t0, t1 = assert_engine(out, engine)
    assert_same_steps(t0, t1)
    assert t0['global_step'] == 3
    records = read_jsonl(os.path.join(out, 'dynamic_decisions.jsonl'))
    assert [(d['reason'], d['values']['rank']) for d in records if d['kind'] == 'oom'] == [('unrecovered', 1)]
    [budget] = [d for d in records if d['kind'] == 'pass_budget' and d['reason'] == 'oom']
    assert budget['values']['new'] == 1 and budget['values']['unit'] == 'samples'
    assert (t0['steps'][0]['pass_limit'] or {}).get('samples') == 1  # the resumed run's first step within it

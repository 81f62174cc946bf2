"""The throughput benchmark's harness (benchmarks/throughput.py, throughput_child.py): how arms are written, and an
arm that fails is reported with its cause while the next one runs (no GPU, no training)."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def bench():
    from benchmarks import throughput
    return throughput


def test_arms_with_a_budget_a_layout_or_a_chain(bench):
    assert bench.parse_arm('pack_passes:8192') == {'label': 'pack_passes:8192', 'arms': [
        {'label': 'pack_passes:8192', 'arm': 'pack_passes', 'tokens': 8192, 'batch': None, 'ga': None,
         'engine': None}]}
    chain = bench.parse_arm('group_by_length@16x1|group_by_length@8x2')
    assert [(a['arm'], a['batch'], a['ga']) for a in chain['arms']] == [('group_by_length', 16, 1),
                                                                        ('group_by_length', 8, 2)]
    sharded = bench.parse_arm('group_by_length@8x2+zero3|group_by_length@4x4+zero3')
    assert [(a['batch'], a['engine']) for a in sharded['arms']] == [(8, 'zero3'), (4, 'zero3')]
    assert bench.parse_arm('pack_passes:4096+fsdp2')['arms'][0]['tokens'] == 4096
    for bad, words in (('pack_everything', 'is not one of'), ('random@16', 'BATCHxGA'), ('pack_passes:big', 'integer'),
                       ('pack_passes+zero4', 'engine after \\+ must be one of zero2, zero3, zero3_timed, fsdp2'),
                       ('random+zero3|random+fsdp2', 'same engine')):
        with pytest.raises(ValueError, match=words):
            bench.parse_arm(bad)
    assert bench.pack_settings('pack_passes_auto', 4, 2048) == {
        'length_batching': {'mode': 'balanced', 'pass_tokens': 'auto'}}
    assert bench.pack_settings('pack_passes_auto_padding_free', 4, 2048) == {
        'length_batching': {'mode': 'balanced', 'pass_tokens': 'auto', 'padding_free': True}}


def test_an_arm_under_an_engine_is_compared_with_the_arms_under_it(bench):
    def row(arm, tps):
        return {'arm': arm, 'real_tokens_per_s': tps, 'real_tokens_per_s_range': [tps, tps], 'passes': 4,
                'optimizer_steps': 4, 'padding': 0.1, 'rank_spread': 0.0, 'p50_step_s': 1.0, 'p90_step_s': 1.0,
                'peak_rss_gib': 1.0, 'peak_cuda_gib': 1.0, 'train_loss': 1.0}

    lines = bench.table([row('group_by_length@4x4', 100.0), row('pack_passes', 300.0),
                         row('group_by_length@4x4+zero3', 50.0), row('pack_passes+zero3', 80.0)], 1)
    ratios = {line.split(' | ')[0].strip('| '): line.split(' | ')[3] for line in lines if line.startswith('| ')}
    assert ratios['pack_passes'] == '3.00' and ratios['pack_passes+zero3'] == '1.60'
    assert ratios['group_by_length@4x4+zero3'] == '1.00'


def test_a_sharded_arm_runs_under_torchrun_with_one_process(bench, monkeypatch, tmp_path):
    launched = []

    class Child:
        def __init__(self, command, **kwargs):
            launched.append(command)
            self.stdout, self.returncode = iter(['[Rank 0] time (ms) | fwd: 1.0 | bwd: 2.0 | step: 3.0\n']), 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(bench.subprocess, 'Popen', Child)
    spec = {'arm': 'pack_passes', 'out': str(tmp_path / 'a'), 'engine': 'zero3'}
    bench.run_arms_in_one_process([spec], 1, True, lambda *a: None, tmp_path / 'child.log')
    bench.run_arms_in_one_process([{**spec, 'engine': None}], 1, True, lambda *a: None, tmp_path / 'child.log')
    assert launched[0][1:5] == ['-m', 'torch.distributed.run', '--nproc_per_node', '1']
    # quiet: the child's stdout that is no arm marker (DeepSpeed's timers) is kept in its log, not dropped
    assert (tmp_path / 'child.log').read_text(encoding='utf-8').count('time (ms) | fwd: 1.0') == 2
    assert launched[1][1] == str(bench.CHILD)
    with pytest.raises(AssertionError, match='one engine'):
        bench.run_arms_in_one_process([spec, {**spec, 'engine': 'fsdp2'}], 1, True, lambda *a: None)


def test_a_layout_must_keep_the_global_batch(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(['--batch', '4', '--ga', '4', '--arms', 'group_by_length@8x1'])
    assert 'group_by_length@8x1 is 8 x 1 = 8 samples a step; every arm trains --batch x --ga = 16' in (
        capsys.readouterr().err)


def test_the_oom_phase_alone_needs_its_memory_fraction(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(['--oom-only'])
    assert '--oom-only: needs --oom-fraction' in capsys.readouterr().err


def test_a_failing_arm_says_why_and_the_next_one_runs(bench, tmp_path, capsys):
    """Two arms in one child: both fail (the bare loop needs an ms-swift arm's lengths first); each failure is
    printed with its cause, the child goes on to the next and exits normally."""
    done = []
    specs = [{'arm': 'bare_loop', 'label': f'bare_loop#{k}', 'out': str(tmp_path / f'out-{k}'), 'procs': 1,
              'flags': {}, 'seed': 0, 'device': 'cpu'} for k in (1, 2)]
    bench.run_arms_in_one_process(specs, 1, True, lambda spec, ranks: done.append(spec), tmp_path / 'child.log')
    err = capsys.readouterr().err
    assert not done
    for k in (1, 2):
        assert f"[arm-skipped] bare_loop#{k}: failed after" in err and "needs the rows' lengths" in err
    assert 'child process died' not in err
    assert 'Traceback' in (tmp_path / 'child.log').read_text()  # the whole cause, in the log


def _record(step_s: list[float], tokens: int, retries: list[int] | None = None) -> dict:
    """One rank's record: a step's end after each of ``step_s`` seconds, ``tokens`` real tokens a step, the
    allocator's retry count at each step's end."""
    ends, t = [], 0.0
    for s in step_s:
        t += s
        ends.append(t)
    record = {'step_end': ends, 'micro': [{'step': i, 'real': tokens, 'padded': tokens, 'work': 1}
                                          for i in range(len(step_s))]}
    if retries is not None:
        record['alloc'] = [{'num_alloc_retries': r, 'inactive_split_bytes.all.current': 2**30} for r in retries]
    return record


def test_the_oom_phase_compares_the_second_halves_step_by_step(bench):
    """After an OOM, a run whose second half is slower than its planned twin's at two steps of four: the tokens/s
    ratio over the half, each step against its twin, and the allocator retries counted over the half only."""
    oom = _record([5.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 2.0], 100, retries=[0, 3, 3, 3, 4, 4, 4, 6])
    planned = _record([1.0] * 8, 100, retries=[0] * 8)
    compared = bench.second_halves([oom], [planned])
    assert compared['worst_step_ratio'] == 2.0 and compared['median_step_ratio'] == 1.5
    assert abs(compared['tokens_ratio'] - 4 / 6) < 1e-9  # 400 tokens in 6 s against 400 in 4 s
    assert compared['retries'] == 3 and compared['planned_retries'] == 0  # the first half's 3 not counted
    assert compared['inactive_gib'] == 1.0
    assert bench.second_halves([planned], [planned])['tokens_ratio'] == 1.0


def test_the_engine_an_arm_ran_is_read_from_the_trainer():
    """An arm that asked for ZeRO-3 and trained without it must be seen: the child names the engine from accelerate's
    state (the zero stage, the FSDP version), not from what the arm asked for."""
    from types import SimpleNamespace

    from benchmarks.throughput_child import engine_ran

    def trainer(kind, **plugins):
        state = SimpleNamespace(distributed_type=SimpleNamespace(name=kind), **plugins)
        return SimpleNamespace(accelerator=SimpleNamespace(state=state), model_wrapped=SimpleNamespace(), model=None)

    assert engine_ran(trainer('DEEPSPEED', deepspeed_plugin=SimpleNamespace(zero_stage=3)))['name'] == 'zero3'
    assert engine_ran(trainer('DEEPSPEED', deepspeed_plugin=SimpleNamespace(zero_stage=2)))['name'] == 'zero2'
    assert engine_ran(trainer('FSDP', fsdp_plugin=SimpleNamespace(fsdp_version=2)))['name'] == 'fsdp2'
    assert engine_ran(trainer('FSDP', fsdp_plugin=SimpleNamespace()))['name'] == 'fsdp1'
    assert engine_ran(trainer('MULTI_GPU'))['name'] == 'ddp'
    ran = engine_ran(trainer('NO'))
    assert ran == {'name': 'single', 'distributed_type': 'NO', 'wrapper': 'SimpleNamespace'}


def test_the_timed_zero3_engine_is_ms_swifts_preset_with_the_timers_built_when_asked():
    from benchmarks import throughput
    timed = throughput.engine_settings('zero3_timed')
    assert timed['log_level'] == 'info' and timed['deepspeed']['wall_clock_breakdown'] is True
    assert timed['deepspeed']['zero_optimization']['stage'] == 3
    assert timed['deepspeed']['zero_optimization']['log_trace_cache_warnings'] is True
    assert throughput.engine_settings('zero3') == {'deepspeed': 'zero3'}

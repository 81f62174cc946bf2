"""The growth study's scripts (issue 39). ``scripts/bench_growth_study.py``: arm B's rows-indexed stages as a valid
``batch_growth`` table, the study's rules (beta2, each arm's LR, one more rung past an edge, the futility look), the
noise scale from the logged terms; on the tiny model, B's LR per step is the baseline's at the same rows x sqrt(the
batch ratio) and the eval loss is token-weighted. ``scripts/growth_study.sh``: the whole study on the tiny model
(slow)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from swift_dynamic_callbacks.config.pack import parse_section

pytestmark = pytest.mark.start_first  # among the longest files of the default run (--dist loadfile): started first

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDY = os.path.join(ROOT, 'scripts', 'growth_study.sh')


@pytest.fixture(scope='module')
def bench():
    from benchmarks import growth_study
    return growth_study


def test_arm_b_is_a_batch_growth_table_at_the_rows_of_its_stages(bench):
    assert bench.growth_stages(128) == {0: 1, 32: 2, 64: 4}
    # rows 0-31 at 2 rows a step (16 steps), 32-63 at 4 (8 steps), 64-127 at 8 (8 steps): 32 steps
    assert bench.rows_table(bench.growth_stages(128), ga=2) == {0: 1, 16: 2, 24: 4}
    overrides, pack, callbacks = bench.arm_settings('growth_b', 128, 2)
    assert overrides == {'per_device_train_batch_size': 1} and callbacks == ['batch_growth']
    config = parse_section(pack, callbacks).callback_config('batch_growth')  # ConfigError on a bad setting
    assert config.policy == 'table' and dict(config.table) == {0: 1, 16: 2, 24: 4} and config.lr_scaling == 'sqrt'
    for arm, micro in (('baseline', 1), ('control_a', 2), ('fixed_4', 4), ('fixed_8', 8)):
        assert bench.arm_settings(arm, 128, 2) == ({'per_device_train_batch_size': micro}, {}, [])
    with pytest.raises(ValueError, match='not whole steps'):
        bench.rows_table({0: 1, 3: 2}, ga=2)
    with pytest.raises(ValueError, match='starts at row 0'):
        bench.rows_table({4: 1}, ga=2)


@pytest.mark.parametrize('arm', ['baseline', 'control_a', 'growth_b', 'fixed_4', 'fixed_8', 'twin_c', 'seesaw_c'])
def test_each_arms_yaml_is_the_arm_the_study_runs(bench, arm):
    """``configs/growth_39/<arm>.yaml``, the file a user copies: its pack section and micro-batch are the study's
    settings of that arm (``arm_settings``), and they validate."""
    import yaml
    with open(os.path.join(ROOT, 'configs', 'growth_39', f'{arm}.yaml'), encoding='utf-8') as f:
        config = yaml.safe_load(f)
    overrides, pack, callbacks = bench.arm_settings(arm, 128, 2)
    assert config['per_device_train_batch_size'] == overrides['per_device_train_batch_size']
    assert config['gradient_accumulation_steps'] == 2 and config['adam_beta2'] == 0.95
    assert config['callbacks'] == [*callbacks, 'training_log']
    section = dict(config.get('dynamic_callbacks', {}))
    assert section.pop('training_log') == {'memory': False}
    assert section == pack
    parse_section(section, callbacks)  # ConfigError on a bad setting


def test_each_tuned_arms_yaml_has_the_lr_the_study_chose(bench):
    """The LR in ``configs/growth_39/<arm>.yaml`` is the one the committed raw lines pick on the tuning seeds (the
    lowest mean eval loss over seeds 0 and 1 at beta2 0.95), for every arm whose tuning is done (its best LR
    bracketed by a worse one on each side: nothing left to extend)."""
    import yaml
    results = bench.read_jsonl([os.path.join(ROOT, 'docs', 'figures', 'growth_39.jsonl')])
    chosen = dict(line.split() for line in bench.pick_lrs(results, [0, 1], 0.95, 'best'))
    open_edges = {line.split()[0] for line in bench.pick_lrs(results, [0, 1], 0.95, 'extend')}
    tuned = {arm: lr for arm, lr in chosen.items() if arm not in open_edges}
    assert {'baseline', 'control_a', 'growth_b', 'fixed_4', 'fixed_8', 'twin_c', 'seesaw_c'} <= set(tuned)
    for arm, lr in tuned.items():
        with open(os.path.join(ROOT, 'configs', 'growth_39', f'{arm}.yaml'), encoding='utf-8') as f:
            assert float(yaml.safe_load(f)['learning_rate']) == pytest.approx(float(lr)), arm


def test_arm_cs_step_schedule_and_seesaw_on_it(bench):
    from swift_dynamic_callbacks.policies.growth import seesaw_cuts, seesaw_size
    from swift_dynamic_callbacks.policies.lr import schedule_factor
    _, pack, callbacks = bench.arm_settings('seesaw_c', 128, 2)
    assert callbacks == ['batch_growth', 'lr_schedule'] and pack['batch_growth']['policy'] == 'seesaw'
    config = parse_section(pack, callbacks).callback_config('lr_schedule')
    schedule = {'decay': 'steps', 'warmup': config.warmup, 'steps': [list(x) for x in config.steps.items()],
                'total': 64, 'guard': 1.0}
    # the twin's 64 steps of 2 rows: warmup over 6 steps, then x1 to row 32, x1/2 to row 64, x1/4 to the end
    factors = [schedule_factor(schedule, step) for step in range(64)]
    assert factors[:7] == pytest.approx([0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1])
    assert set(factors[7:16]) == {1.0} and set(factors[16:32]) == {0.5} and set(factors[32:]) == {0.25}
    # Seesaw on it: one growth by 2 at each cut, up to 4 a pass: 1, 2, 4 (x GA 2: 2, 4, 8 rows a step)
    assert [seesaw_size(seesaw_cuts(f, 1.0, 2.0), initial=1, factor=2.0, maximum=4) for f in (1.0, 0.5, 0.25)] == [
        1, 2, 4]


def line(arm: str, seed: int, loss: float, beta2: float = 0.95, steps: int = 64) -> dict:
    return {'arm': arm, 'seed': seed, 'adam_beta2': beta2, 'eval_loss': loss, 'optimizer_steps': steps}


def test_beta2_is_095_only_within_03_percent_of_0999_on_the_tuning_seeds(bench):
    runs = [line('baseline@0.002', 0, 0.800, 0.999), line('baseline@0.002', 1, 0.810, 0.999),
            line('baseline@0.002', 0, 0.803, 0.95)]
    assert bench.pick_beta2(runs, [0, 1], 0.002) == ''  # seed 1 at 0.95 missing
    close = runs + [line('baseline@0.002', 1, 0.8094, 0.95)]  # mean 0.8062 vs 0.8050: +0.15 %
    assert bench.pick_beta2(close, [0, 1], 0.002) == '0.95'
    far = runs + [line('baseline@0.002', 1, 0.815, 0.95)]  # mean 0.809: +0.5 %
    assert bench.pick_beta2(far, [0, 1], 0.002) == '0.999'
    assert bench.pick_beta2(far + [line('baseline@0.002', 2, 0.5, 0.95)], [0, 1], 0.002) == '0.999'  # seed 2: no


def test_each_arms_lr_the_next_rung_past_an_edge_and_the_futility_look(bench):
    assert bench.LADDER[2:7] == ('0.001', '0.00141', '0.002', '0.00283', '0.004')
    runs = [line('control_a@0.00283', 0, 0.82), line('control_a@0.00283', 1, 0.84),
            line('control_a@0.004', 0, 0.81), line('control_a@0.004', 1, 0.82),  # best at its highest LR
            line('growth_b@0.002', 0, 0.80), line('growth_b@0.002', 1, 0.80),
            line('growth_b@0.00141', 0, 0.81), line('growth_b@0.00141', 1, 0.81),
            line('growth_b@0.00283', 0, 0.79), line('growth_b@0.00283', 1, 0.83),  # worse on the mean
            line('baseline@0.002', 0, 0.79), line('baseline@0.002', 1, 0.79),
            line('baseline@0.004', 0, 0.70),  # one tuning seed only: not a candidate
            line('control_a@0.00566', 0, 0.5, beta2=0.999), line('control_a@0.00566', 1, 0.5, beta2=0.999)]
    assert bench.pick_lrs(runs, [0, 1], 0.95, 'best') == [
        'baseline 0.002', 'control_a 0.004', 'growth_b 0.002']
    assert bench.pick_lrs(runs, [0, 1], 0.95, 'extend') == [
        'baseline 0.00141', 'baseline 0.00283', 'control_a 0.00566']  # growth_b is bracketed
    chosen = {'baseline': '0.002', 'control_a': '0.004', 'growth_b': '0.002'}
    report = [line('baseline@0.002', s, 0.80) for s in (2, 3)] + [
        line('control_a@0.004', 2, 0.82), line('control_a@0.004', 3, 0.8130),  # +2.0 %, +1.6 %: stopped
        line('growth_b@0.002', 2, 0.81), line('growth_b@0.002', 3, 0.8130)]  # +1.25 %, +1.6 %: mean 1.4 %
    assert bench.futility(report, [2, 3], 0.95, chosen) == ['control_a']
    assert bench.futility(report, [2, 3, 4], 0.95, chosen) == []  # seed 4 missing: no look yet


def test_two_streams_never_run_the_same_run_and_a_dead_streams_claim_is_taken_over(bench, tmp_path):
    claims, jsonl = str(tmp_path / 'claims'), str(tmp_path / 'g.jsonl')
    key = bench.run_key('baseline@0.002', 2, 0.95)
    assert key == 'baseline@0.002-b0.95-seed2'
    assert bench.claim(claims, key) is True
    assert bench.claim(claims, key) is False  # held by a live process (this one)
    gone = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
    dead = tmp_path / 'claims' / bench.run_key('growth_b@0.002', 2, 0.95)
    dead.write_text(gone.stdout.strip(), encoding='utf-8')
    assert bench.claim(claims, dead.name) is True and dead.read_text(encoding='utf-8') == str(os.getpid())
    # a stream picks only when every live claim has its line: both lines there, no wait
    with open(jsonl, 'w', encoding='utf-8') as f:
        for arm in ('baseline@0.002', 'growth_b@0.002'):
            f.write(json.dumps(line(arm, 2, 0.8)) + '\n')
    bench.wait_for_claims(claims, jsonl, poll=0.01)
    # a live claim without its line: still waiting after the poll
    import threading
    bench.claim(claims, bench.run_key('control_a@0.002', 2, 0.95))
    waiter = threading.Thread(target=bench.wait_for_claims, args=(claims, jsonl), kwargs={'poll': 0.01}, daemon=True)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()
    with open(jsonl, 'a', encoding='utf-8') as f:
        f.write(json.dumps(line('control_a@0.002', 2, 0.8)) + '\n')
    waiter.join(5)
    assert not waiter.is_alive()


def test_an_extension_pick_does_not_wait_for_the_runs_it_asks_for(bench, tmp_path, capsys, monkeypatch):
    """Two streams reach the same extension round: the second does not wait for the first's run of that round (it
    runs the round's other runs), but it does wait for a run outside the round (it could change the pick)."""
    import functools
    import threading
    # a fast poll, so the waiting pick ends inside this test (a thread left polling prints into a later test's output)
    monkeypatch.setattr(bench, 'wait_for_claims', functools.partial(bench.wait_for_claims, poll=0.01))
    claims, jsonl = str(tmp_path / 'claims'), tmp_path / 'g.jsonl'
    runs = [line('baseline@0.002', s, 0.80) for s in (0, 1)] + [line('baseline@0.00283', s, 0.81) for s in (0, 1)]
    jsonl.write_text(''.join(json.dumps(r) + '\n' for r in runs), encoding='utf-8')
    argv = ['--from-jsonl', str(jsonl), '--tune-seeds', '0', '1', '--beta2', '0.95', '--pick', 'extend',
            '--claims', claims]
    assert bench.claim(claims, bench.run_key('baseline@0.00141', 0, 0.95))  # this round's run, another stream's
    assert bench.main(argv) == 0
    assert capsys.readouterr().out.strip() == 'baseline 0.00141'
    assert bench.claim(claims, bench.run_key('control_a@0.002', 0, 0.95))  # not of this round: wait for it
    waiter = threading.Thread(target=bench.main, args=(argv, ), daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()
    os.remove(os.path.join(claims, bench.run_key('control_a@0.002', 0, 0.95)))  # (as if its stream had died)
    os.remove(os.path.join(claims, bench.run_key('baseline@0.00141', 0, 0.95)))
    waiter.join(10)
    assert not waiter.is_alive() and capsys.readouterr().out.strip() == 'baseline 0.00141'  # no claim left: it picks


def test_which_runs_of_another_stream_a_pick_waits_for(bench):
    import argparse

    def args(pick, report=None):
        return argparse.Namespace(pick=pick, tune_seeds=[0, 1], report_seeds=report, lrs=[0.002], beta2=0.95,
                                  from_jsonl=[])
    tuning, reporting = 'control_a@0.002-b0.95-seed1', 'control_a@0.002-b0.95-seed4'
    assert bench.cannot_change([tuning, reporting], args('beta2'))  # beta2 reads the baseline at 2e-3 only
    assert not bench.cannot_change(['baseline@0.002-b0.999-seed0'], args('beta2'))
    assert bench.cannot_change([reporting], args('best')) and not bench.cannot_change([tuning], args('best'))
    assert bench.cannot_change([tuning], args('futility', [2, 3]))
    assert not bench.cannot_change([reporting], args('futility', [2, 3, 4]))
    assert not bench.cannot_change([reporting], args(None))  # the tables wait for every run
    assert not bench.cannot_change(['not a run key'], args('best'))


def test_the_step_log_holds_each_steps_pass_layout(bench):
    logged = [{'global_step/max_steps': f'{k}/2', 'dynamic/global_batch_size': 4, 'dynamic/batch_size': b,
               'dynamic/samples_seen': 4 * k, 'dynamic/padded_tokens_seen': padded, 'loss': 1.0, 'grad_norm': 1.0,
               'learning_rate': 1e-3} for k, b, padded in ((1, 2, 800), (2, 4, 1500))]
    steps = bench.step_log(logged, {})
    assert steps['passes'] == [2, 1] and steps['padded'] == [800, 700] and steps['batch'] == [4, 4]


def test_the_noise_scale_in_rows_from_the_logged_terms(bench):
    # |G|^2 = 1, tr(Sigma) = 100 (tokens): E|g_b|^2 = 1 + 100 / b at b = 50 and 100 tokens, 2 rows a step
    steps = {'noise': [[3.0, 50, 2.0, 100, 2]] * 5 + [None]}
    assert bench.noise_scale(steps) == pytest.approx(100 / 50)  # 100 tokens of B_simple at 50 tokens a row
    assert bench.noise_scale({'noise': [None]}) is None


def test_the_tables_and_the_paired_comparisons(bench, tmp_path, capsys):
    jsonl = tmp_path / 'g.jsonl'
    rows = [dict(line('baseline@0.002', s, 0.80 + s / 1000), train_loss=1.0, wall_s=600.0) for s in (0, 1, 2, 3)]
    rows += [dict(line('growth_b@0.002', s, 0.80 + s / 500, steps=32), train_loss=1.0, wall_s=500.0)
             for s in (0, 1, 2, 3)]
    rows += [dict(line('fixed_4@0.002', s, 0.84, steps=16), train_loss=1.0, wall_s=500.0) for s in (0, 1, 2)]
    jsonl.write_text(''.join(json.dumps(r) + '\n' for r in rows), encoding='utf-8')
    assert bench.main(['--from-jsonl', str(jsonl), '--tune-seeds', '0', '1', '--report-seeds', '2', '3']) == 0
    out = capsys.readouterr().out
    assert '| baseline | **0.8005** |' in out
    # seeds 2, 3: 0.804 / 0.802 = +0.25 %, 0.806 / 0.803 = +0.37 %
    assert '| growth_b | 0.95 | 2 | 50% | +0.31% |' in out
    growth = next(x for x in out.splitlines() if x.startswith('| growth_b | 0.95 | 2 | 50% |'))
    # half the steps on both seeds, but two seeds leave the interval wide: past +1 %
    assert growth.endswith('| [-0.48%, +1.10%] | not shown (interval up to +1.10%) |')
    assert 'seesaw_c against its fixed-batch twin' in out
    # a frontier arm runs on the look's seeds (the first 6 reporting seeds; here both): 1 of 2 run
    frontier = next(x for x in out.splitlines() if x.startswith('| fixed_4 | 0.95 | 1 | 75% |'))
    assert frontier.endswith(', 1 of 2 seeds |')
    with pytest.raises(SystemExit):
        bench.main(['--from-jsonl', str(jsonl), '--tune-seeds', '0', '1', '--report-seeds', '1'])


def test_seesaw_is_compared_with_control_a_at_the_same_steps_and_with_its_twin(bench, tmp_path, capsys):
    """The issue's goal for a growth arm: lower loss than control A at the same steps. Both growth arms are paired
    with A; only Seesaw with its twin (the twin is no growth arm, so it is not paired with A)."""
    jsonl = tmp_path / 'g.jsonl'
    arms = {'baseline@0.001': (0.80, 64), 'control_a@0.002': (0.81, 32), 'growth_b@0.001': (0.82, 32),
            'twin_c@0.001': (0.79, 64), 'seesaw_c@0.001': (0.805, 32)}
    rows = [dict(line(arm, s, loss + s / 1000, steps=steps), train_loss=1.0, wall_s=1.0)
            for arm, (loss, steps) in arms.items() for s in (0, 1, 2, 3)]
    jsonl.write_text(''.join(json.dumps(r) + '\n' for r in rows), encoding='utf-8')
    assert bench.main(['--from-jsonl', str(jsonl), '--tune-seeds', '0', '1', '--report-seeds', '2', '3']) == 0
    out = capsys.readouterr().out
    against_a = out.split('the growth arms against control A')[1].split('\n\n')[0]
    assert [x.split(' | ')[0] for x in against_a.splitlines() if x.startswith('| ') and '---' not in x][1:] == [
        '| growth_b', '| seesaw_c']
    seesaw = next(x for x in against_a.splitlines() if x.startswith('| seesaw_c'))
    assert '| 0% | -0.62% |' in seesaw  # (0.807 / 0.812 + 0.808 / 0.813) / 2 - 1: at the same 32 steps
    against_twin = out.split('seesaw_c against its fixed-batch twin')[1].split('\n\n')[0]
    assert [x for x in against_twin.splitlines() if x.startswith('| ') and '---' not in x][1].startswith(
        '| seesaw_c | 0.95 | 2 | 50% | +1.89% |')  # 0.807 / 0.792, 0.808 / 0.793


def test_an_arm_the_futility_look_stopped_is_marked_final(bench):
    """Above +1.5 % on the mean of the look's seeds and no later run: stopped; a later run (the look let it go on),
    a missing look seed, a mean at +1.5 % or below, or a frontier arm (run on the look's seeds only): not."""
    look = [2, 3, 4]
    base = [line('baseline@0.001', s, 0.80) for s in look]
    slow = [line('growth_b@0.001', s, 0.80 * 1.02, steps=32) for s in look]
    close = [line('control_a@0.002', s, 0.80 * 1.01, steps=32) for s in look]
    frontier = [line('fixed_8@0.002', s, 0.80 * 1.09, steps=8) for s in look]  # the look's seeds only, by design
    stopped = bench.stopped_at_look(base + slow + close + frontier, look + [5, 6], 3)
    assert list(stopped) == [('growth_b', 0.95)] and stopped[('growth_b', 0.95)] == pytest.approx(0.02)
    assert bench.stopped_at_look(base + slow + [line('growth_b@0.001', 5, 0.9, steps=32)], look + [5], 3) == {}
    # arm C: Seesaw above the limit stops its twin too (the twin's own mean is far below it), with Seesaw's mean
    seesaw = [line('seesaw_c@0.002', s, 0.80 * 1.02, steps=32) for s in look]
    twin = [line('twin_c@0.002', s, 0.80 * 0.99) for s in look]
    stopped_c = bench.stopped_at_look(base + seesaw + twin, look + [5], 3)
    assert stopped_c == {('seesaw_c', 0.95): pytest.approx(0.02), ('twin_c', 0.95): pytest.approx(0.02)}
    assert bench.stopped_at_look(base + twin, look + [5], 3) == {}  # a twin alone: nothing stops it
    assert bench.stopped_at_look(base + slow[:2], look + [5], 3) == {}


def test_the_goal_of_a_paired_comparison(bench):
    pairs = [({'optimizer_steps': 32}, {'optimizer_steps': 64})] * 3
    assert bench.goal(pairs, 0.009, True, 3) == 'met'
    assert bench.goal(pairs, 0.012, True, 12) == 'not shown (interval up to +1.20%), 3 of 12 seeds'
    slow = pairs + [({'optimizer_steps': 40}, {'optimizer_steps': 64})]
    assert bench.goal(slow, 0.0, True, 4) == 'not shown (fewer than 40 % of the steps saved)'
    assert bench.goal(pairs, -0.001, False, 3) == 'met' and bench.goal(pairs, 0.001, False, 3).startswith('not')


def test_a_runs_gpu_seconds_priced_from_its_pass_layout(bench):
    grid = {(1, 100): 0.1, (1, 300): 0.3, (4, 100): 0.2, (4, 300): 0.4}
    assert bench.pass_cost(grid, 1, 200) == pytest.approx(0.2)  # linear in length
    assert bench.pass_cost(grid, 3, 50) == 0.2 and bench.pass_cost(grid, 1.5, 900) == 0.3  # nearest rows, clamped
    # two steps: 2 passes of 1 row x 100 tokens, then 2 passes of 4 rows x 300 tokens; optimizer 0.01 a step
    steps = {'batch': [2, 8], 'passes': [2, 2], 'padded': [200, 2400]}
    assert bench.layout_seconds(steps, grid, 0.01) == pytest.approx(2 * 0.1 + 0.01 + 2 * 0.4 + 0.01)
    # a line from before the layout was logged: its totals spread over the steps by rows
    assert bench.layout_seconds({'batch': [4, 4]}, grid, 0.0, total=(2, 800)) == pytest.approx(2 * 0.2)
    clock = [{'kind': 'pass', 'rows': r, 'length': n, 'seconds': t} for (r, n), t in grid.items()]
    clock += [{'kind': 'optimizer_step', 'seconds': 0.01},
              {'kind': 'arm', 'train_s': 2.04, **steps}, {'kind': 'arm', 'train_s': 99.0, 'warmup': True, **steps}]
    got, optimizer, factor = bench.gpu_estimates(clock)
    assert got == grid and optimizer == 0.01 and factor == pytest.approx(2.0)  # measured 2.04 s, priced 1.02 s
    assert bench.gpu_estimates([{'kind': 'arm', 'train_s': 1.0}]) is None


def test_the_frontier_table_puts_each_arm_on_both_clocks(bench, tmp_path, capsys):
    rows = [dict(line('baseline@0.002', s, 0.90 if s == 3 else 0.80), passes=128) for s in (0, 1, 2, 3)]
    rows += [dict(line('fixed_4@0.004', s, 0.82 + s / 100, steps=16), passes=32) for s in (0, 1, 2)]
    rows += [dict(line('baseline@0.002', s, 0.80, beta2=0.999), passes=128) for s in (0, 1)]
    clock = [{'kind': 'arm', 'arm': 'fixed_4', 'train_s': t, 'device': 'GPU X'} for t in (10.0, 12.0)]
    clock += [{'kind': 'arm', 'arm': 'baseline', 'train_s': 99.0, 'warmup': True, 'device': 'GPU X'},
              {'kind': 'arm', 'arm': 'baseline', 'train_s': 30.0, 'device': 'GPU X'}, {'kind': 'pass', 'rows': 1}]
    assert bench.gpu_seconds(clock) == ({'fixed_4': 11.0, 'baseline': 30.0}, 'GPU X')
    png = tmp_path / 'f.png'
    bench.frontier(rows, [0, 1], [2, 3], clock, str(png))
    out = capsys.readouterr().out
    # fixed_4 did not run seed 3: each arm's loss: its mean over seed 2 (the baseline's 0.90 on seed 3 is out)
    assert 'the reporting seeds every arm ran, [2]' in out
    assert '| baseline | 0.002 | 64 | 128 | 30.0 | - | 1 | 0.80000 |' in out  # no pass grid: no estimate
    assert '| fixed_4 | 0.004 | 16 | 32 | 11.0 | - | 1 | 0.84000 |' in out
    assert 'training on GPU X' in out and png.stat().st_size > 0


@pytest.mark.e2e
def test_b_runs_the_baselines_lr_schedule_in_rows_and_the_eval_loss_is_token_weighted(bench, tmp_path):
    """Tiny model, 16 rows: B takes 2 + 1 + 1 steps of 2, 4, 8 rows; the LR of each of its steps is the baseline's
    at the step that starts at the same row, times sqrt(batch / 2); the eval loss is the same whatever the eval
    batching (token-weighted), and the per-step columns are there."""
    jsonl = tmp_path / 'g.jsonl'
    argv = ['--model', 'tiny', '--samples', '16', '--eval-rows', '8', '--lrs', '0.002', '--beta2', '0.95',
            '--out', str(tmp_path / 'out'), '--jsonl', str(jsonl)]
    assert bench.main([*argv, '--arms', 'baseline', 'growth_b']) == 0
    runs = {r['arm']: r for r in map(json.loads, jsonl.read_text(encoding='utf-8').splitlines())}
    base, grown = runs['baseline@0.002'], runs['growth_b@0.002']
    assert (base['optimizer_steps'], grown['optimizer_steps']) == (8, 4) and grown['passes'] == 8
    assert grown['steps']['batch'] == [2, 2, 4, 8] and grown['steps']['rows'] == [2, 4, 8, 16]
    assert base['steps']['rows'] == list(range(2, 18, 2)) and base['adam_beta2'] == 0.95
    for lr, batch, rows in zip(grown['steps']['lr'], grown['steps']['batch'], grown['steps']['rows']):
        start = (rows - batch) // 2  # the baseline's step (0-based) that starts at the same row
        assert lr == pytest.approx(base['steps']['lr'][start] * math.sqrt(batch / 2), rel=1e-3)
    for run in (base, grown):
        assert run['eval_tokens'] > 0 and run['eval_rows'] == 8 and run['eval_loss'] > 0
        assert all(r is None or 0 < r < 2 for r in run['steps']['update_rms'])
        assert run['steps']['update_rms'][-1] is not None and run['steps']['noise'][-1] is not None
    # the same seed again, one eval batch of 8 rows instead of two of 4: the same token-weighted loss
    original = bench.run_arm

    def one_batch(*args, **kwargs):
        from swift_dynamic_callbacks.testing import tiny
        real = tiny.offline_sft_kwargs
        tiny.offline_sft_kwargs = lambda *a, **k: real(*a, **{**k, 'per_device_eval_batch_size': 8})
        try:
            return original(*args, **kwargs)
        finally:
            tiny.offline_sft_kwargs = real

    bench.run_arm = one_batch
    try:
        again = tmp_path / 'again.jsonl'
        assert bench.main([*argv[:-1], str(again), '--arms', 'baseline']) == 0
    finally:
        bench.run_arm = original
    [rerun] = map(json.loads, again.read_text(encoding='utf-8').splitlines())
    assert rerun['eval_tokens'] == base['eval_tokens']
    assert rerun['eval_loss'] == pytest.approx(base['eval_loss'], rel=1e-4)


@pytest.mark.e2e
def test_arm_c_on_the_tiny_model_runs_its_lr_and_batch_by_rows(bench, tmp_path):
    """Tiny model, 16 rows: the twin takes 8 steps of 2 rows at eta x (warmup), 1, 1/2 from row 4, 1/4 from row 8;
    Seesaw takes 2, 2, 4, 8 rows a step (4 steps) at eta x (warmup), 1, 1/sqrt(2), 1/2: each stage at the same rows."""
    jsonl = tmp_path / 'c.jsonl'
    assert bench.main(['--model', 'tiny', '--samples', '16', '--eval-rows', '8', '--lrs', '0.002', '--beta2', '0.95',
                       '--out', str(tmp_path / 'out'), '--jsonl', str(jsonl), '--arms', 'twin_c', 'seesaw_c']) == 0
    runs = {r['arm']: r for r in map(json.loads, jsonl.read_text(encoding='utf-8').splitlines())}
    twin, seesaw = runs['twin_c@0.002'], runs['seesaw_c@0.002']
    assert twin['optimizer_steps'] == 8 and twin['steps']['batch'] == [2] * 8
    assert twin['steps']['lr'] == pytest.approx([0, 2e-3, 1e-3, 1e-3, 5e-4, 5e-4, 5e-4, 5e-4], rel=1e-3)
    assert seesaw['optimizer_steps'] == 4 and seesaw['steps']['batch'] == [2, 2, 4, 8]
    assert seesaw['steps']['rows'] == [2, 4, 8, 16]
    assert seesaw['steps']['lr'] == pytest.approx([0, 2e-3, 2e-3 / math.sqrt(2), 1e-3], rel=1e-3)


@pytest.mark.slow
def test_the_study_on_the_tiny_model(tmp_path):
    """The whole study script on one core: beta2 on one tuning seed, A and B at one LR each, the three arms on one
    reporting seed (no futility look before it), the tables; a second call runs nothing new."""
    jsonl = tmp_path / 'study.jsonl'
    env = {**os.environ, 'PYTHON': sys.executable, 'OUT': str(tmp_path / 'out'), 'MODEL': 'tiny', 'SAMPLES': '16',
           'EVAL_ROWS': '8', 'TUNE_SEEDS': '0', 'REPORT_SEEDS': '1', 'A_LRS': '0.00283', 'B_LRS': '0.002',
           'BASE_LRS': '', 'EXTEND': '0', 'CORE': ''}
    done = subprocess.run(['bash', STUDY, str(jsonl)], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(x) for x in jsonl.read_text(encoding='utf-8').splitlines()]
    assert [(r['arm'], r['seed'], r['adam_beta2']) for r in rows[:4]] == [
        ('baseline@0.002', 0, 0.999), ('baseline@0.002', 0, 0.95), ('control_a@0.00283', 0, rows[2]['adam_beta2']),
        ('growth_b@0.002', 0, rows[2]['adam_beta2'])]
    beta2 = rows[2]['adam_beta2']
    assert sorted(r['arm'] for r in rows[4:]) == ['baseline@0.002', 'control_a@0.00283', 'growth_b@0.002']
    assert all(r['seed'] == 1 and r['adam_beta2'] == beta2 for r in rows[4:])
    assert f'beta2 {beta2:g}' in done.stdout and '| growth_b | ' in done.stdout
    again = subprocess.run(['bash', STUDY, str(jsonl)], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and len(jsonl.read_text(encoding='utf-8').splitlines()) == len(rows)


@pytest.mark.slow
def test_the_frontier_stage_tunes_the_fixed_micro_batches_and_runs_them_on_the_looks_seeds(tmp_path):
    """STAGE=frontier on the tiny model: fixed_4 and fixed_8 at one LR each on the tuning seed, then each at its
    best on the reporting seeds of the futility look (the first one here), nothing else."""
    jsonl = tmp_path / 'study.jsonl'
    env = {**os.environ, 'PYTHON': sys.executable, 'OUT': str(tmp_path / 'out'), 'MODEL': 'tiny', 'SAMPLES': '16',
           'EVAL_ROWS': '8', 'TUNE_SEEDS': '0', 'REPORT_SEEDS': '1 2', 'FUTILITY_AT': '1', 'F4_LRS': '0.002',
           'F8_LRS': '0.004', 'EXTEND': '0', 'CORE': '', 'STAGE': 'frontier', 'BETA2': '0.95'}
    done = subprocess.run(['bash', STUDY, str(jsonl)], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(x) for x in jsonl.read_text(encoding='utf-8').splitlines()]
    assert [(r['arm'], r['seed'], r['optimizer_steps']) for r in rows] == [
        ('fixed_4@0.002', 0, 2), ('fixed_8@0.004', 0, 1), ('fixed_4@0.002', 1, 2), ('fixed_8@0.004', 1, 1)]
    assert 'frontier arms at their LRs' in done.stdout


@pytest.mark.slow
def test_the_futility_look_stops_arm_c_and_its_twin(tmp_path):
    """STAGE=c on the tiny model: the twin and Seesaw tuned at one LR on the tuning seed, run on the look's seed (the
    first reporting seed), and, with Seesaw far above +1.5 % against the baseline there, not on the later seed."""
    jsonl = tmp_path / 'study.jsonl'
    baseline = [{'arm': 'baseline@0.002', 'seed': s, 'adam_beta2': 0.95, 'eval_loss': 1e-3, 'optimizer_steps': 8,
                 'train_loss': 1.0, 'wall_s': 1.0} for s in (0, 1, 2)]  # far below any tiny run's loss
    jsonl.write_text(''.join(json.dumps(r) + '\n' for r in baseline), encoding='utf-8')
    env = {**os.environ, 'PYTHON': sys.executable, 'OUT': str(tmp_path / 'out'), 'MODEL': 'tiny', 'SAMPLES': '16',
           'EVAL_ROWS': '8', 'TUNE_SEEDS': '0', 'REPORT_SEEDS': '1 2', 'FUTILITY_AT': '1', 'C_LRS': '0.002',
           'EXTEND': '0', 'CORE': '', 'STAGE': 'c', 'BETA2': '0.95'}
    done = subprocess.run(['bash', STUDY, str(jsonl)], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(x) for x in jsonl.read_text(encoding='utf-8').splitlines()][len(baseline):]
    assert sorted((r['arm'], r['seed']) for r in rows) == [
        ('seesaw_c@0.002', 0), ('seesaw_c@0.002', 1), ('twin_c@0.002', 0), ('twin_c@0.002', 1)]
    assert 'futility look for arm C after seeds 1: stopped: seesaw_c and its twin' in done.stdout


def test_a_stop_file_ends_a_stream_before_its_next_run(tmp_path):
    """``touch $OUT/stop``: the stream exits cleanly before starting a run, so nothing is half-written."""
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'stop').touch()
    jsonl = tmp_path / 'study.jsonl'
    env = {**os.environ, 'PYTHON': sys.executable, 'OUT': str(out), 'MODEL': 'tiny', 'SAMPLES': '16',
           'EVAL_ROWS': '8', 'TUNE_SEEDS': '0', 'REPORT_SEEDS': '1', 'CORE': '', 'STAGE': 'beta2'}
    done = subprocess.run(['bash', STUDY, str(jsonl)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert 'exists: stopped before baseline at 0.002, seed 0' in done.stdout
    assert not jsonl.exists() or not jsonl.read_text(encoding='utf-8').strip()


def test_two_heavy_runs_never_run_at_once(bench, tmp_path):
    """A fixed_8 run holds the study's memory lock: another heavy run waits for it, a lighter arm does not."""
    import fcntl

    def held():
        with open(tmp_path / 'memory.lock', 'w', encoding='utf-8') as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    with bench.heavy_run(str(tmp_path), 'fixed_8'):
        assert held()
    assert not held()
    with bench.heavy_run(str(tmp_path), 'fixed_4'):
        assert not held()


def test_a_rung_run_on_some_tuning_seeds_is_completed_before_a_pick(bench, tmp_path, capsys):
    """The race this closes: one stream finished seed 0 of a new rung and has not claimed seed 1 yet; the other
    stream's ``best`` pick (complete rungs only) would miss the rung. ``--pick incomplete`` lists it (never waits)."""
    runs = [line('fixed_8@0.00283', 0, 0.903, steps=8), line('fixed_8@0.00283', 1, 0.904, steps=8),
            line('fixed_8@0.002', 0, 0.890, steps=8), line('fixed_4@0.00283', 0, 0.87, steps=16),
            line('fixed_4@0.00283', 1, 0.86, steps=16), line('fixed_8@0.002', 0, 0.8, 0.999, steps=8)]
    assert bench.incomplete_rungs(runs, [0, 1], 0.95) == ['fixed_8 0.002']
    assert bench.pick_lrs(runs, [0, 1], 0.95, 'best') == ['fixed_4 0.00283', 'fixed_8 0.00283']
    jsonl = tmp_path / 'g.jsonl'
    jsonl.write_text(''.join(json.dumps(r) + '\n' for r in runs), encoding='utf-8')
    claims = tmp_path / 'claims'
    claims.mkdir()
    (claims / 'fixed_8@0.002-b0.95-seed1').write_text(str(os.getpid()), encoding='utf-8')  # alive: no wait
    assert bench.main(['--from-jsonl', str(jsonl), '--tune-seeds', '0', '1', '--pick', 'incomplete', '--beta2',
                       '0.95', '--claims', str(claims)]) == 0
    assert capsys.readouterr().out.split('\n')[0] == 'fixed_8 0.002'

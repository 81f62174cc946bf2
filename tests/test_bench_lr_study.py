"""The LR schedule study's harness (benchmarks/lr_study.py): each arm's settings, the reuse of issue 39's lines and
its reproduction check, the picks on the tuning seeds, the arms it reports, and the run grid it shares with the
growth study (no training)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from benchmarks import growth_study, lr_study
from swift_dynamic_callbacks.config.pack import parse_section


def line(arm: str, lr: float, seed: int, loss: float, **extra) -> dict:
    return {'arm': growth_study.run_name(arm, lr), 'seed': seed, 'adam_beta2': 0.95, 'lr': lr, 'data': 'gsm8k',
            'eval_loss': loss, **extra}


def test_each_arm_is_a_schedule_the_pack_or_hf_runs():
    assert lr_study.arm_settings('baseline', 64) == ({}, {}, [])
    swift, pack, callbacks = lr_study.arm_settings('wsd', 64)
    assert swift['lr_scheduler_type'] == 'warmup_stable_decay' and callbacks == [] and pack == {}
    assert swift['lr_scheduler_kwargs'] == {'num_decay_steps': 13, 'decay_type': '1-sqrt'}  # the last 20 % of 64
    assert lr_study.arm_settings('wsd_linear', 64)[0]['lr_scheduler_kwargs']['decay_type'] == 'linear'
    for arm in ('whc', 'restarts', 'step_early', 'step_late'):
        swift, pack, callbacks = lr_study.arm_settings(arm, 64)
        assert swift == {} and callbacks == ['lr_schedule'] and set(pack) == {'lr_schedule'}
    assert lr_study.arm_settings('restarts', 64)[1]['lr_schedule'].get('max_restarts', 1) > 0
    with pytest.raises(ValueError, match='--arms: one of'):
        lr_study.arm_settings('cosine', 64)


def test_issue_39s_lines_are_reused_renamed_and_the_own_run_wins(tmp_path):
    mine, reused = tmp_path / 'lr.jsonl', tmp_path / 'growth.jsonl'
    mine.write_text(json.dumps(line('baseline', 0.00141, 2, 0.8375)) + '\n', encoding='utf-8')
    reused.write_text('\n'.join(json.dumps(r) for r in [
        {**line('baseline', 0.00141, 2, 0.8374), 'data': None},
        {**line('twin_c', 0.002, 2, 0.8301)},
        {**line('seesaw_c', 0.002, 2, 0.9)}]) + '\n', encoding='utf-8')
    results = lr_study.read([str(mine)], [str(reused)], 'gsm8k')
    assert sorted(r['arm'] for r in results) == ['baseline@0.00141', 'baseline@0.00141', 'step_early@0.002']
    assert lr_study.reproduction(results) == (0.8375, 0.8374)
    kept = lr_study.dedupe(results)
    assert [r['eval_loss'] for r in kept if r['arm'] == 'baseline@0.00141'] == [0.8375]  # this study's own
    assert lr_study.read([str(mine)], [str(reused)], 'alpaca') == []  # issue 39's lines are GSM8K's only


def test_the_picks_and_the_reported_arms_come_from_the_tuning_seeds_only():
    results = []
    for seed, shift in ((0, 0.0), (1, 0.002)):
        results += [line('baseline', 0.00141, seed, 0.836 + shift), line('whc', 0.00141, seed, 0.833 + shift),
                    line('whc', 0.002, seed, 0.839 + shift), line('step_early', 0.002, seed, 0.830 + shift),
                    line('step_late', 0.00141, seed, 0.826 + shift), line('wsd', 0.001, seed, 0.834 + shift),
                    line('wsd_linear', 0.001, seed, 0.831 + shift)]
    results.append(line('step_early', 0.002, 2, 0.5))  # a reporting seed: never part of a pick
    assert lr_study.best_lrs(results, [0, 1], 0.95)['whc'] == '0.00141'
    assert lr_study.winners(results, [0, 1], 0.95) == {'step': 'step_late', 'wsd': 'wsd_linear'}
    assert lr_study.report_arms(results, [0, 1], 0.95) == ['whc 0.00141', 'step_late 0.00141',
                                                           'wsd_linear 0.001', 'restarts 0.00141']


def test_the_run_grid_skips_done_and_claimed_runs_and_gives_a_failed_claim_back(tmp_path, capsys):
    claims = tmp_path / 'claims'
    claims.mkdir()
    args = argparse.Namespace(seeds=[0, 1], lrs=[0.002], arms=['whc'], beta2=0.95, claims=str(claims),
                              jsonl=str(tmp_path / 'out.jsonl'))
    assert growth_study.claim(str(claims), growth_study.run_key(growth_study.run_name('whc', 0.002), 1, 0.95))
    ran = []

    def run(arm, lr, seed):
        ran.append((arm, lr, seed))
        return line(arm, lr, seed, 0.8)

    growth_study.run_grid(args, {('whc@0.002', 0, 0.95)}, run)  # seed 0 done, seed 1 claimed by another stream
    assert ran == [] and 'claimed by another stream' in capsys.readouterr().out
    args.seeds = [2]

    def fails(arm, lr, seed):
        raise RuntimeError('out of disk')

    with pytest.raises(RuntimeError):
        growth_study.run_grid(args, set(), fails)
    assert growth_study.claim(str(claims), growth_study.run_key('whc@0.002', 2, 0.95)), 'the claim was given back'
    args.claims = None
    growth_study.run_grid(args, set(), run)
    assert ran == [('whc', 0.002, 2)]
    assert [json.loads(x)['seed'] for x in open(args.jsonl, encoding='utf-8')] == [2]


def test_two_streams_pick_only_when_the_other_streams_runs_cannot_change_the_pick(tmp_path, monkeypatch, capsys):
    """A pick or the look waits for another stream's live runs on the seeds it reads; the tables wait for all."""
    args = argparse.Namespace(pick='report', tune_seeds=[0, 1], report_seeds=[2, 3, 4, 5, 6], look_at=4)
    on = [growth_study.run_key('step_late@0.001', s, 0.95) for s in (1, 3, 6)]
    assert not lr_study.pick_unchanged(on[:1], args), 'a tuning seed changes the LR picks'
    assert lr_study.pick_unchanged(on[1:], args)
    args.pick = 'look'
    assert not lr_study.pick_unchanged(on[1:2], args), 'a look seed changes the look'
    assert lr_study.pick_unchanged(on[2:], args)
    args.pick = None
    assert not lr_study.pick_unchanged(on[2:], args), 'the tables wait for every run'
    args.pick = 'look'
    assert not lr_study.pick_unchanged(['not a run'], args), 'a claim that names no seed'

    jsonl, claims = tmp_path / 'lines.jsonl', tmp_path / 'claims'
    jsonl.write_text(''.join(json.dumps(line(arm, 0.001, s, 0.8 + s / 100)) + '\n'
                             for arm in ('baseline', 'step_late') for s in (0, 1, 2, 3)))
    claims.mkdir()
    (claims / growth_study.run_key('step_late@0.001', 4, 0.95)).write_text(str(os.getpid()))  # live: this process
    waited = []

    def sleep(seconds):
        waited.append(seconds)
        raise TimeoutError

    monkeypatch.setattr(growth_study.time, 'sleep', sleep)
    common = ['--from-jsonl', str(jsonl), '--claims', str(claims), '--tune-seeds', '0', '1', '--report-seeds', '2',
              '3', '4', '5', '--look-at', '2']
    assert lr_study.main([*common, '--pick', 'look']) == 0 and waited == [], 'seed 4 is not a look seed'
    with pytest.raises(TimeoutError):
        lr_study.main(common)
    assert waited and 'waiting for the runs of another stream' in capsys.readouterr().err


def test_one_seed_shows_nothing_against_the_cosine():
    """A single paired seed has no interval: it must not read as "below the cosine" (the table said so for the
    restarts arm after its first reporting seed)."""
    assert lr_study.against_cosine([-0.009]) == 'one seed: no interval yet'
    assert lr_study.against_cosine([-0.009, -0.011, -0.010]) == 'below the cosine'
    assert lr_study.against_cosine([0.009, 0.011, 0.010]) == 'above the cosine'
    assert lr_study.against_cosine([-0.05, 0.04]) == 'not shown either way'


def test_a_second_data_set_reports_every_arm_tuned_there_at_its_own_best_lr():
    """Alpaca (stage 4): no GSM8K picks or ``whc``-borrowed LR; each arm at the LR it won there, the baseline apart."""
    results = []
    for seed in (0, 1):
        results += [{**line('baseline', 0.001, seed, 1.60), 'data': 'alpaca'},
                    {**line('baseline', 0.002, seed, 1.58), 'data': 'alpaca'},
                    {**line('step_late', 0.001, seed, 1.57), 'data': 'alpaca'},
                    {**line('step_late', 0.002, seed, 1.59), 'data': 'alpaca'},
                    {**line('restarts', 0.002, seed, 1.56), 'data': 'alpaca'}]
    assert lr_study.report_arms(results, [0, 1], 0.95, 'alpaca') == ['restarts 0.002', 'step_late 0.001']
    assert lr_study.best_lrs(results, [0, 1], 0.95)['baseline'] == '0.002'
    results += [{**line('baseline', 0.002, s, 1.60), 'data': 'alpaca'} for s in (2, 3)]
    results += [{**line('step_late', 0.001, s, 1.62), 'data': 'alpaca'} for s in (2, 3)]  # +1.25 %: above +0.5 %
    results += [{**line('restarts', 0.002, s, 1.59), 'data': 'alpaca'} for s in (2, 3)]
    chosen = {'baseline': '0.002', **dict(x.split() for x in lr_study.report_arms(results, [0, 1], 0.95, 'alpaca'))}
    assert lr_study.look(results, [2, 3], 0.95, chosen) == ['step_late']


@pytest.mark.parametrize('arm', ['whc', 'restarts', 'step_late', 'wsd'])
def test_each_arms_yaml_is_the_arm_the_study_runs_at_the_lr_it_chose(arm):
    """``configs/lr_49/<arm>.yaml``, the file a user copies: issue 39's baseline with this arm's LR shape
    (``arm_settings``: the pack's ``lr_schedule`` section or HF's scheduler) at the LR the committed raw lines pick
    on the tuning seeds (``restarts`` at ``whc``'s), and it validates."""
    import yaml
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, 'configs', 'lr_49', f'{arm}.yaml'), encoding='utf-8') as f:
        config = yaml.safe_load(f)
    with open(os.path.join(root, 'configs', 'growth_39', 'baseline.yaml'), encoding='utf-8') as f:
        baseline = yaml.safe_load(f)
    swift, pack, callbacks = lr_study.arm_settings(arm, 64)
    own = ('learning_rate', 'output_dir', 'callbacks', 'dynamic_callbacks', *swift)
    shared = {k: v for k, v in baseline.items() if k not in own}
    assert set(config) == set(shared) | set(own)
    assert {k: config[k] for k in shared} == shared  # the baseline's model, rows, batch, steps, beta2, warmup
    assert {k: config[k] for k in swift} == swift
    assert config['callbacks'] == [*callbacks, 'training_log']
    section = dict(config['dynamic_callbacks'])
    assert section.pop('training_log') == {'memory': False} and section == pack
    parse_section(section, callbacks)  # ConfigError on a bad setting
    results = lr_study.read([os.path.join(root, 'docs', 'figures', 'lr_49.jsonl')], [], 'gsm8k')
    best = lr_study.best_lrs(results, [0, 1], 0.95)
    assert float(config['learning_rate']) == pytest.approx(float(best['whc' if arm == 'restarts' else arm]))


def test_restarts_are_compared_with_the_schedule_they_restart_split_by_whether_one_fired():
    lines = []
    for seed, (whc, restarted, fired) in {2: (0.84, 0.83, 1), 3: (0.85, 0.845, 2), 4: (0.83, 0.83, 0)}.items():
        lines += [line('whc', 0.00141, seed, whc), line('restarts', 0.00141, seed, restarted, lr_restarts=fired)]
    rows = {r['runs']: r for r in lr_study.restart_effect(lines, [2, 3, 4, 5], 0.95, {'restarts': '0.00141'})}
    assert set(rows) == {'all', 'a restart fired', 'none fired'}
    assert rows['all']['seeds'] == 3 and rows['all']['restarts'] == 1.0
    assert rows['a restart fired']['mean'] == pytest.approx((0.83 / 0.84 + 0.845 / 0.85) / 2 - 1)
    assert rows['none fired']['mean'] == 0 and rows['none fired']['seeds'] == 1
    assert rows['all']['arm'] == 'restarts@0.00141' and rows['all']['ref'] == 'whc@0.00141'
    assert lr_study.restart_effect(lines, [2, 3, 4], 0.95, {'step_late': '0.00141'}) == []  # no restarts arm
    assert lr_study.restart_effect(lines[1::2], [2, 3, 4], 0.95, {'restarts': '0.00141'}) == []  # no whc runs

"""The quality study's script (``scripts/bench_quality.py``): every arm's settings are valid pack settings, the paired
interval and the verdict it supports, the reporting seeds kept apart from the tuning seeds, and a smoke run on the tiny
model with the held-out answers scored."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from swift_dynamic_callbacks.config.pack import parse_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def bench():
    spec = importlib.util.spec_from_file_location('bench_quality', os.path.join(ROOT, 'scripts', 'bench_quality.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_arm_is_a_valid_pack_section(bench):
    for arm in bench.ARMS:
        overrides, pack, callbacks = bench.arm_settings(arm, steps_small=64, max_length=512)
        assert set(callbacks) == set(pack), arm
        if pack:
            parse_section(pack, callbacks)  # raises ConfigError on a bad setting
    _, gentle, _ = bench.arm_settings('growth_gentle', 64, 512)
    _, half, _ = bench.arm_settings('late_switch_half_budget', 64, 512)
    _, rewarm, _ = bench.arm_settings('growth_rewarm', 64, 512)
    assert gentle['batch_growth']['factor'] == 1.5 and half['batch_growth']['switch_at'] == 0.5
    assert rewarm['batch_growth']['rewarm'] == 3  # a third of the interval (64 // 6 = 10 steps)
    assert 'length_batching' in half


def test_the_paired_interval_and_what_it_supports(bench):
    mean, low, high = bench.paired_interval([0.01, 0.03])
    # mean 2 %, sd 1.414 %, t(1) = 12.706: half-width 12.706 x 0.01414 / sqrt(2) = 12.7 %
    assert mean == pytest.approx(0.02) and high - mean == pytest.approx(0.12706, rel=1e-3)
    assert bench.paired_interval([0.004]) == (0.004, 0.004, 0.004)
    assert bench.verdict(0.5, [-0.01, -0.008, -0.012, -0.009, -0.011]).startswith('met')
    assert bench.verdict(0.5, [0.02, 0.03, 0.025, 0.028, 0.022]).startswith('not met (the whole interval')
    assert bench.verdict(0.5, [-0.02, 0.03, 0.0]).startswith('not shown')
    assert bench.verdict(0.3, [-0.01, -0.01]).startswith('not met (fewer than 40 %')
    assert bench.verdict(0.5, [-0.01]).startswith('undecided')


def test_reporting_seeds_must_not_be_tuning_seeds(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(['--from-jsonl', str(tmp_path / 'none.jsonl'), '--report-seeds', '1', '2', '--tune-seeds', '0',
                    '2'])
    assert 'must not share a seed' in capsys.readouterr().err


def test_the_tables_keep_only_the_reporting_seeds(bench, tmp_path, capsys):
    lines = tmp_path / 'study.jsonl'
    rows = []
    for seed, small, grown in [(0, 0.80, 0.70), (1, 0.82, 0.83), (2, 0.81, 0.815)]:
        for arm, loss, steps in [('fixed_small@0.002', small, 64), ('growth@0.002', grown, 30)]:
            rows.append({'arm': arm, 'seed': seed, 'optimizer_steps': steps, 'train_loss': 1.0, 'eval_loss': loss,
                         'wall_s': 1.0, 'padding': 0.1, 'padded_tokens': 10})
    lines.write_text(''.join(json.dumps(r) + '\n' for r in rows), encoding='utf-8')
    assert bench.main(['--from-jsonl', str(lines), '--report-seeds', '1', '2', '--tune-seeds', '0']) == 0
    out = capsys.readouterr().out
    assert 'LRs chosen on seeds [0]; reported on seeds [1, 2] only' in out
    # seed 0's -12.5 % is left out: +1.2 % and +0.6 % on the reporting seeds
    assert '| growth@0.002 | 2 | 53% | +0.9% |' in out


@pytest.mark.e2e
def test_a_smoke_run_on_the_tiny_model_scores_the_held_out_answers(bench, tmp_path, capsys):
    lines = tmp_path / 'smoke.jsonl'
    code = bench.main(['--model', 'tiny', '--samples', '8', '--eval-rows', '4', '--answers', '2', '--max-length',
                       '256', '--arms', 'fixed_small', 'growth', '--seeds', '3', '--out', str(tmp_path / 'out'),
                       '--jsonl', str(lines)])
    assert code == 0
    rows = [json.loads(line) for line in lines.read_text(encoding='utf-8').splitlines()]
    assert [r['arm'] for r in rows] == ['fixed_small', 'growth'] and {r['seed'] for r in rows} == {3}
    for row in rows:
        assert row['answer_rows'] == 2 and 0 <= row['correct'] <= row['formed'] <= 2, row
        assert row['eval_rows'] == 4 and row['eval_loss'] > 0 and row['optimizer_steps'] > 0
    assert rows[1]['optimizer_steps'] < rows[0]['optimizer_steps']  # growth: fewer steps for the same 8 samples
    assert 'paired-t' in capsys.readouterr().out

"""``scripts/growth_clock.py`` (issue 39): the growth study's arms timed under ms-swift, and the cost of one pass by
rows x padded length, here on a CPU with the tiny model (the GPU run is ``scripts/gpu_throughput.sh`` phase
``growth``)."""

from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def clock():
    from benchmarks import growth_clock
    return growth_clock


@pytest.mark.e2e
def test_each_arm_is_timed_with_its_pass_layout_and_the_pass_grid(clock, tmp_path, capsys):
    jsonl = tmp_path / 'clock.jsonl'
    assert clock.main(['--device', 'cpu', '--shape', 'tiny', '--samples', '8', '--arms', 'baseline', 'control_a',
                       '--seeds', '2', '--grid-rows', '1', '2', '--grid-lengths', '16', '--repeats', '1',
                       '--warmup-arms', 'baseline',
                       '--work', str(tmp_path / 'work'), '--jsonl', str(jsonl)]) == 0
    lines = [json.loads(x) for x in jsonl.read_text(encoding='utf-8').splitlines()]
    grid = [x for x in lines if x['kind'] == 'pass']
    assert sorted((x['rows'], x['length']) for x in grid) == [(1, 16), (2, 16)]
    assert all(x['seconds'] > 0 for x in grid)
    assert [x['kind'] for x in lines].count('optimizer_step') == 1
    arms = [x for x in lines if x['kind'] == 'arm']
    # one unmeasured warm-up run (--warmup-arms), then each arm: 8 rows at GA 2, micro 1 (4 steps) and 2 (2 steps)
    assert [(x['arm'], bool(x.get('warmup'))) for x in arms] == [
        ('baseline', True), ('baseline', False), ('control_a', False)]
    base, a = arms[1], arms[2]
    assert base['optimizer_steps'] == 4 and len(base['step_s']) == 4 and base['passes'] == [2, 2, 2, 2]
    assert a['optimizer_steps'] == 2 and a['passes'] == [2, 2] and a['batch'] == [4, 4]
    assert base['train_s'] >= sum(base['step_s']) > 0
    # micro-batch 1 pads nothing; the same rows in pairs pad at least as many tokens
    assert 0 < sum(base['padded']) <= sum(a['padded'])
    out = capsys.readouterr().out
    assert '| baseline | 2 | 4 | 8 |' in out and '| control_a | 2 | 2 | 4 |' in out and '| 2 | ' in out

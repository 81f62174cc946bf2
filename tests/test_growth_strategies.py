"""The growth policies of ``batch_growth`` as strategies (``callbacks/growth/``): one per policy, each with its own
typed state; the contract every one meets (sizes within the bounds, state round trip, the keys older checkpoints
used), and the callback that holds one."""

from __future__ import annotations

import json
import math

import pytest

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
from swift_dynamic_callbacks.callbacks.growth import STRATEGIES, StepView, strategy_for
from swift_dynamic_callbacks.config.batch_growth import POLICIES, BatchGrowthConfig

SETTINGS = {
    'interval': {'interval': 2},
    'table': {'table': {0: 1, 3: 2, 6: 4}},
    'callable': {'function': 'tests_growth_fn:double_every_three'},
    'loss_variability': {'interval': 2, 'window': 2, 'threshold': 0.01},
    'noise_scale': {'interval': 2, 'window': 2},
    'seesaw': {},
    'late_switch': {'switch_at': 0.5, 'switch_patience': 1, 'switch_smooth': 1},
}


@pytest.fixture(autouse=True)
def growth_fn(tmp_path, monkeypatch):
    (tmp_path / 'tests_growth_fn.py').write_text(
        'def double_every_three(step, batch_size):\n    return min(8, 2 ** (step // 3))\n')
    monkeypatch.syspath_prepend(str(tmp_path))


def config_for(policy):
    return BatchGrowthConfig(policy=policy, initial=1, factor=2, maximum=8, **SETTINGS[policy])


def feed(strategy, steps=12):
    """Drive a strategy through a run: decaying losses, a cosine LR, noise samples; returns its sizes by step."""
    sizes, current = [], 1
    for step in range(1, steps + 1):
        strategy.observe_log(2.0 / step + (0.3 if step % 2 else 0.0))
        sample = protocol.GradNoiseSample(1.0 + 60 / 10, 10, 1.0 + 60 / 20, 20, 2)
        lr = 1e-3 * 0.5 * (1 + math.cos(math.pi * step / steps))
        strategy.observe_step(StepView(step=step, max_steps=steps, lr=lr * math.sqrt(current), base_lr=1e-3,
                                       noise=sample, passes_per_step=2))
        size = min(strategy.target(step, current), strategy.config.maximum)
        if size != current:
            strategy.resized(current, size, math.sqrt(size))
            current = size
        sizes.append(size)
    return sizes


def test_every_policy_has_one_strategy_and_every_strategy_a_policy():
    assert sorted(STRATEGIES) == sorted(POLICIES)
    for policy in POLICIES:
        assert type(strategy_for(config_for(policy))).name == policy


@pytest.mark.parametrize('policy', POLICIES)
def test_a_strategy_grows_within_its_bounds_and_resumes_where_it_was(policy):
    strategy = strategy_for(config_for(policy))
    sizes = feed(strategy)
    assert all(1 <= s <= 8 for s in sizes) and sizes == sorted(sizes) and sizes[-1] > 1, sizes
    state = json.loads(json.dumps(strategy.state_dict()))  # what a checkpoint holds
    restored = strategy_for(config_for(policy))
    restored.load_state_dict(state)
    assert restored.state_dict() == strategy.state_dict()
    assert restored.target(13, sizes[-1]) == strategy.target(13, sizes[-1])


def test_a_checkpoint_of_the_single_class_callback_loads_into_each_strategy():
    """Before the strategies, the callback saved every policy's state under its own keys, whatever ran."""
    old = {'batch_size': 4, 'pending': None, 'losses': [1.0, 1.5],
           'noise': {'g2': 1.0, 'trace': 60.0, 'tokens_per_sample': 10.0, 'count': 3}, 'critical_per_device': 3.0,
           'seesaw': {'peak': 1.0, 'cuts': 2, 'scale': 2.0, 'factor': 0.2},
           'switch': {'losses': [1.0], 'plateau': {'best': 1.0, 'wait': 1, 'cooldown': 0},
                      'plateaued': True}}
    for policy in POLICIES:
        cb = BatchGrowthCallback(config_for(policy))
        cb.load_state_dict(old)
        assert cb.batch_size == 4
    assert BatchGrowthCallback(config_for('seesaw')).strategy.target(0, 1) == 1
    seesaw = BatchGrowthCallback(config_for('seesaw'))
    seesaw.load_state_dict(old)
    assert seesaw.strategy.state.cuts == 2 and seesaw.strategy.state.scale == 2.0 and seesaw.target(0, 1) == 4
    noise = BatchGrowthCallback(config_for('noise_scale'))
    noise.load_state_dict(old)
    assert noise.strategy.noise.count == 3 and noise.strategy.critical_per_device == 3.0
    switch = BatchGrowthCallback(config_for('late_switch'))
    switch.load_state_dict(old)
    assert switch.strategy.switch.plateaued and switch.target(0, 1) == 8
    assert BatchGrowthCallback(config_for('loss_variability')).state_dict().keys() == {
        'batch_size', 'pending', 'rewarm', 'lr_scale', 'samples', 'losses'}


def test_rank_local_strategies_are_the_ones_that_read_local_values():
    local = {p for p in POLICIES if strategy_for(config_for(p)).rank_local}
    assert local == {'callable', 'loss_variability', 'noise_scale', 'late_switch'}  # late_switch: with patience
    assert not strategy_for(BatchGrowthConfig(policy='late_switch', initial=1, maximum=8)).rank_local

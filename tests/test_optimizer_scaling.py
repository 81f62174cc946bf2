"""Batch-aware optimizer settings (weight decay by the Power Lines rule, Adam beta2 by a half-life in samples) and the
late-switch growth policy: the pure rules, their settings, the integration part that scales the live optimizer, and
one real ``swift sft`` run with a resume."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.config.batch_growth import BatchGrowthConfig
from swift_dynamic_callbacks.config.launch import check_run
from swift_dynamic_callbacks.config.pack import parse_section
from swift_dynamic_callbacks.integrations.optimizer import OptimizerScale
from swift_dynamic_callbacks.policies.growth import late_switch_size, lr_scale, optimizer_scale


# ---- the rules ----------------------------------------------------------------------------------------------------

def test_late_switch_is_the_small_batch_until_the_switch_then_the_large_one():
    sizes = [late_switch_size(step / 10, initial=2, maximum=16, switch_at=0.75) for step in range(11)]
    assert sizes == [2] * 8 + [16] * 3
    with pytest.raises(ValueError, match='switch_at must be in'):
        late_switch_size(0.5, initial=1, maximum=2, switch_at=1.0)


@given(st.floats(0, 1), st.floats(0, 1), st.floats(0.01, 0.99), st.integers(1, 8), st.integers(0, 8))
def test_late_switch_is_monotone_and_one_of_the_two_sizes(a, b, switch_at, initial, extra):
    maximum = initial + extra
    low, high = sorted((a, b))
    sizes = [late_switch_size(d, initial=initial, maximum=maximum, switch_at=switch_at) for d in (low, high)]
    assert sizes[0] <= sizes[1] and set(sizes) <= {initial, maximum}


@given(st.floats(0.05, 64), st.sampled_from(['sqrt', 'linear', 'none']))
def test_power_lines_keeps_the_weight_decay_timescale_and_half_life_keeps_beta2_in_samples(ratio, rule):
    lr_factor = lr_scale(ratio, 1, rule)
    scale = optimizer_scale(ratio, lr_factor, weight_decay='power_lines', beta2='half_life')
    # tau = B / (lr * weight_decay * D): the same at ratio x the batch
    assert ratio / (lr_factor * scale['weight_decay']) == pytest.approx(1.0)
    beta2 = 0.95
    # half-life in samples: steps to halve x samples a step is the same
    half_life = math.log(0.5) / math.log(beta2)
    assert math.log(0.5) / math.log(beta2 ** scale['beta2_power']) * ratio == pytest.approx(half_life)
    assert optimizer_scale(ratio, lr_factor, weight_decay='none', beta2='none') == {}


def test_the_rules_refuse_unknown_names_and_bad_ratios():
    with pytest.raises(ValueError, match='weight_decay must be power_lines or none'):
        optimizer_scale(2, 1, weight_decay='linear', beta2='none')
    with pytest.raises(ValueError, match='ratio and lr_factor must be > 0'):
        optimizer_scale(0, 1, weight_decay='power_lines', beta2='none')


# ---- settings -----------------------------------------------------------------------------------------------------

def test_settings_are_validated_and_read_only_where_they_apply():
    config = BatchGrowthConfig(policy='late_switch', initial=1, maximum=8, switch_at=0.6,
                               weight_decay_scaling='power_lines', beta2_scaling='half_life')
    assert config.switch_at == 0.6 and 'optimizer_scale' in config.controls
    with pytest.raises(ConfigError, match='switch_at'):
        BatchGrowthConfig(policy='interval', switch_at=0.5)  # not read by interval
    with pytest.raises(ConfigError, match='switch_at'):
        BatchGrowthConfig(policy='late_switch', switch_at=1.0)
    with pytest.raises(ConfigError, match='weight_decay_scaling'):
        BatchGrowthConfig(weight_decay_scaling='linear')


def _launch(growth: dict, **settings):
    pack = parse_section({'batch_growth': growth}, ['batch_growth'])
    return check_run(pack, {'model': 'm', 'callbacks': ['batch_growth'], **settings})


def test_launch_refuses_a_scaling_with_nothing_to_scale():
    _launch({'weight_decay_scaling': 'power_lines', 'beta2_scaling': 'half_life'})  # ms-swift: weight_decay 0.1
    with pytest.raises(ConfigError, match=r'weight_decay_scaling: power_lines .* weight_decay is 0'):
        _launch({'weight_decay_scaling': 'power_lines'}, weight_decay=0)
    with pytest.raises(ConfigError, match='beta2_scaling: half_life .* optim sgd has no betas'):
        _launch({'beta2_scaling': 'half_life'}, optim='sgd')


def test_the_flag_is_checked():
    assert protocol.check_optimizer_scale({'weight_decay': 2, 'beta2_power': 4}) == {'weight_decay': 2.0,
                                                                                     'beta2_power': 4.0}
    for bad in ({}, {'momentum': 2}, {'weight_decay': 0}, {'beta2_power': float('nan')}, [2]):
        with pytest.raises(ValueError, match='new_optimizer_scale'):
            protocol.check_optimizer_scale(bad)


# ---- the integration's part ---------------------------------------------------------------------------------------

class _Trainer:
    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_the_live_optimizer_is_scaled_from_its_configured_values_and_restored():
    weights = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW([{'params': [weights[0]], 'weight_decay': 0.1},
                                   {'params': [weights[1]], 'weight_decay': 0.0}], betas=(0.9, 0.95))
    part = OptimizerScale(_Trainer(optimizer))
    part.set_scale({'weight_decay': 2.0, 'beta2_power': 4.0})
    part.set_scale({'weight_decay': 3.0, 'beta2_power': 2.0})  # absolute, not cumulative
    assert [g['weight_decay'] for g in optimizer.param_groups] == [pytest.approx(0.3), 0.0]
    assert [g['betas'] for g in optimizer.param_groups] == [(0.9, pytest.approx(0.95 ** 2))] * 2
    restored = OptimizerScale(_Trainer(optimizer))
    restored.load_state_dict(part.state_dict())
    restored.set_scale({'weight_decay': 1.0, 'beta2_power': 1.0})  # back to the configured values
    assert optimizer.param_groups[0]['weight_decay'] == pytest.approx(0.1)
    assert optimizer.param_groups[0]['betas'][1] == pytest.approx(0.95)


def test_an_optimizer_without_betas_is_refused_naming_the_setting():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, weight_decay=0.1)
    part = OptimizerScale(_Trainer(optimizer))
    part.set_scale({'weight_decay': 2.0})
    assert optimizer.param_groups[0]['weight_decay'] == pytest.approx(0.2)
    with pytest.raises(ConfigError, match='batch_growth.beta2_scaling: the optimizer SGD has no \'betas\''):
        part.set_scale({'beta2_power': 2.0})


# ---- end to end ---------------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_swift_sft_late_switch_rescales_the_optimizer_and_resumes_with_it(tmp_path, tiny_llama, gsm8k_16):
    """16 samples at batch 1, late switch at half the run to batch 4 with sqrt LR scaling, Power Lines weight decay
    and the beta2 half-life: the switch comes at step 8, its record gives the old and new weight decay and beta2,
    the checkpoint's optimizer holds them (0.1 -> 0.2, 0.95 -> 0.95^4), and a resume from after the switch keeps
    them without a new request."""
    import json

    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_runs import decisions, run_sft
    growth = {'policy': 'late_switch', 'initial': 1, 'maximum': 4, 'switch_at': 0.5,
              'weight_decay_scaling': 'power_lines', 'beta2_scaling': 'half_life'}
    run = dict(per_device_train_batch_size=1, gradient_accumulation_steps=1, num_train_epochs=1, max_steps=-1,
               save_steps=9, weight_decay=0.1, adam_beta2=0.95)
    try:
        sdc.register(batch_growth=growth)
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'run'), callbacks=['batch_growth'], **run)
    finally:
        plugin._configured = None
    (switch, ) = [d for d in decisions(out) if d['kind'] == 'batch_size' and d['reason'] == 'late_switch']
    assert (switch['step'], switch['values']['old'], switch['values']['new']) == (8, 1, 4)
    values = switch['values']
    assert values['optimizer_scale'] == {'weight_decay': pytest.approx(2.0), 'beta2_power': 4.0}
    assert (values['old_weight_decay'], values['new_weight_decay']) == (pytest.approx(0.1), pytest.approx(0.2))
    assert (values['old_beta2'], values['new_beta2']) == (pytest.approx(0.95), pytest.approx(0.95 ** 4))

    def groups(checkpoint):
        saved = torch.load(os.path.join(checkpoint, 'optimizer.pt'), weights_only=False)['param_groups']
        return [(g['weight_decay'], g['betas'][1]) for g in saved if g['weight_decay']]

    assert groups(os.path.join(out, 'checkpoint-9')) == [(pytest.approx(0.2), pytest.approx(0.95 ** 4))]
    target = str(tmp_path / 'resumed')
    shutil.copytree(out, target)
    try:
        sdc.register(batch_growth=growth)
        run_sft(tiny_llama, 'llama', gsm8k_16, target, callbacks=['batch_growth'], fresh=False,
                resume_from_checkpoint=os.path.join(target, 'checkpoint-9'), **run)
    finally:
        plugin._configured = None
    last = sorted(int(n.split('-')[1]) for n in os.listdir(target) if n.startswith('checkpoint-'))[-1]
    assert last == 10 and groups(os.path.join(target, f'checkpoint-{last}')) == [
        (pytest.approx(0.2), pytest.approx(0.95 ** 4))]
    state = json.load(open(os.path.join(target, f'checkpoint-{last}', 'dynamic_callbacks_state.json')))
    assert state['components']['integration']['optimizer']['configured'][0]['beta2'] == pytest.approx(0.95)

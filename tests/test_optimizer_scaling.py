"""Batch-aware optimizer settings (weight decay by the Power Lines rule, Adam beta2 by a half-life in samples) and the
late-switch growth policy: the pure rules, their settings, the integration part that scales the live optimizer, and
one real ``swift sft`` run with a resume."""

from __future__ import annotations

import json
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


@given(st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=2, max_size=20), st.floats(0.01, 0.99),
       st.integers(1, 8), st.integers(0, 8))
def test_a_loss_plateau_only_brings_the_switch_forward(points, switch_at, initial, extra):
    """With the plateau trigger the size is maximum from the plateau on (sticky) or from switch_at on, whichever is
    first; without a plateau it is exactly the fraction rule."""
    maximum = initial + extra
    points = sorted(points)
    fired = [any(p for _, p in points[:i + 1]) for i in range(len(points))]  # sticky: once plateaued, it stays
    sizes = [late_switch_size(d, initial=initial, maximum=maximum, switch_at=switch_at, plateaued=f)
             for (d, _), f in zip(points, fired)]
    assert sizes == sorted(sizes)
    for (done, _), plateaued, size in zip(points, fired, sizes):
        assert size == (maximum if plateaued or done >= switch_at else initial)
        assert size >= late_switch_size(done, initial=initial, maximum=maximum, switch_at=switch_at)


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


def test_the_plateau_trigger_settings_are_validated():
    config = BatchGrowthConfig(policy='late_switch', switch_patience=3, switch_smooth=3, switch_min_delta=0.01)
    assert (config.switch_patience, config.switch_smooth, config.switch_min_delta) == (3, 3, 0.01)
    with pytest.raises(ConfigError, match='switch_patience'):
        BatchGrowthConfig(policy='interval', switch_patience=3)  # not read by interval
    with pytest.raises(ConfigError, match='switch_patience'):
        BatchGrowthConfig(policy='late_switch', switch_patience=0)
    with pytest.raises(ConfigError, match='switch_min_delta'):
        BatchGrowthConfig(policy='late_switch', switch_patience=2, switch_min_delta=-0.1)
    # read only with the plateau trigger
    for name, value in (('switch_smooth', 3), ('switch_min_delta', 0.01)):
        with pytest.raises(ConfigError, match=f'{name}: only read by switch_patience: >= 1'):
            BatchGrowthConfig(policy='late_switch', **{name: value})
    with pytest.raises(ConfigError, match='window: only read by policy: loss_variability'):
        BatchGrowthConfig(policy='late_switch', switch_patience=2, window=5)


def _late_switch_steps(cb, losses, *, max_steps=20):
    """Log ``losses[k]`` and end optimizer step ``k + 1`` (HF order: on_step_end, then on_log); returns the control
    of each step."""
    from transformers import TrainerControl, TrainerState, TrainingArguments
    args = TrainingArguments(output_dir='unused', gradient_accumulation_steps=1, report_to=[])
    controls = []
    for step, loss in enumerate(losses, start=1):
        control = TrainerControl()
        state = TrainerState(global_step=step, max_steps=max_steps)
        cb.on_step_end(args, state, control)
        cb.on_log(args, state, control, logs={'loss': loss})
        controls.append(control)
    return controls


def test_a_flat_loss_switches_before_switch_at_and_a_falling_one_does_not():
    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
    config = BatchGrowthConfig(policy='late_switch', initial=1, maximum=4, switch_at=0.75, switch_patience=2,
                               switch_smooth=3, switch_min_delta=0.01)
    flat = BatchGrowthCallback(config)
    flat.batch_size = 1
    controls = _late_switch_steps(flat, [2.0, 1.8, 1.6, 1.6, 1.6, 1.6, 1.6, 1.6])
    # medians from the 3rd loss: 1.8, 1.6 (best), 1.6, 1.6 -> 2 values without a 0.01 drop after step 4's: fires at
    # step 6's log; the request comes at step 7's end (the next policy check)
    asked = [getattr(c, protocol.NEW_BATCH_SIZE, None) for c in controls]
    assert asked == [None] * 6 + [4, None]
    (record, ) = protocol.drain_decisions(controls[6])
    assert record.values['trigger'] == 'loss_plateau' and record.values['smoothed_loss'] == pytest.approx(1.6)
    waits = [protocol.current_metrics(c)['dynamic/late_switch_wait'] for c in controls]
    assert waits == [0, 0, 0, 0, 0, 1, 0, 0] and flat.strategy.switch.plateaued  # published at a step's end: the wait
    # after the previous step's log
    restored = BatchGrowthCallback(config)  # the trigger's state survives a checkpoint
    restored.load_state_dict(json.loads(json.dumps(flat.state_dict())))
    assert restored.strategy.switch == flat.strategy.switch

    falling = BatchGrowthCallback(config)
    falling.batch_size = 1
    controls = _late_switch_steps(falling, [2.0 - 0.05 * k for k in range(20)])
    switched = [step for step, c in enumerate(controls, start=1) if getattr(c, protocol.NEW_BATCH_SIZE, None)]
    assert switched == [15]  # 15 / 20 = switch_at: the fraction rule, not the plateau
    (record, ) = protocol.drain_decisions(controls[14])
    assert record.values['trigger'] == 'switch_at' and not falling.strategy.switch.plateaued


def test_the_plateau_is_rank_0s(monkeypatch):
    """The losses are this rank's: the size is broadcast from rank 0 with the plateau trigger on."""
    from swift_dynamic_callbacks import distributed
    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
    sent = []

    def broadcast(value):  # rank 0 has not plateaued
        sent.append(value)
        return 1

    monkeypatch.setattr(distributed, 'broadcast_from_main', broadcast)
    cb = BatchGrowthCallback(BatchGrowthConfig(policy='late_switch', initial=1, maximum=4, switch_patience=1,
                                               switch_smooth=2))
    cb.batch_size = 1
    controls = _late_switch_steps(cb, [1.0, 1.0, 1.0, 1.0])
    assert cb.strategy.switch.plateaued and 4 in sent
    assert all(getattr(c, protocol.NEW_BATCH_SIZE, None) is None for c in controls)


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
        plugin.unregister()
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
        plugin.unregister()
    last = sorted(int(n.split('-')[1]) for n in os.listdir(target) if n.startswith('checkpoint-'))[-1]
    assert last == 10 and groups(os.path.join(target, f'checkpoint-{last}')) == [
        (pytest.approx(0.2), pytest.approx(0.95 ** 4))]
    state = json.load(open(os.path.join(target, f'checkpoint-{last}', 'dynamic_callbacks_state.json')))
    assert state['components']['integration']['optimizer']['configured'][0]['beta2'] == pytest.approx(0.95)


@pytest.mark.e2e
def test_swift_sft_late_switch_on_a_loss_plateau(tmp_path, tiny_llama, gsm8k_16):
    """The plateau trigger in a real run: with ``switch_min_delta`` larger than any loss, no logged loss is an
    improvement, so with ``switch_smooth: 2`` (first judged value at the 2nd log) and ``switch_patience: 2`` the plateau
    is declared at step 4's log and the switch to batch 4 comes at step 5's end, long before ``switch_at: 0.9``; every
    sample is used exactly once and the training log carries the wait."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_runs import decisions, run_sft, sample_trace, train_logs
    growth = {'policy': 'late_switch', 'initial': 1, 'maximum': 4, 'switch_at': 0.9, 'switch_patience': 2,
              'switch_smooth': 2, 'switch_min_delta': 100.0}
    try:
        sdc.register(batch_growth=growth, integration={'record_samples': True})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'run'), callbacks=['batch_growth'],
                      per_device_train_batch_size=1, gradient_accumulation_steps=1, num_train_epochs=1, max_steps=-1)
    finally:
        plugin.unregister()
    (switch, ) = [d for d in decisions(out) if d['kind'] == 'batch_size' and d['reason'] == 'late_switch']
    assert (switch['step'], switch['values']['old'], switch['values']['new']) == (5, 1, 4)
    assert switch['values']['trigger'] == 'loss_plateau' and switch['values']['done'] < 0.9
    used = [sum(len(b) for b in row['batches']) for row in sample_trace(out)]
    assert used == [1] * 5 + [4, 4, 3]
    assert sorted(i for row in sample_trace(out) for b in row['batches'] for i in b) == list(range(16))
    assert [row['dynamic/late_switch_wait'] for row in train_logs(out)][:5] == [0, 0, 0, 1, 0]

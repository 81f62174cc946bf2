"""Warmup-hold-cosine LR with plateau restarts: golden values, properties, the callback, real swift runs."""

from __future__ import annotations

import io
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.callbacks.lr_schedule import LRScheduleCallback, LRScheduleConfig
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.integrations.scheduler import ScaledLambda
from swift_dynamic_callbacks.policies.lr import (GuardState, PlateauState, guard_step, plateau_step, schedule_factor,
                                                 smoothed, warmup_hold_cosine)
from swift_runs import decisions, run_sft, train_logs

SHAPE = dict(total=100, warmup=10, hold=5, min_ratio=0.01)


def test_golden_values_at_phase_boundaries():
    f = lambda s: warmup_hold_cosine(s, **SHAPE)  # noqa: E731
    assert f(0) == 0.0  # warmup starts at 0
    assert f(5) == pytest.approx(0.5)
    assert f(10) == 1.0  # end of warmup
    assert f(14) == 1.0 and f(15) == 1.0  # hold, end of hold
    assert f(57.5) == pytest.approx(0.01 + 0.99 * 0.5)  # half-way through the decay
    assert f(99) == pytest.approx(0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * 84 / 85)))  # last step's LR
    assert f(100) == pytest.approx(0.01)  # end of training
    assert warmup_hold_cosine(3, total=10, warmup=0, hold=10, min_ratio=0.1) == 1.0  # no decay phase


def _schedule(**kw):
    base = {'warmup': 10, 'hold': 5, 'min_ratio': 0.01, 'total': 100, 'restarts': [], 'guard': 1.0}
    return {**base, **kw}


@given(step=st.floats(0, 100), warmup=st.integers(0, 30), hold=st.integers(0, 30), min_ratio=st.floats(0, 1))
def test_lr_stays_within_bounds(step, warmup, hold, min_ratio):
    value = warmup_hold_cosine(step, total=100, warmup=warmup, hold=hold, min_ratio=min_ratio)
    low = 0.0 if step < warmup else min_ratio
    assert low - 1e-12 <= value <= 1.0 + 1e-12


@given(warmup=st.integers(1, 40), hold=st.integers(0, 40), min_ratio=st.floats(0, 1))
def test_continuous_at_phase_joins(warmup, hold, min_ratio):
    f = lambda s: warmup_hold_cosine(s, total=100, warmup=warmup, hold=hold, min_ratio=min_ratio)  # noqa: E731
    eps = 1e-6
    for join in (warmup, warmup + hold):
        assert f(join - eps) == pytest.approx(f(join), abs=1e-4)


@given(restart=st.integers(20, 90), peak=st.floats(0.05, 1), rewarmup=st.integers(0, 9), step=st.floats(0, 100))
def test_restarts_stay_within_bounds_and_rewarmup_is_continuous(restart, peak, rewarmup, step):
    schedule = _schedule(restarts=[[restart, peak, rewarmup]])
    value = schedule_factor(schedule, step)
    assert 0.0 <= value <= 1.0 + 1e-12
    if step >= restart + rewarmup:
        assert min(0.01, peak) - 1e-12 <= value <= max(peak, 0.01) + 1e-12
    if rewarmup:
        before = schedule_factor(_schedule(), restart)
        assert schedule_factor(schedule, restart) == pytest.approx(before)  # re-warmup starts where the LR was
        assert schedule_factor(schedule, restart + rewarmup) == pytest.approx(peak)


def test_restart_golden_values_and_guard():
    schedule = _schedule(restarts=[[40, 0.5, 0]], guard=0.5)
    assert schedule_factor(schedule, 40) == pytest.approx(0.5 * 0.5)  # jumps to the peak, times the guard
    assert schedule_factor(schedule, 70) == pytest.approx(0.5 * (0.01 + 0.49 * 0.5))  # half-way down from 0.5
    assert schedule_factor(schedule, 100) == pytest.approx(0.5 * 0.01)
    assert schedule_factor(_schedule(warmup=0.1, hold=0.05), 10) == 1.0  # fractions of total


def test_plateau_detection_table():
    kw = dict(mode='min', min_delta=0.1, patience=2, cooldown=1)
    state, out = PlateauState(), []
    for value in [3.0, 2.5, 2.45, 2.44, 2.43, 2.0, 1.95, 1.96]:
        state, plateau = plateau_step(state, value, **kw)
        out.append(plateau)
    # 2.45 and 2.44 do not beat 2.5 by 0.1 -> plateau; 2.43 is the cooldown; 2.0 improves; then 2 more -> plateau
    assert out == [False, False, False, True, False, False, False, True]
    for bad in (float('nan'), float('inf'), -float('inf')):  # non-finite: neither an improvement nor a plateau
        for mode in ('min', 'max'):
            state = PlateauState(best=1.0, wait=3, cooldown=2)
            assert plateau_step(state, bad, mode=mode, min_delta=0, patience=1, cooldown=0) == (state, False)


def test_smoothing_is_a_median_of_finite_values():
    assert smoothed([1.0, 50.0, 2.0], 3) == 2.0  # a mean would be 17.7
    assert smoothed([4.0, 1.0, 3.0, 2.0], 4) == 2.5
    assert smoothed([9.0, 1.0, float('nan'), 3.0], 3) == 2.0  # the last 3, NaN left out
    assert math.isnan(smoothed([float('nan')], 5))


@given(norms=st.lists(st.one_of(st.floats(0, 100), st.just(float("nan")), st.just(float("inf"))), max_size=40))
def test_guard_scale_stays_within_bounds(norms):
    state, scale = GuardState(), 1.0
    for n in norms:
        state, scale = guard_step(state, n, scale, high=10, low=0.5, patience=2, down=0.5, up=1.25, min_scale=0.1,
                                  max_scale=1.0)
        assert 0.1 <= scale <= 1.0


def test_guard_table():
    kw = dict(high=10, low=0.5, patience=2, down=0.5, up=1.25, min_scale=0.1, max_scale=1.0)
    state, scale, scales = GuardState(), 1.0, []
    for n in [20, 20, 20, 3, 20, 0.1, 0.1, 0.1, 0.1]:
        state, scale = guard_step(state, n, scale, **kw)
        scales.append(scale)
    assert scales == [1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.625, 0.625, 0.78125]


@pytest.mark.parametrize('settings,field', [
    ({'warmup': -1}, 'warmup'),
    ({'warmup': 1.5}, 'warmup'),
    ({'hold': 'long'}, 'hold'),
    ({'min_ratio': 2}, 'min_ratio'),
    ({'mode': 'up'}, 'mode'),
    ({'patience': 0}, 'patience'),
    ({'restart_factor': 0}, 'restart_factor'),
    ({'restart_factor': 1.5}, 'restart_factor'),
    ({'smooth': 0}, 'smooth'),
    ({'guard_low': 20}, 'guard_low'),
    ({'guard_down': 1}, 'guard_down'),
    ({'monitor': ''}, 'monitor'),
])
def test_bad_config_names_the_field(settings, field):
    with pytest.raises(ConfigError) as e:
        LRScheduleConfig(**settings)
    assert str(e.value).startswith(f'{field}:'), str(e.value)


def test_scaled_lambda_schedule_survives_scheduler_pt():
    """The schedule lives in the lambda's __dict__, which LambdaLR saves; scheduler.pt loads with weights_only."""
    params = [torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD(params, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [ScaledLambda(lambda s: 1.0)])
    fn = sched.lr_lambdas[0]
    fn.schedule, fn.scale = _schedule(restarts=[[40, 0.5, 3]]), 2.0
    fn.stretch(30, 80, 100)
    buffer = io.BytesIO()
    torch.save(sched.state_dict(), buffer)
    buffer.seek(0)
    fresh = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(params, lr=0.1), [ScaledLambda(lambda s: 1.0)])
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert [fresh.lr_lambdas[0](s) for s in range(0, 80, 7)] == [fn(s) for s in range(0, 80, 7)]


def _fake(cb, control, step, max_steps=100, **logs):
    from transformers import TrainerState, TrainingArguments
    args = TrainingArguments(output_dir='unused', report_to=[])
    cb.on_log(args, TrainerState(global_step=step, max_steps=max_steps), control, logs={'loss': 1.0, **logs})


def test_callback_restarts_on_plateau_and_round_trips_its_state():
    from transformers import TrainerControl, TrainerState, TrainingArguments
    cb = LRScheduleCallback(LRScheduleConfig(warmup=2, hold=0, patience=2, cooldown=0, smooth=1, max_restarts=1,
                                             rewarmup=1))
    control = TrainerControl()
    cb.on_train_begin(TrainingArguments(output_dir='unused', report_to=[]), TrainerState(max_steps=100), control)
    assert control.new_lr_schedule['warmup'] == 2 and control.new_lr_schedule['restarts'] == []
    protocol.clear_requests(control)
    for step in range(1, 6):  # the loss never improves after step 2: plateau after 2 values
        _fake(cb, control, step, loss=2.0)
    assert cb.restarts == [[4, 0.5, 1]]
    assert control.new_lr_schedule['restarts'] == [[4, 0.5, 1]]
    assert [r.kind for r in control.dynamic_decisions] == ['lr_schedule', 'lr_restart']
    protocol.clear_requests(control)
    for step in range(6, 10):
        _fake(cb, control, step, loss=2.0)
    assert len(cb.restarts) == 1 and control.new_lr_schedule is None  # max_restarts reached
    assert control.dynamic_decisions[-1].reason == 'max_restarts'
    restored = LRScheduleCallback(cb.config)
    restored.load_state_dict(cb.state_dict())
    assert restored.state_dict() == cb.state_dict()
    control2 = TrainerControl()
    restored.on_train_begin(TrainingArguments(output_dir='unused', report_to=[]), TrainerState(), control2)
    assert getattr(control2, 'new_lr_schedule', None) is None  # a resumed run keeps the schedule in scheduler.pt


def test_a_step_schedule_is_requested_and_evaluated_by_stage():
    """``decay: steps``: the callback requests a step schedule (the flag it sets), the protocol accepts it, and the
    factor is the warmup's, then each stage's from its start (fractions of the horizon or steps)."""
    from transformers import TrainerControl, TrainerState, TrainingArguments
    cb = LRScheduleCallback(LRScheduleConfig(decay='steps', steps={0.5: 0.1, 0.25: 0.5}, warmup=4, max_restarts=0))
    control = TrainerControl()
    cb.on_train_begin(TrainingArguments(output_dir='unused', report_to=[]), TrainerState(max_steps=40), control)
    requested = control.new_lr_schedule
    assert requested == {'decay': 'steps', 'warmup': 4, 'steps': [[0.25, 0.5], [0.5, 0.1]], 'guard': 1.0}
    assert protocol.check_lr_schedule(requested)['steps'] == [[0.25, 0.5], [0.5, 0.1]]
    assert 'steps x0.5 from 0.25, x0.1 from 0.5' in control.dynamic_decisions[0].message
    schedule = {**requested, 'total': 40}
    assert [schedule_factor(schedule, k) for k in (0, 2, 4, 9, 10, 19, 20, 39)] == [0, 0.5, 1, 1, 0.5, 0.5, 0.1, 0.1]
    steps = {'decay': 'steps', 'warmup': 0, 'steps': [[30, 0.2]], 'total': 40, 'guard': 0.5}  # in steps; the guard
    assert [schedule_factor(steps, k) for k in (0, 29, 30)] == [0.5, 0.5, 0.1]
    for bad in ({**requested, 'steps': [[0.5, 0.0]]}, {**requested, 'steps': [[1.5, 0.5]]},
                {'decay': 'steps', 'warmup': 4}, {**requested, 'decay': 'linear'}):
        with pytest.raises(ValueError, match='new_lr_schedule'):
            protocol.check_lr_schedule(bad)


def test_missing_monitor_names_the_metrics_seen():
    from transformers import TrainerControl
    cb = LRScheduleCallback(LRScheduleConfig(monitor='token_acc_smoothed'))
    with pytest.raises(ConfigError, match='token_acc_smoothed.*metrics seen: grad_norm, loss'):
        _fake(cb, TrainerControl(), 1, grad_norm=1.0)


def feed(cb, control, losses, nonfinite_at=(), start=1):
    """Training log lines with ``losses`` (a NaN step as the integration reports it: flagged, logged as 0.0)."""
    for i, loss in enumerate(losses):
        bad = i in nonfinite_at
        control.dynamic_loss_nonfinite = 1 if bad else 0
        _fake(cb, control, start + i, max_steps=1000, loss=0.0 if bad else loss)


def restarts_for(losses, nonfinite_at=(), **settings):
    from transformers import TrainerControl
    config = {'warmup': 0, 'hold': 0, 'cooldown': 0, 'max_restarts': 3, **settings}
    cb = LRScheduleCallback(LRScheduleConfig(**config))
    feed(cb, TrainerControl(), losses, nonfinite_at)
    return cb


def test_measured_nan_steps_and_a_spike_do_not_restart_the_readme_settings():
    """Measured with smooth 5, patience 3: one NaN step (logged 0.0) or one spike of 50x among steadily falling losses
    restarted the LR ("loss plateaued")."""
    falling = [3.0 - 0.02 * i for i in range(40)]
    spiked = [*falling[:15], falling[15] * 50, *falling[16:]]
    for name, losses, nonfinite in [('nan', falling, (15, )), ('spike', spiked, ()),
                                    ('nan run', falling, (10, 11, 12, 13))]:
        cb = restarts_for(losses, nonfinite, smooth=5, patience=3)
        assert cb.restarts == [], name
    assert restarts_for(falling, (15, 16, 17), smooth=5, patience=3).nonfinite_skipped == 3
    # and a real plateau still restarts (the test can fail): the same losses flattening out
    flat = falling[:20] + [falling[19]] * 10
    assert len(restarts_for(flat, smooth=5, patience=3).restarts) >= 1


@settings(max_examples=150, deadline=None)
@given(n=st.integers(12, 40), start=st.floats(0.5, 20), steps=st.lists(st.floats(0.011, 0.5), min_size=40,
                                                                        max_size=40),
       at=st.integers(0, 39), kind=st.sampled_from(['nan', 'spike', 'drop', 'inf']), smooth=st.integers(3, 8),
       patience=st.integers(2, 12), min_delta=st.floats(0, 0.01), mode=st.sampled_from(['min', 'max']))
def test_one_noisy_batch_never_restarts(n, start, steps, at, kind, smooth, patience, min_delta, mode):
    """README: "one noisy batch never restarts" — for smooth >= 3 and patience >= 2, one outlier (a NaN step, a 50x
    spike, a drop to 0, an inf) among values improving by more than min_delta every log line never restarts the LR."""
    values = [start]
    for step in steps[:n - 1]:
        values.append(values[-1] + step)  # rising by > min_delta each line ...
    if mode == 'min':
        values = [values[-1] + values[0] - v for v in values]  # ... or falling, for mode min
    at = at % n
    nonfinite = ()
    if kind == 'nan':
        nonfinite = (at, )
    else:
        high, low = values[at] * 50, 0.0  # an outlier the bad way (spike) or the good way (drop), for either mode
        values[at] = {'spike': high if mode == 'min' else low, 'drop': low if mode == 'min' else high,
                      'inf': math.inf}[kind]
    cb = restarts_for(values, nonfinite, smooth=smooth, patience=patience, min_delta=min_delta, mode=mode)
    assert cb.restarts == []


LR_RUN = dict(lr_scheduler_type='cosine', warmup_ratio=0.0, learning_rate=1e-3, max_steps=12)
LR_SETTINGS = {'warmup': 2, 'hold': 2, 'min_ratio': 0.1, 'min_delta': 100.0, 'patience': 2, 'cooldown': 2,
               'smooth': 1, 'max_restarts': 1, 'restart_factor': 0.5}


class OptimizerLR:
    """Test probe: the LR each optimizer step really used (read just before optimizer.step())."""

    def __init__(self):
        from transformers import TrainerCallback

        class Probe(TrainerCallback):

            def on_pre_optimizer_step(probe, args, state, control, optimizer=None, **kwargs):
                self.lrs.append(optimizer.param_groups[0]['lr'])

        self.lrs: list[float] = []
        self.callback = Probe()


@pytest.mark.e2e
@pytest.mark.parametrize('arch', ['qwen2', 'llama'])
def test_lr_schedule_run_restart_logged_lr_and_resume(arch, tmp_path, request, gsm8k_16, monkeypatch):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift.trainers import Seq2SeqTrainer
    model = request.getfixturevalue('tiny_qwen' if arch == 'qwen2' else 'tiny_llama')
    probe = OptimizerLR()
    original_init = Seq2SeqTrainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback(probe.callback)

    monkeypatch.setattr(Seq2SeqTrainer, '__init__', init)
    try:
        sdc.register(lr_schedule=LR_SETTINGS)
        full = run_sft(model, arch, gsm8k_16, str(tmp_path / 'full'), callbacks=['lr_schedule'], save_steps=6,
                       **LR_RUN)
        logs = train_logs(full)
        restarts = [d for d in decisions(full) if d['kind'] == 'lr_restart']
        # every change is an improvement of less than min_delta: the plateau comes after warmup+hold+patience
        assert [d['step'] for d in restarts] == [6]
        expected = _schedule(warmup=2, hold=2, min_ratio=0.1, total=12, restarts=[[6, 0.5, 0]])
        lrs = [row['learning_rate'] for row in logs]
        # logging.jsonl keeps 4 significant digits
        assert lrs == pytest.approx([1e-3 * schedule_factor(expected, k) for k in range(12)], rel=1e-4)
        assert probe.lrs[:12] == pytest.approx(lrs, rel=1e-4)  # the optimizer's LR is the logged LR
        assert restarts[0]['values']['new_lr'] == pytest.approx(1e-3 * 0.5)
        start = [d for d in decisions(full) if d['kind'] == 'lr_schedule']
        assert start[0]['values']['replaced']['lr_scheduler_type'] == 'cosine'
        # resume after the restart: the same LR at every step (schedule from scheduler.pt, state from the pack)
        resumed = run_sft(model, arch, gsm8k_16, full, callbacks=['lr_schedule'], save_steps=6, fresh=False,
                          resume_from_checkpoint=os.path.join(full, 'checkpoint-6'), **LR_RUN)
        tail = train_logs(resumed)[-6:]
        assert [row['learning_rate'] for row in tail] == pytest.approx(lrs[6:])
        assert [row['loss'] for row in tail] == pytest.approx([row['loss'] for row in logs[6:]])
    finally:
        plugin.unregister()


@pytest.mark.e2e
def test_lr_schedule_with_batch_growth_multiplies(tmp_path, tiny_llama, gsm8k_16):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        no_restarts = {**{k: v for k, v in LR_SETTINGS.items() if k != 'restart_factor'}, 'max_restarts': 0}
        sdc.register(lr_schedule=no_restarts,
                     batch_growth={'initial': 1, 'factor': 2, 'interval': 4, 'maximum': 4, 'lr_scaling': 'linear'})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'), callbacks=['batch_growth', 'lr_schedule'],
                      gradient_accumulation_steps=2, **LR_RUN)  # the schedule counts optimizer steps
        logs = train_logs(out)
        expected = _schedule(warmup=2, hold=2, min_ratio=0.1, total=12)
        sizes = [row['dynamic/batch_size'] for row in logs]
        assert sizes == [1] * 4 + [2] * 4 + [4] * 4
        assert [row['learning_rate'] for row in logs] == pytest.approx(
            [1e-3 * b * schedule_factor(expected, k) for k, b in enumerate(sizes)], rel=1e-4)
    finally:
        plugin.unregister()


@pytest.mark.e2e
def test_scheduler_the_pack_cannot_take_over_fails_at_start(tmp_path, tiny_llama, gsm8k_16, monkeypatch):
    """ms-swift routes refuse it before the model loads (``tests/test_plugin_route.py``); a trainer that never
    passed that check (a hand-built HF Trainer, here ms-swift's with the check taken out) is refused at start."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    monkeypatch.setattr(plugin, 'check_pipeline', lambda args: None)
    try:
        sdc.register(lr_schedule={})
        with pytest.raises(ConfigError, match='ReduceLROnPlateau'):
            run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'), callbacks=['lr_schedule'],
                    **{**LR_RUN, 'lr_scheduler_type': 'reduce_lr_on_plateau', 'max_steps': 2},
                    eval_strategy='steps', eval_steps=1, split_dataset_ratio=0.25)
    finally:
        plugin.unregister()


def test_param_group_ratios_are_kept():
    from swift_dynamic_callbacks.integrations.lr import LRControl
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{'params': [a], 'lr': 1e-3}, {'params': [b], 'lr': 1e-4}], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    lr = LRControl()
    lr.wrap(sched)
    lr.horizon = 20
    lr.set_schedule(protocol.check_lr_schedule({'warmup': 4, 'hold': 0, 'min_ratio': 0.1}))
    lr.set_scale(2.0)
    for _ in range(6):
        opt.step()
        sched.step()
    lrs = [g['lr'] for g in opt.param_groups]
    factor = schedule_factor(_schedule(warmup=4, hold=0, min_ratio=0.1, total=20), 6)
    assert lrs == pytest.approx([2e-3 * factor, 2e-4 * factor])


def test_eval_metric_monitor_uses_evaluations():
    from transformers import TrainerControl, TrainerState, TrainingArguments
    cb = LRScheduleCallback(LRScheduleConfig(warmup=0, monitor='eval_acc', mode='max', patience=1, cooldown=0,
                                             smooth=1))
    control, args = TrainerControl(), TrainingArguments(output_dir='unused', report_to=[])
    _fake(cb, control, 1, loss=5.0)  # training logs are not looked at
    cb.on_evaluate(args, TrainerState(global_step=2, max_steps=10), control, metrics={'eval_acc': 0.5})
    cb.on_evaluate(args, TrainerState(global_step=4, max_steps=10), control, metrics={'eval_acc': 0.4})
    assert cb.restarts == [[4, 0.5, 0]]
    with pytest.raises(ConfigError, match="'eval_acc' is not in the evaluation"):
        LRScheduleCallback(cb.config).on_evaluate(args, TrainerState(), control, metrics={'eval_loss': 1.0})


def test_plot_script_prints_and_plots_a_simulated_plateau(tmp_path, capsys):
    from benchmarks import plot_lr_schedule as module
    config = tmp_path / 'c.yaml'
    config.write_text('dynamic_callbacks:\n  lr_schedule: {warmup: 10, hold: 10, max_restarts: 1}\n')
    png = tmp_path / 'lr.png'
    assert module.main(['--config', str(config), '--steps', '100', '--lr', '1e-3', '--plateau', '50', '--plateau',
                        '70', '--png', str(png)]) == 0
    out = capsys.readouterr().out
    assert '| 50 | 0.0005 | 0.5000 | restart' in out
    assert 'plateau at step 70: max_restarts (1) used' in out
    assert '| 15 | 0.001 | 1.0000 |' in out  # hold
    assert png.stat().st_size > 10_000

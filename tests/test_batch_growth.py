"""Progressive batch growth: pure policies, config errors, and a real swift sft run growing 1 -> 2 -> 4 -> 8."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthConfig
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.policies.growth import (grow_once, interval_size, loss_variability_size, lr_scale,
                                                      pieces_for_cap)
from swift_runs import decisions, indices_by_epoch, run_sft, sample_trace, train_logs


def test_interval_table():
    sizes = [interval_size(k, initial=1, factor=2, interval=2, maximum=8) for k in range(9)]
    assert sizes == [1, 1, 2, 2, 4, 4, 8, 8, 8]
    assert [interval_size(k, initial=1, factor=1.5, interval=1, maximum=10) for k in range(7)] == \
        [1, 2, 3, 5, 8, 10, 10]
    assert [interval_size(k, initial=2, factor=2, interval=3, maximum=32, delay=2) for k in range(9)] == \
        [2, 2, 2, 2, 2, 4, 4, 4, 8]


@given(initial=st.integers(1, 16), factor=st.floats(1.01, 8), interval=st.integers(1, 50),
       extra=st.integers(0, 64), delay=st.integers(0, 50), steps=st.lists(st.integers(0, 2000), min_size=2))
def test_interval_growth_is_monotone_and_bounded(initial, factor, interval, extra, delay, steps):
    maximum = initial + extra
    sizes = [interval_size(s, initial=initial, factor=factor, interval=interval, maximum=maximum, delay=delay)
             for s in sorted(steps)]
    assert all(initial <= s <= maximum for s in sizes)
    assert sizes == sorted(sizes)


@given(size=st.integers(1, 1000), factor=st.floats(1.01, 8), maximum=st.integers(1, 2000))
def test_grow_once_always_grows_until_maximum(size, factor, maximum):
    grown = grow_once(size, factor, maximum)
    assert grown == min(maximum, max(size + 1, math.ceil(size * factor)))
    assert grown > size or grown == maximum


@given(batch=st.integers(1, 512), cap=st.integers(1, 64))
def test_pieces_keep_forward_passes_under_the_cap(batch, cap):
    pieces = pieces_for_cap(batch, cap)
    assert -(-batch // pieces) <= cap and (pieces == 1 or -(-batch // (pieces - 1)) > cap)


def test_lr_scale_rules():
    assert lr_scale(8, 2, 'linear') == 4.0
    assert lr_scale(8, 2, 'sqrt') == 2.0
    assert lr_scale(8, 2, 'none') == 1.0
    with pytest.raises(ValueError, match='linear, sqrt or none'):
        lr_scale(8, 2, 'cube')


def bad_size(step, batch_size):
    return 0


@pytest.mark.parametrize('settings,field', [
    ({'factor': 1.0}, 'factor'),
    ({'factor': 0.5}, 'factor'),
    ({'initial': 8, 'maximum': 4}, 'maximum'),
    ({'policy': 'exponential'}, 'policy'),
    ({'policy': 'callable', 'function': f'{__name__}:bad_size'}, 'function'),
    ({'policy': 'callable', 'function': 'no_such_module:fn'}, 'function'),
    ({'policy': 'table'}, 'table'),
    ({'lr_scaling': 'cubic'}, 'lr_scaling'),
    ({'apply_at': 'never'}, 'apply_at'),
    ({'micro_batch_cap': 0}, 'micro_batch_cap'),
    ({'noise_decay': 1.0}, 'noise_decay'),
])
def test_bad_config_names_the_field(settings, field):
    with pytest.raises(ConfigError) as e:
        BatchGrowthConfig(**settings)
    assert str(e.value).startswith(f'{field}:'), str(e.value)


def double_until_6(step, batch_size):
    return min(6, batch_size * 2) if step and step % 3 == 0 else batch_size


def test_callable_policy_by_dotted_path():
    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
    cb = BatchGrowthCallback(BatchGrowthConfig(policy='callable', function=f'{__name__}:double_until_6', maximum=4))
    assert [cb.target(s, 3) for s in (1, 3)] == [3, 4]  # clamped to maximum


GROWTH = {'policy': 'interval', 'initial': 1, 'factor': 2, 'interval': 2, 'maximum': 8, 'micro_batch_cap': 4,
          'lr_scaling': 'linear'}
RUN = dict(callbacks=['batch_growth'], lr_scheduler_type='constant', warmup_ratio=0.0, learning_rate=1e-3)


@pytest.mark.e2e
def test_growth_run_exactly_once_lr_scaled_and_resumable(tmp_path, tiny_llama, gsm8k_16):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(batch_growth=GROWTH, integration={'record_samples': True})
        full = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'full'), max_steps=8, save_steps=4, **RUN)
        trace = sample_trace(full)
        assert [row['batch_size'] for row in trace] == [1, 1, 2, 2, 4, 4, 8, 8]
        # 1+1+2+2+4+4 = 14 samples, then the last 2 of epoch 0 form a short step; epoch 1 starts with 8
        assert [[len(b) for b in row['batches']] for row in trace][-2:] == [[2], [8]]
        by_epoch = indices_by_epoch(trace)
        assert sorted(by_epoch[0]) == list(range(16))
        assert len(set(by_epoch[1])) == len(by_epoch[1]) == 8
        logs = train_logs(full)
        # linear scaling with a constant schedule: the logged LR is 1e-3 x batch, at the step the batch runs
        assert [row['learning_rate'] for row in logs] == pytest.approx([1e-3 * b for b in [1, 1, 2, 2, 4, 4, 8, 8]])
        assert [row['dynamic/num_pieces'] for row in logs] == [1, 1, 1, 1, 1, 1, 2, 2]  # cap 4: 8 runs as 2 x 4
        growths = [d for d in decisions(full) if d['source'] == 'batch_growth' and d['reason'] == 'interval']
        assert [(d['step'], d['values']['new'], d['values']['lr_scale']) for d in growths] == [(2, 2, 2.0), (4, 4, 4.0),
                                                                                              (6, 8, 8.0)]
        # one record per growth, with the LR before and after (no second record from the integration)
        assert [d['values']['old_lr'] for d in growths] == pytest.approx([1e-3, 2e-3, 4e-3])
        assert [d['values']['new_lr'] for d in growths] == pytest.approx([2e-3, 4e-3, 8e-3])
        assert not [d for d in decisions(full) if d['kind'] == 'lr_scale']
        # resume in the middle of the growth: the same sizes at the same steps, the same LR and samples
        part = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'part'), max_steps=4, save_steps=4, **RUN)
        resumed = run_sft(tiny_llama, 'llama', gsm8k_16, part, max_steps=8, save_steps=4, fresh=False,
                          resume_from_checkpoint=os.path.join(part, 'checkpoint-4'), **RUN)
        assert [row['batches'] for row in sample_trace(resumed)] == [row['batches'] for row in trace]
        resumed_growths = [d for d in decisions(resumed) if d['source'] == 'batch_growth' and d['reason'] == 'interval']
        applied = [d for d in resumed_growths if not d['values'].get('pending')]
        assert [(d['step'], d['values']['new_lr']) for d in applied] == \
            [(d['step'], d['values']['new_lr']) for d in growths]
        # the growth decided after the last step of the first run is logged there as pending, then applied once
        assert [(d['step'], d['values']['new']) for d in resumed_growths if d['values'].get('pending')] == [(4, 4)]
        resumed_logs = train_logs(resumed)
        assert [row['learning_rate'] for row in resumed_logs] == [row['learning_rate'] for row in logs]
        assert [row['loss'] for row in resumed_logs] == [row['loss'] for row in logs]  # same data, RNG, LR
    finally:
        plugin.unregister()


def test_a_table_by_samples_grows_at_the_samples_named_whatever_ga():
    """``table_unit: samples``: the callback requests each size once the samples consumed (the sizes in effect x GA
    x processes) reach its key; the same table at GA 2 and GA 4 switches at the same samples, not the same steps; the
    count is saved and restored with the callback's state."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
    table = {0: 1, 8: 2, 16: 4}
    for ga, switch_steps in ((2, {4: 2, 6: 4}), (4, {2: 2, 3: 4})):
        cb = BatchGrowthCallback(BatchGrowthConfig(policy='table', table_unit='samples', table=table, maximum=4))
        args = TrainingArguments(output_dir='unused', report_to=[], gradient_accumulation_steps=ga)
        control = TrainerControl()
        cb.on_train_begin(args, TrainerState(), control)
        assert control.new_batch_size == 1
        requested = {}
        for step in range(1, 7):
            control = TrainerControl()
            cb.on_step_end(args, TrainerState(global_step=step), control)
            if getattr(control, 'new_batch_size', None) is not None:
                requested[step] = control.new_batch_size
        assert {k: v for k, v in requested.items() if k in switch_steps} == switch_steps
        assert set(requested) == set(switch_steps)  # nothing else requested
        restored = BatchGrowthCallback(cb.config)
        restored.load_state_dict(cb.state_dict())
        assert restored.samples == cb.samples >= 16
    with pytest.raises(ConfigError, match='table_unit'):
        BatchGrowthConfig(policy='interval', table_unit='samples')  # read by the table policy only


@pytest.mark.e2e
def test_a_table_by_samples_trains_as_the_same_table_by_steps(tmp_path, tiny_llama, gsm8k_16):
    """16 rows, GA 2: ``{0: 1, 4: 2, 8: 4}`` by samples is ``{0: 1, 2: 2, 3: 4}`` by steps (2 + 1 + 1 steps of 2,
    4, 8 samples): the same batch, LR and loss at every step."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    base = {'policy': 'table', 'initial': 1, 'maximum': 4, 'lr_scaling': 'sqrt'}
    run = dict(RUN, gradient_accumulation_steps=2, num_train_epochs=1, max_steps=-1)
    logs = {}
    try:
        for name, growth in (('steps', {'table': {0: 1, 2: 2, 3: 4}}),
                             ('samples', {'table': {0: 1, 4: 2, 8: 4}, 'table_unit': 'samples'})):
            sdc.register(batch_growth={**base, **growth})
            logs[name] = train_logs(run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / name), **run))
            plugin.unregister()
    finally:
        plugin.unregister()
    assert [row['dynamic/global_batch_size'] for row in logs['samples']] == [2, 2, 4, 8]
    for key in ('dynamic/global_batch_size', 'learning_rate', 'loss', 'dynamic/samples_seen'):
        assert [row[key] for row in logs['samples']] == [row[key] for row in logs['steps']], key


@pytest.mark.e2e
def test_rewarm_in_swift_the_logged_lr_ramps_to_each_growths_scale(tmp_path, tiny_llama, gsm8k_16):
    """A real run with rewarm: 2 (linear scaling, constant schedule): the LR logged at each step is the ramp the
    callback requested, the samples are those of the same growth without re-warming."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(batch_growth={**GROWTH, 'interval': 3, 'maximum': 4, 'rewarm': 2},
                     integration={'record_samples': True})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'rewarm'), max_steps=8, save_steps=100, **RUN)
        # growths after steps 3 (1 -> 2) and 6 (2 -> 4): half-way the step after, the whole scale the next
        assert [row['learning_rate'] for row in train_logs(out)] == pytest.approx(
            [1e-3 * s for s in [1, 1, 1, 1.5, 2, 2, 3, 4]])
        assert [row['batch_size'] for row in sample_trace(out)] == [1, 1, 1, 2, 2, 2, 4, 4]
        ramp = [(d['step'], d['values']['new']) for d in decisions(out) if d['reason'] == 'rewarm']
        assert ramp == [(4, 2.0), (7, 4.0)]
    finally:
        plugin.unregister()


def test_loss_variability_policy_table():
    kw = dict(window=4, threshold=0.05, factor=2, maximum=16)
    assert loss_variability_size([2.0, 2.0, 2.0], 2, **kw) == 2  # too few values: hold
    assert loss_variability_size([2.0, 2.01, 1.99, 2.0], 2, **kw) == 2  # cv 0.004: stable, hold
    assert loss_variability_size([2.0, 2.6, 1.5, 2.2], 2, **kw) == 4  # cv 0.18: noisy, grow
    assert loss_variability_size([9.0, 9.0, 2.0, 2.6, 1.5, 2.2], 16, **kw) == 16  # at maximum


def _fake_step(cb, control, step, loss=None):
    from transformers import TrainerState, TrainingArguments
    args = TrainingArguments(output_dir='unused', gradient_accumulation_steps=1, report_to=[])
    state = TrainerState(global_step=step)
    if loss is not None:
        cb.on_log(args, state, control, logs={'loss': loss})
    cb.on_step_end(args, state, control)


def test_loss_variability_callback_grows_on_noise_and_clears_its_window():
    from transformers import TrainerControl
    from swift_dynamic_callbacks import protocol
    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
    cb = BatchGrowthCallback(
        BatchGrowthConfig(policy='loss_variability', initial=2, interval=4, window=4, threshold=0.05, maximum=8))
    control = TrainerControl()
    cb.batch_size = 2
    for step, loss in zip(range(1, 5), [2.0, 2.6, 1.5, 2.2]):  # noisy: grows at step 4 (first check)
        _fake_step(cb, control, step, loss)
    assert control.new_batch_size == 4 and cb.strategy.losses == []
    protocol.clear_requests(control)
    for step, loss in zip(range(5, 9), [2.0, 2.01, 1.99, 2.0]):  # stable: holds at step 8
        _fake_step(cb, control, step, loss)
    assert control.new_batch_size is None and cb.batch_size == 4
    restored = BatchGrowthCallback(cb.config)
    restored.load_state_dict(cb.state_dict())
    assert restored.strategy.losses == cb.strategy.losses and restored.batch_size == 4


def test_loss_variability_takes_rank_0s_size(monkeypatch):
    """The loss window is this rank's: the size it asks for is rank 0's (broadcast), the same on every rank."""
    from transformers import TrainerControl
    from swift_dynamic_callbacks import distributed
    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
    sent = []

    def broadcast(value):  # rank 0 saw stable losses and holds at 2
        sent.append(value)
        return 2

    monkeypatch.setattr(distributed, 'broadcast_from_main', broadcast)
    cb = BatchGrowthCallback(
        BatchGrowthConfig(policy='loss_variability', initial=2, interval=4, window=4, threshold=0.05, maximum=8))
    control = TrainerControl()
    cb.batch_size = 2
    for step, loss in zip(range(1, 5), [2.0, 2.6, 1.5, 2.2]):  # this rank's losses are noisy: it would grow
        _fake_step(cb, control, step, loss)
    assert sent[-1] == 4 and getattr(control, 'new_batch_size', None) is None and cb.batch_size == 2


def test_apply_at_epoch_holds_a_change_until_the_epoch_ends():
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
    cb = BatchGrowthCallback(BatchGrowthConfig(initial=1, factor=2, interval=2, maximum=8, apply_at='epoch'))
    args = TrainingArguments(output_dir='unused', report_to=[])
    control = TrainerControl()
    cb.on_train_begin(args, TrainerState(global_step=0), control)
    assert control.new_batch_size == 1
    control.new_batch_size = None
    for step in range(1, 6):  # the interval schedule says 2 from step 2 and 4 from step 4: held
        cb.on_step_end(args, TrainerState(global_step=step), control)
        assert control.new_batch_size is None
    assert cb.pending == 4
    cb.on_epoch_end(args, TrainerState(global_step=5), control)
    assert control.new_batch_size == 4 and cb.batch_size == 4 and cb.pending is None


@pytest.mark.e2e
def test_epoch_budget_growth_runs_the_whole_lr_schedule(tmp_path, tiny_llama, gsm8k_16):
    """With num_train_epochs, growth shortens the run; the LR decay is stretched to end when the data does."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(batch_growth={'initial': 1, 'factor': 2, 'interval': 2, 'maximum': 4, 'lr_scaling': 'none'})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'), callbacks=['batch_growth'], max_steps=-1,
                      num_train_epochs=1, lr_scheduler_type='linear', warmup_ratio=0.0, learning_rate=1e-3)
        logs = train_logs(out)
        assert [row['dynamic/batch_size'] for row in logs] == [1, 1, 2, 2, 4, 4, 4]  # 16 samples in 7 steps, not 16
        lrs = [row['learning_rate'] for row in logs]
        # the LR each step used: before any growth the plan is 16 steps at batch 1 (lambda(1) = 15/16)
        assert lrs[:2] == pytest.approx([1e-3, 1e-3 * 15 / 16])
        assert all(a > b for a, b in zip(lrs, lrs[1:])) and 0 < lrs[-1] <= 1e-3 / 4  # the decay ends with the data
        # per_device_train_batch_size is 2, so the first plan is 8 steps; the growth's start at 1 makes it 16, then
        # the growths 9 and 7: each time the rest of the schedule is stretched to end with the data
        stretched = [d['values']['new'] for d in decisions(out)
                     if d['kind'] == 'max_steps' and d['reason'] != 'epoch_budget']
        assert stretched == [16, 9, 7]
    finally:
        plugin.unregister()


@pytest.mark.e2e
def test_sample_budget_max_steps_counts_samples(tmp_path, tiny_llama, gsm8k_16):
    """max_steps_unit: samples -- max_steps 12 at batch 2 is 24 samples; growing the batch means fewer steps."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(batch_growth={'initial': 2, 'factor': 2, 'interval': 2, 'maximum': 8, 'lr_scaling': 'none'},
                     integration={'max_steps_unit': 'samples', 'record_samples': True})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'), callbacks=['batch_growth'], max_steps=12,
                      per_device_train_batch_size=2, lr_scheduler_type='linear', warmup_ratio=0.0,
                      learning_rate=1e-3)
        trace = sample_trace(out)
        used = [sum(len(b) for b in row['batches']) for row in trace]
        # 2, 2, 4, 4 (12 samples), then 8: the epoch's last 4, then 8 of epoch 1 -> 24 samples in 6 steps
        assert used == [2, 2, 4, 4, 4, 8] and sum(used) == 24
        by_epoch = indices_by_epoch(trace)
        assert sorted(by_epoch[0]) == list(range(16)) and len(set(by_epoch[1])) == 8
        logs = train_logs(out)
        assert len(logs) == 6 and logs[-1]['global_step/max_steps'] == '6/6'  # the progress total is honest
        lrs = [row['learning_rate'] for row in logs]
        assert lrs[0] == pytest.approx(1e-3)  # the LR step 1 used: 12 steps planned at batch 2, lambda(0) = 1
        assert all(a > b for a, b in zip(lrs, lrs[1:])) and 0 < lrs[-1] <= 1e-3 / 4  # the decay ends with the data
        budget = [d for d in decisions(out) if d['kind'] == 'max_steps' and d['reason'] == 'sample_budget']
        assert budget and budget[0]['values']['budget_samples'] == 24
        stops = [d for d in decisions(out) if d['kind'] == 'stop']
        assert [d['reason'] for d in stops] == ['sample_budget']
    finally:
        plugin.unregister()


# ---- seesaw (arXiv 2510.14717) ---------------------------------------------------------------------------------
def test_seesaw_cuts_table():
    from swift_dynamic_callbacks.policies.growth import seesaw_cuts
    assert seesaw_cuts(1.0, 1.0, 2) == 0  # at the peak
    assert seesaw_cuts(0.3, 0.3, 2) == 0  # warmup: the factor is its own peak
    assert seesaw_cuts(0.0, 0.0, 2) == 0  # step 0 of a warmup: no peak yet
    assert seesaw_cuts(0.51, 1.0, 2) == 0
    assert seesaw_cuts(0.5, 1.0, 2) == 1  # exactly one cut by alpha
    assert seesaw_cuts(0.26, 1.0, 2) == 1
    assert seesaw_cuts(0.25, 1.0, 2) == 2
    assert seesaw_cuts(0.1, 1.0, 3) == 2  # log3(10) = 2.1


def test_seesaw_size_grows_once_per_cut_up_to_the_cap():
    from swift_dynamic_callbacks.policies.growth import seesaw_size
    assert [seesaw_size(k, initial=1, factor=2, maximum=4) for k in range(5)] == [1, 2, 4, 4, 4]
    assert [seesaw_size(k, initial=2, factor=1.5, maximum=16) for k in range(4)] == [2, 3, 5, 8]


@given(peak=st.floats(0.1, 10), ratio=st.floats(1e-4, 1), alpha=st.sampled_from([1.5, 2.0, 4.0]),
       maximum=st.integers(1, 64))
def test_seesaw_turns_each_cut_into_sqrt_alpha_lr_and_alpha_batch(peak, ratio, alpha, maximum):
    """Below the cap, the LR seesaw uses is the schedule's times sqrt(B_k / B_0): per cut by alpha, sqrt(alpha)."""
    from swift_dynamic_callbacks.policies.growth import seesaw_cuts, seesaw_size
    factor = peak * ratio
    k = seesaw_cuts(factor, peak, alpha)
    assert peak / alpha ** (k + 1) < factor * (1 + 1e-9) and factor <= peak / alpha ** k * (1 + 1e-9)
    size = seesaw_size(k, initial=1, factor=alpha, maximum=maximum)
    used_lr = factor * lr_scale(size, 1, 'sqrt')
    assert used_lr >= factor and size <= maximum
    if alpha == 2.0 and 2 ** k <= maximum:  # an exact doubling per cut: the LR fell by sqrt(2) per cut
        assert size == 2 ** k
        assert used_lr == pytest.approx(factor * math.sqrt(2) ** k)


def test_seesaw_settings_are_checked():
    with pytest.raises(ConfigError, match='lr_scaling: policy seesaw .* got .none.'):
        BatchGrowthConfig(policy='seesaw', lr_scaling='none')
    with pytest.raises(ConfigError, match='interval'):
        BatchGrowthConfig(policy='seesaw', interval=5)  # seesaw does not read interval: refused, named
    assert BatchGrowthConfig(policy='seesaw', factor=2, maximum=8).policy == 'seesaw'


class _Sched:
    def __init__(self, lr):
        self.lr = lr

    def get_last_lr(self):
        return [self.lr]


def _drive_with_requested_scale(cb, factors, base_lr=1e-3):
    """Step ``cb`` through a schedule the way the integration does: the LR the scheduler reports at step ``s`` is
    ``base_lr x factor(s) x`` the last ``new_lr_scale`` the callback *requested* (1.0 before any), never the scale
    the callback believes it has. Returns ``(step, batch requested, lr scale requested)`` per request, the records
    and, per step, the batch and LR in effect."""
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from swift_dynamic_callbacks import protocol
    args = TrainingArguments(output_dir='unused', learning_rate=base_lr, gradient_accumulation_steps=1, report_to=[])
    control = TrainerControl()
    total = len(factors)
    cb.on_train_begin(args, TrainerState(global_step=0, max_steps=total), control)
    batch, applied = control.new_batch_size, control.new_lr_scale if control.new_lr_scale is not None else 1.0
    requests, effect = [(0, batch, applied)], []
    decided = list(protocol.drain_decisions(control))
    for step, factor in enumerate(factors, start=1):
        protocol.clear_requests(control)
        lr = base_lr * factor * applied
        effect.append((step, batch, lr))
        cb.on_step_end(args, TrainerState(global_step=step, max_steps=total), control, lr_scheduler=_Sched(lr))
        if control.new_batch_size is not None:
            requests.append((step, control.new_batch_size, control.new_lr_scale))
            batch = control.new_batch_size
        if control.new_lr_scale is not None:
            applied = control.new_lr_scale
        decided += protocol.drain_decisions(control)
    return requests, decided, effect


# the schedule's factor per step (warmup, peak, then a decay)
_FACTORS = [0.5, 1.0, 0.9, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02]


def test_seesaw_callback_follows_the_schedule_cuts():
    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
    cb = BatchGrowthCallback(BatchGrowthConfig(policy='seesaw', initial=1, factor=2, maximum=4))
    requests, decided, _ = _drive_with_requested_scale(cb, _FACTORS[:9])
    # at 0.45 and 0.2 of the peak: the first steps at or below 1/2 and 1/4 of it (growth at 8 is the scale bug)
    assert requests == [(0, 1, 1.0), (5, 2, pytest.approx(math.sqrt(2))), (7, 4, pytest.approx(2.0))]
    assert [(r.reason, r.values['new'], r.values['lr_cuts']) for r in decided] == [
        ('start', 1, 0), ('seesaw', 2, 1), ('seesaw', 4, 2)]
    restored = BatchGrowthCallback(cb.config)
    restored.load_state_dict(cb.state_dict())
    assert restored.strategy.state == cb.strategy.state and restored.strategy.state.cuts == 4


def _cut_steps(factors, alpha, cuts):
    """Independently of the policy code: the first step at which the schedule is at or below peak / alpha^k."""
    peak, out = 0.0, []
    for step, f in enumerate(factors, start=1):
        peak = max(peak, f)
        while len(out) < cuts and f <= peak / alpha ** (len(out) + 1) * (1 + 1e-9):
            out.append(step)
    return out


@pytest.mark.parametrize('settings', [
    {'policy': 'interval', 'interval': 3},
    {'policy': 'table', 'table': {0: 1, 4: 2, 8: 4}},
    {'policy': 'late_switch', 'switch_at': 0.5},
    {'policy': 'seesaw'},
    {'policy': 'interval', 'interval': 4, 'lr_scaling': 'linear'},
    {'policy': 'interval', 'interval': 3, 'weight_decay_scaling': 'power_lines'},
    {'policy': 'seesaw', 'beta2_scaling': 'half_life'},
], ids=lambda s: '-'.join(f'{v}' for v in s.values()))
def test_the_lr_in_effect_is_the_schedule_times_the_requested_scale(settings):
    """Every growth policy that scales the LR: through a scheduler that applies only what was requested, the LR in
    effect at every step is the schedule's times lr_scale(batch in effect); Seesaw's growths fall on the cuts."""
    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
    config = BatchGrowthConfig(**{'initial': 1, 'factor': 2, 'maximum': 4, 'lr_scaling': 'sqrt', **settings})
    cb = BatchGrowthCallback(config)
    requests, _, effect = _drive_with_requested_scale(cb, _FACTORS)
    for (step, batch, lr), factor in zip(effect, _FACTORS):
        assert lr == pytest.approx(1e-3 * factor * lr_scale(batch, 1, config.lr_scaling)), step
    sizes = [b for _, b, _ in requests]
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == 4  # every policy here grows to 4 in the run
    if config.policy == 'seesaw':
        assert [s for s, _, _ in requests[1:]] == _cut_steps(_FACTORS, 2.0, 2)


def test_rewarm_ramps_the_requested_lr_scale_to_each_growths_in_n_steps():
    """rewarm: 3 with growths 1 -> 2 -> 4 every 4 steps (sqrt): each growth requests a third of the way from the scale
    in effect, the next two steps the rest; the LR in effect is the schedule's times what was requested."""
    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
    from swift_dynamic_callbacks.policies.growth import rewarm_scale
    cb = BatchGrowthCallback(BatchGrowthConfig(policy='interval', initial=1, factor=2, interval=4, maximum=4,
                                               rewarm=3))
    requests, decided, effect = _drive_with_requested_scale(cb, [1.0] * 12)
    assert [(s, b) for s, b, _ in requests] == [(0, 1), (4, 2), (8, 4)]
    r2 = math.sqrt(2)
    ramp = [1 + (r2 - 1) / 3, 1 + 2 * (r2 - 1) / 3, r2, r2, r2 + (2 - r2) / 3, r2 + 2 * (2 - r2) / 3]
    assert [lr / 1e-3 for _, _, lr in effect[4:10]] == pytest.approx(ramp)  # steps 5-10
    assert effect[11][2] == pytest.approx(2e-3)  # reached: the growth's scale
    rewarms = [r for r in decided if r.reason == 'rewarm']
    assert [(r.step, r.values['step_of_rewarm']) for r in rewarms] == [(5, 2), (6, 3), (9, 2), (10, 3)]
    assert all(r.kind == 'lr_scale' for r in rewarms)
    grown = [r for r in decided if r.kind == 'batch_size' and r.reason == 'interval']
    assert [r.values['lr_scale_target'] for r in grown] == pytest.approx([r2, 2.0])
    assert rewarm_scale(1.0, 2.0, 1, 0) == 2.0 and rewarm_scale(1.0, 2.0, 5, 4) == 2.0


def test_rewarm_resumes_mid_ramp_and_is_refused_where_it_cannot_apply():
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback
    config = BatchGrowthConfig(policy='interval', initial=1, factor=4, interval=2, maximum=4, rewarm=4)
    cb = BatchGrowthCallback(config)
    _drive_with_requested_scale(cb, [1.0] * 3)  # grown at step 2 to 4 (scale 2): 2 of the 4 ramp steps requested
    assert cb.rewarm == {'before': 1.0, 'after': 2.0, 'done': 2} and cb.lr_scale == pytest.approx(1.5)
    restored = BatchGrowthCallback(config)
    restored.load_state_dict(cb.state_dict())
    control = TrainerControl()
    args = TrainingArguments(output_dir='unused', gradient_accumulation_steps=1, report_to=[])
    restored.on_step_end(args, TrainerState(global_step=4, max_steps=9), control, lr_scheduler=_Sched(1e-3))
    assert control.new_lr_scale == pytest.approx(1.75) and getattr(control, 'new_batch_size', None) is None
    with pytest.raises(ConfigError, match='rewarm: policy seesaw'):
        BatchGrowthConfig(policy='seesaw', rewarm=2)
    with pytest.raises(ConfigError, match='rewarm'):
        BatchGrowthConfig(policy='interval', lr_scaling='none', rewarm=2)
    old = BatchGrowthCallback(config)  # a checkpoint from before re-warming: the batch's own scale
    old.load_state_dict({'batch_size': 4, 'pending': None})
    assert old.lr_scale == pytest.approx(2.0) and old.rewarm is None


def _hf_cosine(step: int, warmup: int, total: int) -> float:
    """transformers' ``get_cosine_schedule_with_warmup`` factor, written out here (not the pack's code)."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


@pytest.mark.e2e
def test_seesaw_growth_steps_are_the_schedule_cuts_in_swift(tmp_path, tiny_qwen, gsm8k_16):
    """A real swift sft run with HF's cosine schedule and Seesaw without optimizer scaling: the steps at which the
    batch grew are the first steps at which the cosine (computed here) is at or below 1/2 and 1/4 of its peak, and
    the LR logged at every step is the cosine's times sqrt(batch / initial)."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    total, warmup, base = 12, 1, 1e-3
    try:
        sdc.register(batch_growth={'policy': 'seesaw', 'initial': 1, 'factor': 2, 'maximum': 4})
        out = run_sft(tiny_qwen, 'qwen2', gsm8k_16, str(tmp_path / 'out'), callbacks=['batch_growth'],
                      max_steps=total, learning_rate=base, lr_scheduler_type='cosine', warmup_steps=warmup,
                      per_device_train_batch_size=1)
    finally:
        plugin.unregister()
    factors = [_hf_cosine(s, warmup, total) for s in range(1, total + 1)]
    expected = _cut_steps(factors, 2.0, 2)
    assert expected == [7, 9]  # the closed form: cos(pi (s-1)/11) <= 0 from s = 6.5, <= -1/2 from s = 8.33
    growths = [d for d in decisions(out) if d['source'] == 'batch_growth' and d['reason'] == 'seesaw']
    assert [(d['step'], d['values']['new']) for d in growths] == [(7, 2), (9, 4)]
    logs = train_logs(out)
    assert len(logs) == total
    for step, row in enumerate(logs, start=1):  # step s ran at the cosine's factor for s - 1 and the batch then
        batch = 1 if step <= 7 else 2 if step <= 9 else 4
        assert row['dynamic/batch_size'] == batch, step
        assert row['learning_rate'] == pytest.approx(base * _hf_cosine(step - 1, warmup, total) * math.sqrt(batch),
                                                     rel=1e-4, abs=1e-12), step


@pytest.mark.e2e
def test_seesaw_with_lr_schedule_cosine_in_swift(tmp_path, tiny_llama, gsm8k_16):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(batch_growth={'policy': 'seesaw', 'initial': 1, 'factor': 2, 'maximum': 4},
                     lr_schedule={'warmup': 1, 'hold': 1, 'min_ratio': 0.05})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'), callbacks=['batch_growth', 'lr_schedule'],
                      max_steps=-1, num_train_epochs=1, learning_rate=1e-3, per_device_train_batch_size=1)
    finally:
        plugin.unregister()
    logs = train_logs(out)
    sizes = [row['dynamic/batch_size'] for row in logs]
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] > 1
    assert logs[-1]['dynamic/samples_seen'] == 16 and logs[-1]['learning_rate'] > 0  # one epoch, every sample
    growths = [d for d in decisions(out) if d['source'] == 'batch_growth' and d['reason'] == 'seesaw']
    assert growths and all(d['values']['lr_cuts'] >= 1 for d in growths)
    # the schedule's factor as the trainer applied it (not the callback's belief): step s + 1 ran at the factor for
    # s times the LR scale then in effect
    factor = {step - 1: row['learning_rate'] / (1e-3 * row['dynamic/lr_scale']) for step, row in enumerate(logs, 1)}
    peak = max(factor.values())
    for d in growths:  # each growth by 2 came at the first step at or below 1/2^k of the peak, LR x sqrt(2)^k
        k = int(round(math.log2(d['values']['new'])))
        assert factor[d['step']] <= peak * 0.5 ** k * (1 + 1e-6) < factor[d['step'] - 1]
        assert d['values']['lr_scale'] == pytest.approx(math.sqrt(2) ** k)

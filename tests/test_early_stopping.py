"""Early stopping: the pure stop policy, config errors, hooks with fakes, and real swift sft runs (plateau, resume)."""

from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import TrainerControl, TrainerState, TrainingArguments

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.callbacks.early_stopping import EarlyStoppingCallback, EarlyStoppingConfig
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.policies.stopping import StopReason, improves, stop_decision
from swift_dynamic_callbacks.state import read_state
from swift_runs import decisions, read_jsonl, run_sft, train_logs

# ---- the pure policy ------------------------------------------------------------------------------------


def run_policy(values, **kw):
    """Feed ``values`` through stop_decision; return (index of the stopping value or None, reason)."""
    best, wait = None, 0
    for i, value in enumerate(values):
        d = stop_decision(value, best, wait, **kw)
        best, wait = d.best, d.wait
        if d.stop:
            return i, d.reason
    return None, None


def test_stop_policy_table():
    kw = dict(mode='min', patience=2)
    assert run_policy([3.0, 2.0, 1.0, 0.5], **kw) == (None, None)
    assert run_policy([3.0, 2.0, 2.5, 2.1], **kw) == (3, StopReason.PATIENCE)
    assert run_policy([3.0, 2.0, 2.5, 1.0, 1.5, 1.2], **kw) == (5, StopReason.PATIENCE)  # improvement resets wait
    assert run_policy([3.0, 2.95, 2.9], mode='min', patience=2, min_delta=0.1) == (2, StopReason.PATIENCE)
    assert run_policy([0.1, 0.3, 0.2, 0.25], mode='max', patience=2) == (3, StopReason.PATIENCE)
    assert run_policy([3.0, 2.0, 0.9], mode='min', patience=5, threshold=1.0) == (2, StopReason.THRESHOLD)
    assert run_policy([0.5, 0.95], mode='max', patience=5, threshold=0.9) == (1, StopReason.THRESHOLD)
    assert run_policy([3.0, 2.0, 10.5], mode='min', patience=5, divergence=10.0) == (2, StopReason.DIVERGENCE)
    assert run_policy([3.0, float('nan')], **kw) == (1, StopReason.NON_FINITE)
    assert run_policy([float('inf')], **kw) == (0, StopReason.NON_FINITE)
    with pytest.raises(ValueError, match='mode'):
        stop_decision(1.0, None, 0, mode='lowest', patience=1)


finite = st.floats(-1e6, 1e6, allow_nan=False)


@given(values=st.lists(finite, min_size=1, max_size=40), patience=st.integers(1, 6),
       min_delta=st.floats(0, 10), mode=st.sampled_from(['min', 'max']))
def test_patience_stop_happens_exactly_after_patience_non_improvements(values, patience, min_delta, mode):
    index, reason = run_policy(values, mode=mode, patience=patience, min_delta=min_delta)
    # an independent count: non-improvements in a row since the last improvement
    best, wait, expected = None, 0, None
    for i, v in enumerate(values):
        if improves(v, best, mode, min_delta):
            best, wait = v, 0
        else:
            wait += 1
        if wait >= patience:
            expected = i
            break
    assert index == expected
    assert reason == (StopReason.PATIENCE if expected is not None else None)


@given(values=st.lists(finite, min_size=1, max_size=20), mode=st.sampled_from(['min', 'max']))
def test_best_is_the_extreme_value_without_min_delta(values, mode):
    best, wait = None, 0
    for v in values:
        d = stop_decision(v, best, wait, mode=mode, patience=10_000)
        best, wait = d.best, d.wait
    assert best == (min(values) if mode == 'min' else max(values))


@given(prefix=st.lists(finite, max_size=10), bad=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_non_finite_always_stops(prefix, bad):
    best, wait = None, 0
    for v in prefix:
        d = stop_decision(v, best, wait, mode='min', patience=10_000)
        best, wait = d.best, d.wait
    d = stop_decision(bad, best, wait, mode='min', patience=10_000, threshold=-1e9, divergence=1e9)
    assert d.stop and d.reason is StopReason.NON_FINITE and d.best == best and d.wait == wait


# ---- config -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize('settings,field', [
    ({'patience': 0}, 'patience'),
    ({'patience': True}, 'patience'),
    ({'mode': 'lowest'}, 'mode'),
    ({'min_delta': -0.1}, 'min_delta'),
    ({'min_delta': float('nan')}, 'min_delta'),
    ({'threshold': 'low'}, 'threshold'),
    ({'monitor': ''}, 'monitor'),
    ({'threshold': 1.0, 'divergence': 0.5}, 'divergence'),
    ({'resume_stopped': 'maybe'}, 'resume_stopped'),
])
def test_bad_config_names_the_field(settings, field):
    with pytest.raises(ConfigError) as e:
        EarlyStoppingConfig(**settings)
    assert str(e.value).startswith(f'{field}:'), str(e.value)


def test_yaml_settings_and_unknown_keys():
    config = EarlyStoppingCallback.config_from_mapping({'monitor': 'loss', 'patience': 2})
    assert config.monitor == 'loss' and not config.on_eval
    with pytest.raises(ConfigError, match='dynamic_callbacks.early_stopping: unknown setting'):
        EarlyStoppingCallback.config_from_mapping({'patiance': 2})


def test_name_does_not_clash_with_ms_swift():
    from swift.callbacks import callbacks_map
    from swift_dynamic_callbacks.integrations.swift import CALLBACKS
    assert EarlyStoppingCallback.name == 'early_stopping' != 'early_stop'
    assert CALLBACKS['early_stopping'] is EarlyStoppingCallback
    assert callbacks_map.get('early_stop') is not EarlyStoppingCallback


# ---- hooks with fakes ------------------------------------------------------------------------------------

ARGS = TrainingArguments(output_dir='unused', report_to=[], eval_strategy='steps', eval_steps=10)


def evaluate(cb, control, step, value, **extra):
    control.should_training_stop = control.should_save = False
    cb.on_evaluate(ARGS, TrainerState(global_step=step), control, metrics={'eval_loss': value, **extra})
    return control.should_training_stop


def test_eval_monitor_stops_softly_and_records_once_saved():
    cb = EarlyStoppingCallback(EarlyStoppingConfig(patience=2))
    control = TrainerControl()
    assert not evaluate(cb, control, 10, 2.0)
    assert protocol.current_metrics(control) == {'dynamic/early_stopping_patience_left': 2.0,
                                                 'dynamic/early_stopping_best': 2.0}
    assert not evaluate(cb, control, 20, 2.5)
    assert protocol.current_metrics(control)['dynamic/early_stopping_patience_left'] == 1.0
    assert evaluate(cb, control, 30, 2.1)
    assert control.should_save  # a final checkpoint before the loop ends
    assert protocol.drain_decisions(control) == []  # the record waits for that checkpoint
    cb.on_save(ARGS, TrainerState(global_step=30), control)
    [record] = protocol.drain_decisions(control)
    assert (record.kind, record.reason, record.step) == ('stop', 'patience', 30)
    assert record.values['checkpoint'] == 'checkpoint-30' and record.values['best'] == 2.0
    assert cb.state_dict() == {'best': 2.0, 'wait': 2, 'checks': 3, 'stopped': True, 'reason': 'patience',
                               'stop_step': 30}
    cb.on_train_end(ARGS, TrainerState(global_step=30), control)
    assert protocol.drain_decisions(control) == []  # written once


def test_record_written_at_train_end_when_no_save_followed():
    cb = EarlyStoppingCallback(EarlyStoppingConfig(patience=1, threshold=1.0))
    control = TrainerControl()
    assert evaluate(cb, control, 5, 0.5)
    cb.on_train_end(ARGS, TrainerState(global_step=5), control)
    [record] = protocol.drain_decisions(control)
    assert record.reason == StopReason.THRESHOLD.value == 'threshold' and 'checkpoint' not in record.values


def test_patience_survives_a_state_round_trip():
    values = [3.0, 2.0, 2.5, 2.4, 2.2, 2.3]
    whole = EarlyStoppingCallback(EarlyStoppingConfig(patience=3))
    control = TrainerControl()
    stops = [evaluate(whole, control, 10 * (i + 1), v) for i, v in enumerate(values)]
    assert stops.index(True) == 4
    first = EarlyStoppingCallback(EarlyStoppingConfig(patience=3))
    for i, v in enumerate(values[:3]):
        evaluate(first, control, 10 * (i + 1), v)
    second = EarlyStoppingCallback(EarlyStoppingConfig(patience=3))
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as in the checkpoint file
    assert [evaluate(second, control, 10 * (i + 4), v) for i, v in enumerate(values[3:5])] == [False, True]


def test_missing_metric_fails_at_the_first_evaluation_listing_the_names():
    cb = EarlyStoppingCallback(EarlyStoppingConfig(monitor='eval_accuracy'))
    with pytest.raises(ConfigError) as e:
        evaluate(cb, TrainerControl(), 5, 1.0, eval_token_acc=0.5)
    assert 'eval_accuracy' in str(e.value) and 'eval_loss, eval_token_acc' in str(e.value)
    assert str(e.value).startswith('dynamic_callbacks.early_stopping.monitor:')


def test_eval_monitor_without_evaluation_fails_at_train_begin():
    cb = EarlyStoppingCallback(EarlyStoppingConfig(monitor='eval_loss'))
    with pytest.raises(ConfigError, match="'eval_loss' is an evaluation metric but this run never evaluates"):
        cb.on_train_begin(TrainingArguments(output_dir='unused', report_to=[], eval_strategy='no'), TrainerState(),
                          TrainerControl())
    cb.on_train_begin(TrainingArguments(output_dir='unused', report_to=[], eval_strategy='steps', eval_steps=5),
                      TrainerState(), TrainerControl())
    EarlyStoppingCallback(EarlyStoppingConfig(monitor='loss')).on_train_begin(
        TrainingArguments(output_dir='unused', report_to=[], eval_strategy='no'), TrainerState(), TrainerControl())


def test_train_metric_is_read_from_training_log_lines_only():
    cb = EarlyStoppingCallback(EarlyStoppingConfig(monitor='loss', patience=1, divergence=10.0))
    control = TrainerControl()
    state = TrainerState(global_step=3)
    cb.on_log(ARGS, state, control, logs={'eval_loss': 99.0, 'epoch': 1.0})  # an evaluation line: ignored
    cb.on_log(ARGS, state, control, logs={'train_runtime': 1.0, 'train_loss': 99.0})  # the summary: ignored
    cb.on_log(ARGS, state, control, logs={'loss': 2.0, 'learning_rate': 1e-3})
    assert not control.should_training_stop and cb.checks == 1
    cb.on_log(ARGS, TrainerState(global_step=4), control, logs={'loss': 11.0})
    assert control.should_training_stop and control.should_save and cb.reason is StopReason.DIVERGENCE
    with pytest.raises(ConfigError, match='names seen: grad_norm, learning_rate'):
        EarlyStoppingCallback(EarlyStoppingConfig(monitor='loss')).on_log(
            ARGS, state, TrainerControl(), logs={'grad_norm': 1.0, 'learning_rate': 1e-3, 'x': 'str'})


def log_line(cb, control, step, loss, nonfinite=0):
    """One training log line as the integration hands it over: ``nonfinite`` steps had a NaN loss that HF's
    ``logging_nan_inf_filter`` logged as the finite ``loss``."""
    control.dynamic_loss_nonfinite = nonfinite
    control.should_training_stop = control.should_save = False
    cb.on_log(ARGS, TrainerState(global_step=step), control, logs={'loss': loss, 'dynamic/nonfinite_steps': nonfinite})
    return control.should_training_stop


def test_measured_nan_step_logged_as_zero_stops_as_non_finite_not_threshold():
    """Measured: a NaN step logged as loss 0.0 stopped with reason threshold ("loss=0 reached threshold 1.0")."""
    cb = EarlyStoppingCallback(EarlyStoppingConfig(monitor='loss', patience=5, threshold=1.0, divergence=50.0))
    control = TrainerControl()
    assert not log_line(cb, control, 1, 3.0)
    assert log_line(cb, control, 2, 0.0, nonfinite=1)
    assert cb.reason is StopReason.NON_FINITE and cb.best == 3.0  # never an improvement
    cb.on_train_end(ARGS, TrainerState(global_step=2), control)
    [record] = protocol.drain_decisions(control)
    assert record.reason == 'non_finite' and math.isnan(record.values['value'])
    assert record.values['logged'] == 0.0 and record.values['nonfinite_steps'] == 1
    assert "logged as 0.0 by HF's logging_nan_inf_filter" in record.message


def test_non_finite_without_stopping_counts_as_no_improvement():
    cb = EarlyStoppingCallback(EarlyStoppingConfig(monitor='loss', patience=2, threshold=1.0,
                                                   stop_on_non_finite=False))
    control = TrainerControl()
    assert not log_line(cb, control, 1, 3.0)
    assert not log_line(cb, control, 2, 0.0, nonfinite=1)  # not the threshold, not a new best
    assert (cb.best, cb.wait) == (3.0, 1)
    assert log_line(cb, control, 3, float('inf'))
    assert cb.reason is StopReason.PATIENCE and cb.best == 3.0


@given(values=st.lists(finite, min_size=1, max_size=20), bad=st.sampled_from([math.nan, math.inf, -math.inf]),
       at=st.integers(0, 19), mode=st.sampled_from(['min', 'max']), patience=st.integers(1, 5))
def test_a_non_finite_value_is_never_an_improvement(values, bad, at, mode, patience):
    values = values[:at] + [bad] + values[at:]
    best, wait = None, 0
    for value in values:
        d = stop_decision(value, best, wait, mode=mode, patience=patience, stop_on_non_finite=False)
        if not math.isfinite(value):
            assert not d.improved and d.best == best and d.wait == wait + 1
            assert d.reason in (None, StopReason.PATIENCE)
        best, wait = d.best, d.wait
        if d.stop:
            break
    assert best is None or math.isfinite(best)


def test_a_stopped_run_that_is_resumed_stops_again_with_a_record():
    cb = EarlyStoppingCallback(EarlyStoppingConfig(patience=1))
    cb.load_state_dict({'best': 1.0, 'wait': 1, 'checks': 2, 'stopped': True, 'reason': 'patience', 'stop_step': 20})
    control = TrainerControl()
    cb.on_train_begin(ARGS, TrainerState(global_step=20), control)
    assert control.should_training_stop
    [record] = protocol.drain_decisions(control)
    assert (record.kind, record.reason, record.values['stopped_at']) == ('stop', 'already_stopped', 20)
    control.should_training_stop, control.should_save = False, True
    cb.on_step_end(ARGS, TrainerState(global_step=21), control)
    assert control.should_training_stop and not control.should_save  # the step HF runs anyway is not saved
    assert not evaluate(cb, control, 21, float('nan'))  # no second decision


def test_resume_stopped_continue_starts_patience_over_and_says_so():
    cb = EarlyStoppingCallback(EarlyStoppingConfig(patience=1, resume_stopped='continue'))
    cb.load_state_dict({'best': 1.0, 'wait': 1, 'stopped': True, 'reason': 'patience', 'stop_step': 20})
    control = TrainerControl()
    cb.on_train_begin(ARGS, TrainerState(global_step=20), control)
    assert not control.should_training_stop and not cb.stopped and cb.wait == 0 and cb.best == 1.0
    [record] = protocol.drain_decisions(control)
    assert record.reason == 'continue_after_stop'


def test_ranks_agree_through_the_distributed_helper(monkeypatch):
    from swift_dynamic_callbacks import distributed
    calls = []

    def agree(value, merge):  # rank 1 wants to stop for divergence
        calls.append(value)
        return merge([value, (True, 'divergence', 50.0, 1)])

    monkeypatch.setattr(distributed, 'agree', agree)
    cb = EarlyStoppingCallback(EarlyStoppingConfig(patience=5))
    control = TrainerControl()
    assert evaluate(cb, control, 2, 1.0)
    assert calls == [(False, None, 1.0, 0)] and cb.reason is StopReason.DIVERGENCE
    cb.on_train_end(None, TrainerState(global_step=2), control)
    record = control.dynamic_decisions[-1]
    assert (record.values['value'], record.values['rank']) == (50.0, 1)  # the stopping rank's value, not ours


# ---- real swift sft runs ----------------------------------------------------------------------------------

RUN = dict(callbacks=['early_stopping'], split_dataset_ratio=0.125, eval_steps=2, save_steps=3, max_steps=20,
           per_device_eval_batch_size=2, lr_scheduler_type='constant', warmup_ratio=0.0)
PLATEAU = {'monitor': 'eval_loss', 'min_delta': 1.0e6, 'patience': 3}  # after the first evaluation: no improvement


def _dirs(out):
    return sorted((n for n in os.listdir(out) if n.startswith('checkpoint-')), key=lambda n: int(n.split('-')[1]))


def _summary(out):
    return read_jsonl(os.path.join(out, 'logging.jsonl'))[-1]


@pytest.mark.e2e
def test_plateau_stop_keeps_patience_across_resume_and_a_stopped_run_stays_stopped(tmp_path, tiny_llama, gsm8k_16):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(early_stopping=PLATEAU)
        out = str(tmp_path / 'run')
        run_sft(tiny_llama, 'llama', gsm8k_16, out, **{**RUN, 'max_steps': 4})
        saved = read_state(os.path.join(out, 'checkpoint-4'))['components']['early_stopping']
        assert (saved['wait'], saved['checks'], saved['stopped']) == (1, 2, False)  # evaluations at 2 (best) and 4
        # resumed: evaluations 6 (wait 2) and 8 (wait 3 = patience) -> stop after step 8; patience starting over
        # would stop at 10. The soft stop saves checkpoint-8 (save_steps 3 would not).
        run_sft(tiny_llama, 'llama', gsm8k_16, out, fresh=False,
                resume_from_checkpoint=os.path.join(out, 'checkpoint-4'), **RUN)
        assert _summary(out)['global_step'] == 8
        assert _dirs(out) == ['checkpoint-3', 'checkpoint-4', 'checkpoint-6', 'checkpoint-8']
        [stop] = [d for d in decisions(out) if d['source'] == 'early_stopping']
        assert (stop['kind'], stop['reason'], stop['step']) == ('stop', 'patience', 8)
        assert stop['values']['checkpoint'] == 'checkpoint-8' and stop['values']['wait'] == 3
        assert read_state(os.path.join(out, 'checkpoint-8'))['components']['early_stopping']['stopped'] is True
        left = {row['global_step/max_steps']: row.get('dynamic/early_stopping_patience_left')
                for row in train_logs(out)}
        assert [left[f'{s}/20'] for s in (5, 6, 7, 8)] == [2.0, 2.0, 1.0, 1.0]  # restored on resume, in every line
        # resuming the stopped run does not train on silently: it stops at once, with a record saying so
        run_sft(tiny_llama, 'llama', gsm8k_16, out, fresh=False,
                resume_from_checkpoint=os.path.join(out, 'checkpoint-8'), **RUN)
        assert _summary(out)['global_step'] == 8  # the integration draws no micro-batches once a stop is set
        assert _dirs(out)[-1] == 'checkpoint-8'
        again = [d for d in decisions(out) if d['source'] == 'early_stopping'][1:]
        assert [(d['reason'], d['values']['stopped_at'], d['values']['original_reason']) for d in again] == \
            [('already_stopped', 8, 'patience')]
    finally:
        plugin.unregister()

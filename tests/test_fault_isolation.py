"""Fault isolation: an unexpected exception in a pack callback's hook disables that callback, training goes on.

Hooks with fakes (a raising hook, a failing memory probe, fatal errors, fail_fast), the decision log on an
unwritable path, and real ``swift sft`` runs with a callback whose hook raises (finishes; with ``fail_fast`` stops).
"""

from __future__ import annotations

import os

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.callbacks import MemoryBackoffCallback, MemoryBackoffConfig, TrainingLogCallback
from swift_dynamic_callbacks.callbacks.base import DynamicCallback
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.records import DecisionLog, DecisionRecord
from swift_dynamic_callbacks.state import StateError
from swift_runs import decisions, run_sft, train_logs


def _args():
    return TrainingArguments(output_dir='unused', report_to=[])


class Flaky(DynamicCallback):
    name = 'flaky'

    def __init__(self, error: BaseException) -> None:
        super().__init__(None)
        self.error = error
        self.calls = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.calls += 1
        raise self.error


def test_raising_hook_is_recorded_once_and_disables_the_callback():
    cb, control = Flaky(RuntimeError('probe exploded')), TrainerControl()
    assert cb.on_step_end(_args(), TrainerState(global_step=3), control) is None  # no exception
    records = protocol.drain_decisions(control)
    assert len(records) == 1
    record = records[0]
    assert (record.source, record.kind, record.reason, record.step) == ('flaky', 'fault', 'RuntimeError', 3)
    assert record.values['hook'] == 'on_step_end' and record.values['callback'] == 'flaky'
    assert 'probe exploded' in record.values['traceback'] and 'Traceback' in record.values['traceback']
    assert cb.fault is record
    for step in (4, 5):  # disabled for the rest of the run: the hook body does not run again, no more records
        cb.on_step_end(_args(), TrainerState(global_step=step), control)
    assert cb.calls == 1 and protocol.drain_decisions(control) == []


def test_several_processes_reraise(monkeypatch):
    """Under data parallelism a fault on one rank would disable the callback there only and leave the other ranks
    in its collectives: it stops the run instead."""
    from swift_dynamic_callbacks import distributed
    monkeypatch.setattr(distributed, 'world_size', lambda: 2)
    cb = Flaky(RuntimeError('probe exploded'))
    with pytest.raises(RuntimeError, match='probe exploded'):
        cb.on_step_end(_args(), TrainerState(global_step=1), TrainerControl())
    assert cb.fault is None


@pytest.mark.parametrize('error', [ConfigError('bad setting'), StateError('corrupt state')])
def test_configuration_and_integrity_errors_still_stop_the_run(error):
    cb = Flaky(error)
    with pytest.raises(type(error)):
        cb.on_step_end(_args(), TrainerState(global_step=1), TrainerControl())
    assert cb.fault is None


def test_sample_too_large_still_stops_the_run():
    from swift_dynamic_callbacks.integrations.passes import SampleTooLargeError
    with pytest.raises(SampleTooLargeError):
        Flaky(SampleTooLargeError('one sample does not fit')).on_step_end(_args(), TrainerState(), TrainerControl())


def test_fail_fast_reraises():
    control = TrainerControl()
    setattr(control, protocol.FAIL_FAST, True)
    cb = Flaky(RuntimeError('boom'))
    with pytest.raises(RuntimeError, match='boom'):
        cb.on_step_end(_args(), TrainerState(global_step=1), control)
    assert cb.fault is None and protocol.drain_decisions(control) == []


def test_disabled_pack_skips_every_hook():
    control = TrainerControl()
    setattr(control, protocol.DISABLED, True)
    cb = Flaky(RuntimeError('never raised'))
    cb.on_step_end(_args(), TrainerState(global_step=1), control)
    assert cb.calls == 0 and cb.fault is None


class FailingProbe:
    name = 'cuda'
    budget = 1

    def read(self):
        raise RuntimeError('NVML: driver not loaded')

    def reset_peak(self):
        pass


def test_failing_memory_probe_disables_memory_backoff_only():
    cb = MemoryBackoffCallback(MemoryBackoffConfig(), probe=FailingProbe())
    control = TrainerControl()
    cb.on_train_begin(_args(), TrainerState(), control)
    cb.on_step_begin(_args(), TrainerState(global_step=0), control)
    cb.on_step_end(_args(), TrainerState(global_step=1), control)
    [record] = [r for r in protocol.drain_decisions(control) if r.kind == 'fault']
    assert record.source == 'memory_backoff' and 'NVML' in record.values['error']
    cb.on_step_end(_args(), TrainerState(global_step=2), control)  # disabled: the probe is not read again
    assert protocol.drain_decisions(control) == []


def test_nested_subclass_hooks_are_wrapped_once_and_super_calls_work():
    seen = []

    class Base(DynamicCallback):
        name = 'base_cb'

        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append('base')

    class Child(Base):
        name = 'child_cb'

        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append('child')
            return super().on_log(args, state, control, logs=logs, **kwargs)

    Child().on_log(_args(), TrainerState(), TrainerControl(), logs={'loss': 1.0})
    assert seen == ['child', 'base']
    assert Child.on_log.__wrapped__.__name__ == 'on_log'


def test_decision_log_on_an_unwritable_path_warns_once_and_keeps_going(tmp_path, caplog):
    blocker = tmp_path / 'not-a-directory'
    blocker.write_text('a file where the log directory should be')
    log = DecisionLog(blocker / 'out' / 'dynamic_decisions.jsonl')
    with caplog.at_level('WARNING', logger='swift_dynamic_callbacks'):
        for step in range(3):
            log.write(DecisionRecord('batch_growth', 'batch_size', 'interval', {'new': step}, step=step))
    assert len(log.records) == 3  # kept in memory
    assert log.write_error is not None and not log.enabled
    warnings = [r for r in caplog.records if 'cannot write the decision log' in r.getMessage()]
    assert len(warnings) == 1


class ExplodingTrainingLog(TrainingLogCallback):
    """``training_log`` whose ``on_log`` fails from step 3 on (e.g. a full disk)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step >= 3:
            raise OSError(28, 'No space left on device')
        return super().on_log(args, state, control, logs=logs, **kwargs)


@pytest.mark.e2e
def test_real_run_survives_a_raising_hook_and_fail_fast_stops_it(tmp_path, tiny_llama, gsm8k_16, monkeypatch):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    monkeypatch.setitem(plugin.CALLBACKS, 'training_log', ExplodingTrainingLog)
    try:
        sdc.register(training_log={}, batch_growth={'initial': 1, 'interval': 2, 'maximum': 2})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'tolerant'),
                      callbacks=['batch_growth', 'training_log'], max_steps=6)
        assert len(train_logs(out)) == 6  # the run finished
        faults = [d for d in decisions(out) if d['kind'] == 'fault']
        assert len(faults) == 1
        assert faults[0]['source'] == 'training_log' and faults[0]['values']['hook'] == 'on_log'
        assert 'No space left on device' in faults[0]['values']['traceback']
        assert [row['dynamic/batch_size'] for row in train_logs(out)] == [1, 1, 2, 2, 2, 2]  # the others go on

        sdc.register(training_log={}, integration={'fail_fast': True})
        with pytest.raises(OSError, match='No space left'):
            run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'strict'), callbacks=['training_log'], max_steps=6)
        assert len(train_logs(str(tmp_path / 'strict'))) < 6
        assert not os.path.exists(os.path.join(tmp_path, 'strict', 'checkpoint-6'))
    finally:
        plugin.unregister()

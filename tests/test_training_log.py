"""The training_log callback: config errors, hooks with fake trainer objects, resume state, and a real swift sft
run with batch growth whose output directory then feeds the report."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.callbacks.training_log import (LOG_FILE, TrainingLogCallback, TrainingLogConfig,
                                                            memory_figures)
from swift_dynamic_callbacks.config import ConfigError
from swift_runs import decisions, read_jsonl, run_sft, train_logs


@pytest.mark.parametrize('settings,field', [
    ({'every': 0}, 'every'),
    ({'every': 1.5}, 'every'),
    ({'memory': 'yes'}, 'memory'),
    ({'file': ''}, 'file'),
    ({'file': 'logs/'}, 'file'),
])
def test_bad_config_names_the_field(settings, field):
    with pytest.raises(ConfigError) as e:
        TrainingLogConfig(**settings)
    assert str(e.value).startswith(f'{field}:'), str(e.value)


def test_yaml_settings_are_checked():
    assert TrainingLogCallback.config_from_mapping({'every': 5}).every == 5
    with pytest.raises(ConfigError, match='dynamic_callbacks.training_log: unknown setting'):
        TrainingLogCallback.config_from_mapping({'frequency': 5})


def test_cpu_memory_figures():
    figures = memory_figures()
    assert set(figures) == {'dynamic/memory_rss_gib', 'dynamic/memory_peak_gib'}
    assert 0 < figures['dynamic/memory_rss_gib'] <= figures['dynamic/memory_peak_gib'] * 1.01


def test_cuda_memory_figures(monkeypatch):
    """No GPU here: torch.cuda's counters faked, to check the keys and units of the CUDA branch."""
    import torch
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'is_initialized', lambda: True)
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda device=None: 3 * gib)
    monkeypatch.setattr(torch.cuda, 'max_memory_reserved', lambda device=None: 4 * gib)
    monkeypatch.setattr(torch.cuda, 'memory_allocated', lambda device=None: gib // 2)
    assert memory_figures() == {'dynamic/memory_peak_gib': 3.0, 'dynamic/memory_reserved_gib': 4.0,
                                'dynamic/memory_allocated_gib': 0.5}


def _objects(tmp_path, **state):
    from transformers import TrainerControl, TrainerState, TrainingArguments
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                             report_to=[])
    return args, TrainerState(**state), TrainerControl()


def _step(cb, args, state, control, loss, samples=None, **kwargs):
    state.global_step += 1
    state.epoch = state.global_step / 4
    cb.on_step_end(args, state, control)
    logs = {'loss': loss, 'grad_norm': 0.5, 'learning_rate': 1e-3, 'dynamic/batch_size': 2}
    if samples is not None:
        logs['dynamic/samples_seen'] = samples
    logs.update(protocol.current_metrics(control))  # what the integration merges into the log line
    cb.on_log(args, state, control, logs=logs, **kwargs)


def test_step_lines_every_n_events_and_an_epoch_summary(tmp_path):
    cb = TrainingLogCallback(TrainingLogConfig(every=2))
    args, state, control = _objects(tmp_path)
    cb.on_train_begin(args, state, control)
    for loss, samples in [(4.0, 2), (3.0, 4), (2.0, 8), (1.0, 12)]:
        _step(cb, args, state, control, loss, samples)
        assert 'dynamic/memory_peak_gib' in control.dynamic_metrics  # published after every step
    cb.on_log(args, state, control, logs={'eval_loss': 9.0})  # not a training event
    cb.on_epoch_end(args, state, control)
    lines = read_jsonl(str(tmp_path / LOG_FILE))
    assert [line['type'] for line in lines] == ['step', 'step', 'epoch']
    first, second, epoch = lines
    assert (first['step'], first['loss'], first['samples_seen']) == (2, 3.0, 4)
    assert (second['step'], second['loss'], second['grad_norm'], second['samples_seen']) == (4, 1.0, 0.5, 12)
    assert second['dynamic'] == {'dynamic/batch_size': 2, 'dynamic/samples_seen': 12}  # memory kept apart
    assert set(second['memory']) == {'dynamic/memory_rss_gib', 'dynamic/memory_peak_gib'}
    assert second['samples_per_s'] is None or second['samples_per_s'] > 0
    assert second['tokens_per_s'] is None  # HF counts no tokens unless asked to
    assert epoch['epoch_index'] == 0 and epoch['epoch'] == 1.0
    assert (epoch['steps'], epoch['samples'], epoch['mean_loss'], epoch['logged_losses']) == (4, 12, 2.5, 4)
    assert set(lines[0]) == set(lines[1])  # a stable schema: every key in every step line


def test_tokens_come_from_the_pack_when_it_logs_them(tmp_path):
    cb = TrainingLogCallback(TrainingLogConfig(every=1))
    args, state, control = _objects(tmp_path)
    control._sdc_integration = True  # the integration's callback runs first and marks control
    cb.on_train_begin(args, state, control)
    for tokens in (100, 300):
        state.global_step += 1
        cb.on_log(args, state, control, logs={'loss': 1.0, 'dynamic/tokens_seen': tokens, 'dynamic/tokens_per_s': 50.0})
    first, second = read_jsonl(str(tmp_path / LOG_FILE))
    assert (first['tokens_seen'], first['tokens_per_s']) == (100, 50.0)  # the integration's own first rate
    assert second['tokens_seen'] == 300 and second['tokens_per_s'] > 0  # 200 tokens over the time between lines


def test_samples_without_logged_values(tmp_path):
    cb = TrainingLogCallback()
    args, state, control = _objects(tmp_path, global_step=3)
    assert cb.samples_seen(args, state) == 6  # plain HF run: steps x batch x accumulation x world
    assert cb.samples_seen(args, state, SimpleNamespace(samples_seen=5)) == 5  # the integration's loader
    cb.on_train_begin(args, state, control)
    _step(cb, args, state, control, 1.0, train_dataloader=SimpleNamespace(samples_seen=9))
    assert read_jsonl(str(tmp_path / LOG_FILE))[0]['samples_seen'] == 9


def test_only_rank_zero_writes_and_memory_can_be_off(tmp_path):
    cb = TrainingLogCallback()
    args, state, control = _objects(tmp_path, is_world_process_zero=False)
    cb.on_train_begin(args, state, control)
    _step(cb, args, state, control, 1.0, 2)
    cb.on_epoch_end(args, state, control)
    assert not os.path.exists(tmp_path / LOG_FILE) and cb.events == 1
    quiet = TrainingLogCallback(TrainingLogConfig(memory=False, file='sub/log.jsonl'))
    args, state, control = _objects(tmp_path)
    quiet.on_train_begin(args, state, control)
    _step(quiet, args, state, control, 1.0, 2)
    assert protocol.current_metrics(control) == {}
    assert read_jsonl(str(tmp_path / 'sub' / 'log.jsonl'))[0]['memory'] == {}


def test_state_round_trip_continues_the_epoch(tmp_path):
    cb = TrainingLogCallback(TrainingLogConfig(every=3))
    args, state, control = _objects(tmp_path)
    cb.on_train_begin(args, state, control)
    for loss, samples in [(4.0, 2), (2.0, 4)]:
        _step(cb, args, state, control, loss, samples)
    saved = json.loads(json.dumps(cb.state_dict()))  # it goes through the JSON state file
    resumed = TrainingLogCallback(cb.config)
    resumed.load_state_dict(saved)
    resumed.on_train_begin(args, state, control)
    for loss, samples in [(3.0, 6), (1.0, 8)]:
        _step(resumed, args, state, control, loss, samples)
    resumed.on_epoch_end(args, state, control)
    lines = read_jsonl(str(tmp_path / LOG_FILE))
    assert [(line['type'], line['step']) for line in lines] == [('step', 3), ('epoch', 4)]  # every=3 counted on
    assert (lines[1]['steps'], lines[1]['samples'], lines[1]['mean_loss']) == (4, 8, 2.5)


@pytest.mark.e2e
def test_growth_run_with_training_log_feeds_the_report(tmp_path, tiny_llama, gsm8k_16):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.report import REPORT_MD, REPORT_PNG, load_run, panels, write_report
    try:
        sdc.register(batch_growth={'initial': 1, 'factor': 2, 'interval': 2, 'maximum': 4, 'lr_scaling': 'none'},
                     training_log={'every': 2})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'), callbacks=['batch_growth', 'training_log'],
                      max_steps=-1, num_train_epochs=1, lr_scheduler_type='constant', warmup_ratio=0.0)
    finally:
        plugin.unregister()
    logs = train_logs(out)
    assert [row['dynamic/batch_size'] for row in logs] == [1, 1, 2, 2, 4, 4, 4]  # 16 samples in 7 steps
    assert all(row['dynamic/memory_peak_gib'] > 0 for row in logs)  # published into ms-swift's log lines
    lines = read_jsonl(os.path.join(out, LOG_FILE))
    steps = [line for line in lines if line['type'] == 'step']
    epochs = [line for line in lines if line['type'] == 'epoch']
    assert [line['step'] for line in steps] == [2, 4, 6]  # every 2nd of 7 log events
    assert [line['dynamic']['dynamic/batch_size'] for line in steps] == [1, 2, 4]
    assert [line['loss'] for line in steps] == pytest.approx([logs[i]['loss'] for i in (1, 3, 5)], rel=1e-7)
    assert [line['samples_seen'] for line in steps] == [2, 6, 14]
    # tokens: counted by the pack (no include_num_input_tokens_seen in this run), every line, rising
    assert all(row['dynamic/tokens_seen'] > 0 and row['dynamic/tokens_per_s'] > 0 for row in logs)
    assert all(row['dynamic/padded_tokens_seen'] >= row['dynamic/tokens_seen'] for row in logs)
    assert logs[-1]['dynamic/padded_tokens_seen'] > logs[-1]['dynamic/tokens_seen']  # batches of 2 and 4 pad
    assert [line['tokens_seen'] for line in steps] == [logs[i]['dynamic/tokens_seen'] for i in (1, 3, 5)]
    assert steps[0]['tokens_seen'] < steps[1]['tokens_seen'] < steps[2]['tokens_seen']
    assert all(line['tokens_per_s'] > 0 for line in steps)
    assert len(epochs) == 1 and (epochs[0]['steps'], epochs[0]['samples'], epochs[0]['logged_losses']) == (7, 16, 7)
    assert epochs[0]['mean_loss'] == pytest.approx(sum(row['loss'] for row in logs) / 7, rel=1e-7)
    assert epochs[0]['memory']['dynamic/memory_peak_gib'] > 0
    png, md = write_report(out)
    assert os.path.basename(png) == REPORT_PNG and os.path.basename(md) == REPORT_MD
    with open(png, 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'
    assert os.path.getsize(png) > 10_000
    assert [title for title, _ in panels(load_run(out).rows)] == ['batch size', 'learning rate', 'loss', 'memory (GiB)']
    table = open(md, encoding='utf-8').read().split('## Decisions', 1)[1]
    growths = [d for d in decisions(out) if d['source'] == 'batch_growth']
    assert [d['values']['new'] for d in growths] == [1, 2, 4]
    for d in growths:
        assert f'| {d["step"]} | batch_growth | batch_size | {d["reason"]} |' in table
    assert table.count('| batch_growth |') == len(growths)

"""Reproducibility: the switch that turns the pack off (a plain baseline run) and replay of a decision log."""

from __future__ import annotations

import json
import os

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.integrations.requests import load_replay, request_from_json, request_to_json
from swift_dynamic_callbacks.config.integration import IntegrationConfig
from swift_dynamic_callbacks.integrations.hooks import DISABLE_ENV, PackOffCallback, install, pack_disabled
from swift_dynamic_callbacks.state import StateError
from swift_runs import decisions, run_sft, train_logs

LR_RUN = dict(lr_scheduler_type='cosine', warmup_ratio=0.0, learning_rate=1e-3, max_steps=10,
              gradient_accumulation_steps=1)
# min_delta 100: every change is "no improvement", so the plateau restart comes at step 6 (forced)
LR_SETTINGS = {'warmup': 2, 'hold': 2, 'min_ratio': 0.1, 'min_delta': 100.0, 'patience': 2, 'cooldown': 2,
               'smooth': 1, 'max_restarts': 1, 'restart_factor': 0.5}
GROWTH = {'initial': 1, 'factor': 2, 'interval': 3, 'maximum': 4, 'lr_scaling': 'linear'}


# ---- the off switch ------------------------------------------------------------------------------------
def test_pack_disabled_by_setting_or_environment(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert pack_disabled(IntegrationConfig()) is None
    assert 'enabled: false' in pack_disabled(IntegrationConfig(enabled=False))
    monkeypatch.setenv(DISABLE_ENV, '1')
    assert pack_disabled(IntegrationConfig()) == f'{DISABLE_ENV}=1'
    monkeypatch.setenv(DISABLE_ENV, '0')
    assert pack_disabled(IntegrationConfig()) is None
    with pytest.raises(ConfigError, match='enabled'):
        IntegrationConfig.from_mapping({'enabled': 'no'})


def test_install_when_off_leaves_the_trainer_alone(tmp_path):

    class Handler:
        callbacks: list = []

    class FakeTrainer:
        callback_handler = Handler()

    trainer = FakeTrainer()
    assert install(trainer, IntegrationConfig(enabled=False)) is None
    assert type(trainer) is FakeTrainer and not hasattr(trainer, 'dynamic_integration')
    [off] = trainer.callback_handler.callbacks
    assert isinstance(off, PackOffCallback)
    control = TrainerControl()
    off.on_train_begin(TrainingArguments(output_dir=str(tmp_path), report_to=[]), TrainerState(), control)
    assert getattr(control, protocol.DISABLED) is True
    [record] = [json.loads(line) for line in open(tmp_path / 'dynamic_decisions.jsonl')]
    assert (record['kind'], record['reason']) == ('pack', 'disabled') and 'OFF' in record['message']


@pytest.mark.e2e
def test_off_switch_gives_plain_ms_swift_losses(tmp_path, tiny_llama, gsm8k_16):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    run = dict(max_steps=5, lr_scheduler_type='cosine', warmup_ratio=0.0)
    try:
        plain = train_logs(run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'plain'), **run))
        sdc.register(batch_growth={'initial': 1, 'interval': 2, 'maximum': 4}, lr_schedule=LR_SETTINGS,
                     integration={'enabled': False})
        off = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'off'), callbacks=['batch_growth', 'lr_schedule'],
                      **run)
        logs = train_logs(off)
        assert [r['loss'] for r in logs] == [r['loss'] for r in plain]
        assert [r['learning_rate'] for r in logs] == [r['learning_rate'] for r in plain]
        assert not any(k.startswith('dynamic/') for r in logs for k in r)
        [record] = decisions(off)
        assert (record['kind'], record['reason']) == ('pack', 'disabled')
        assert record['values']['callbacks'] == ['batch_growth', 'lr_schedule']

        plugin.unregister()  # the environment switch, with the pack otherwise on
        sdc.register(batch_growth={'initial': 1, 'interval': 2, 'maximum': 4})
        # not monkeypatch.setenv: datasets' map replaces os.environ by a copy, so monkeypatch's undo would miss it
        os.environ[DISABLE_ENV] = '1'
        env_off = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'env'), callbacks=['batch_growth'], **run)
        del os.environ[DISABLE_ENV]
        assert [r['loss'] for r in train_logs(env_off)] == [r['loss'] for r in plain]
        assert decisions(env_off)[0]['values']['switch'] == f'{DISABLE_ENV}=1'
    finally:
        os.environ.pop(DISABLE_ENV, None)
        plugin.unregister()


# ---- replay ---------------------------------------------------------------------------------------------
def test_request_json_round_trip():
    request = protocol.BatchRequest(batch_size=4, num_pieces=2, lr_scale=2.0,
                                    lr_schedule=protocol.check_lr_schedule({'warmup': 2, 'hold': 0, 'min_ratio': 0.1,
                                                                            'restarts': [[6, 0.5, 0]]}),
                                    pass_limit=protocol.check_pass_limit({'samples': 2}))
    values = json.loads(json.dumps(request_to_json(request)))
    assert 'batch_plan' not in values and 'via_dataloader' not in values  # compact
    assert request_from_json(values) == request
    with pytest.raises(ValueError, match='batch_size'):
        request_from_json({'batch_size': 0})
    with pytest.raises(ValueError, match='unknown request field'):
        request_from_json({'batch_sizes': 2})


def test_load_replay_takes_the_last_record_of_a_step(tmp_path):
    rows = [{'kind': 'applied_request', 'step': 0, 'values': {'batch_size': 1}},
            {'kind': 'batch_size', 'step': 4, 'values': {'new': 2}},
            {'kind': 'applied_request', 'step': 4, 'values': {'batch_size': 2}},
            {'kind': 'applied_request', 'step': 4, 'values': {'batch_size': 3}}]  # a resumed run appended
    (tmp_path / 'dynamic_decisions.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    replay = load_replay(str(tmp_path))  # a directory or the file
    assert {k: v.batch_size for k, v in replay.items()} == {0: 1, 4: 3}
    with pytest.raises(ConfigError, match='no such file'):
        load_replay(str(tmp_path / 'missing.jsonl'))
    (tmp_path / 'bad.jsonl').write_text(json.dumps({'kind': 'applied_request', 'step': 1,
                                                    'values': {'lr_scale': -1}}) + '\n')
    with pytest.raises(StateError, match='step 1'):
        load_replay(str(tmp_path / 'bad.jsonl'))


def _columns(logs, *keys):
    return {key: [row[key] for row in logs] for key in keys}


@pytest.mark.e2e
def test_replay_reproduces_growth_and_restart_and_resumes(tmp_path, tiny_llama, gsm8k_16):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    keys = ('loss', 'learning_rate', 'dynamic/batch_size')
    try:
        sdc.register(lr_schedule=LR_SETTINGS, batch_growth=GROWTH)
        original = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'original'),
                           callbacks=['batch_growth', 'lr_schedule'], **LR_RUN)
        recorded = decisions(original)
        assert [d['step'] for d in recorded if d['kind'] == 'lr_restart'] == [6]
        applied = [d for d in recorded if d['kind'] == 'applied_request']
        assert [d['step'] for d in applied] == [0, 3, 6]
        assert [d['values'].get('batch_size') for d in applied] == [1, 2, 4]
        assert applied[2]['values']['lr_schedule']['restarts'] == [[6, 0.5, 0]]  # growth and restart, one boundary
        expected = _columns(train_logs(original), *keys)
        assert expected['dynamic/batch_size'] == [1] * 3 + [2] * 3 + [4] * 4

        # the callbacks would decide differently now (faster growth, no restart): replay ignores them
        plugin.unregister()
        log_file = os.path.join(original, 'dynamic_decisions.jsonl')
        no_restarts = {k: v for k, v in LR_SETTINGS.items() if k != 'restart_factor'}  # not read: it would be refused
        sdc.register(lr_schedule={**no_restarts, 'max_restarts': 0, 'warmup': 0},
                     batch_growth={**GROWTH, 'interval': 1}, integration={'replay': log_file})
        replayed = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'replay'),
                           callbacks=['batch_growth', 'lr_schedule'], save_steps=5, **LR_RUN)
        assert _columns(train_logs(replayed), *keys) == expected
        replay_decisions = [d for d in decisions(replayed) if d['kind'] != 'engine']  # the engine record comes first
        assert replay_decisions[0]['kind'] == 'replay' and replay_decisions[0]['values']['requests'] == 3
        assert [(d['step'], d['values']) for d in replay_decisions if d['kind'] == 'applied_request'] == [
            (d['step'], d['values']) for d in applied]
        assert all(d['reason'] == 'replay' for d in replay_decisions if d['kind'] == 'applied_request')
        # the callbacks' own requests (and their records) are dropped; the integration's control_flags records say
        # what changed
        assert not [d for d in replay_decisions if d['kind'] in ('batch_size', 'lr_schedule', 'lr_restart')
                    and d['source'] in ('batch_growth', 'lr_schedule')]
        assert [d['values']['new'] for d in replay_decisions if d['kind'] == 'batch_size'] == [1, 2, 4]

        # resume the replay run: the same numbers from step 6 on
        resumed = run_sft(tiny_llama, 'llama', gsm8k_16, replayed, callbacks=['batch_growth', 'lr_schedule'],
                          save_steps=5, fresh=False, resume_from_checkpoint=os.path.join(replayed, 'checkpoint-5'),
                          **LR_RUN)
        tail = train_logs(resumed)[-5:]
        assert _columns(tail, *keys) == {k: v[5:] for k, v in expected.items()}
    finally:
        plugin.unregister()

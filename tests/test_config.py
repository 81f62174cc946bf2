"""Configuration validation (``dynamic_callbacks:`` section, ``swift-dynamic check``) and the checkpoint state file."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from swift_dynamic_callbacks import cli
from swift_dynamic_callbacks.callbacks import BatchScheduleCallback, BatchScheduleConfig
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.integrations.swift import PLUGIN_FILE, PackConfig, parse_section
from swift_dynamic_callbacks.state import (STATE_FILE, StateError, build_payload, read_state, restore_components,
                                           stateful_components, write_state)

GOOD = {'batch_schedule': {'schedule': {0: 2, 10: 4}}}


def config_error(section, listed=None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_section(section, listed)
    return str(info.value)


# ---- parse_section ---------------------------------------------------------------------------------------


def test_parse_good_section():
    pack = parse_section({'batch_schedule': {'schedule': {0: 2, '10': 4}, 'pieces': {5: 2}, 'via': 'dataloader'},
                          'integration': {'record_samples': True}}, ['batch_schedule'])
    assert isinstance(pack, PackConfig)
    assert pack.integration.record_samples is True
    assert pack.integration.log_values is True
    config = pack.callback_config('batch_schedule')
    assert isinstance(config, BatchScheduleConfig)
    assert config.schedule == {0: 2, 10: 4}  # digit-string keys (JSON) become ints
    assert list(config.schedule) == [0, 10]
    assert config.pieces == {5: 2}
    assert config.via == 'dataloader'
    assert pack.to_json()['integration'] == {'record_samples': True, 'log_values': True, 'max_steps_unit': 'steps',
                                             'oom_recovery': 'auto', 'oom_single_sample_retries': 2,
                                             'oom_grow_back_steps': 1, 'oom_probe_steps': 64, 'enabled': True,
                                             'fail_fast': False, 'replay': None, 'allow_config_change': False,
                                             'stream_window': 1024, 'packed_attention': 'auto',
                                             'grpo_pass_tokens': None}
    assert pack.to_json()['batch_schedule']['via'] == 'dataloader'


def test_parse_empty_section():
    pack = parse_section(None)
    assert pack.callbacks == {}
    assert pack.integration.record_samples is False
    assert parse_section({}, []).callbacks == {}


def test_unknown_callback_name():
    message = config_error({'batch_schedul': {'schedule': {0: 2}}})
    assert 'batch_schedul' in message
    assert 'known: batch_growth, batch_schedule' in message
    assert 'integration' in message


def test_unknown_batch_schedule_setting():
    message = config_error({'batch_schedule': {'schedule': {0: 2}, 'shedule': {1: 3}}})
    assert 'dynamic_callbacks.batch_schedule' in message
    assert 'shedule' in message
    assert 'allowed: pieces, schedule, via' in message


def test_schedule_value_zero():
    message = config_error({'batch_schedule': {'schedule': {0: 2, 5: 0}}})
    assert 'dynamic_callbacks.batch_schedule.schedule[5]' in message
    assert '>= 1' in message
    assert 'got 0' in message


def test_schedule_negative_key():
    message = config_error({'batch_schedule': {'schedule': {-1: 2}}})
    assert 'dynamic_callbacks.batch_schedule.schedule key -1' in message
    assert '>= 0' in message


@pytest.mark.parametrize('value', [{0: 2.5}, {0: True}, {'x': 2}, {1.5: 2}])
def test_schedule_bad_types(value):
    message = config_error({'batch_schedule': {'schedule': value}})
    assert 'dynamic_callbacks.batch_schedule.schedule' in message
    assert 'expected an integer' in message


@pytest.mark.parametrize('value', [[2, 4], 4, 'often'])
def test_schedule_not_a_mapping(value):
    message = config_error({'batch_schedule': {'schedule': value}})
    assert 'dynamic_callbacks.batch_schedule.schedule' in message
    assert 'expected a mapping {step: batch_size}' in message
    assert repr(value) in message


def test_pieces_value_zero():
    message = config_error({'batch_schedule': {'schedule': {0: 2}, 'pieces': {3: 0}}})
    assert 'dynamic_callbacks.batch_schedule.pieces[3]' in message


def test_empty_schedule():
    message = config_error({'batch_schedule': {}}, ['batch_schedule'])
    assert 'schedule' in message
    assert 'at least one' in message
    # a listed pack callback without any settings is just as empty
    assert 'at least one' in config_error(None, ['batch_schedule'])


def test_via_foo():
    message = config_error({'batch_schedule': {'schedule': {0: 2}, 'via': 'foo'}})
    assert 'dynamic_callbacks.batch_schedule.via' in message
    assert "'batch_size', 'dataloader'" in message
    assert "'foo'" in message


def test_settings_for_unlisted_callback():
    message = config_error(GOOD, ['some_other_callback'])
    assert 'dynamic_callbacks.batch_schedule' in message
    assert 'not listed in callbacks' in message
    assert 'some_other_callback' in message
    assert 'not listed' in config_error(GOOD, [])
    # listed: fine; non-pack names in callbacks: are ignored
    assert parse_section(GOOD, ['batch_schedule', 'some_other_callback']).callback_config(
        'batch_schedule').schedule == {0: 2, 10: 4}


def test_integration_record_samples_yes():
    message = config_error({'integration': {'record_samples': 'yes'}, **GOOD})
    assert 'dynamic_callbacks.integration.record_samples' in message
    assert 'true or false' in message
    assert "'yes'" in message


def test_integration_unknown_setting():
    message = config_error({'integration': {'record_sample': True}})
    assert 'dynamic_callbacks.integration' in message
    assert 'record_sample' in message
    assert ('allowed: allow_config_change, enabled, fail_fast, grpo_pass_tokens, log_values, max_steps_unit, '
            'oom_grow_back_steps, oom_probe_steps, oom_recovery, oom_single_sample_retries, packed_attention, '
            'record_samples, replay') in message


@pytest.mark.parametrize('section', [
    ['batch_schedule'],
    {'batch_schedule': 5},
    {'integration': 'yes'},
    {'integration': True},
])
def test_non_mapping_section_is_config_error(section):
    with pytest.raises(ConfigError, match='expected a mapping'):
        parse_section(section)


# ---- swift-dynamic check / plugin-path -------------------------------------------------------------------


def write_yaml(tmp_path, data, name='config.yaml'):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data), encoding='utf-8')
    return str(path)


def swift_yaml(**section):
    return {'model': 'some/model', 'tuner_type': 'lora', 'callbacks': ['batch_schedule'], 'dynamic_callbacks': section}


def test_check_good_yaml(tmp_path, capsys):
    path = write_yaml(tmp_path, swift_yaml(batch_schedule={'schedule': {0: 2, 10: 4}}))
    assert cli.main(['check', path]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert printed['batch_schedule'] == {'schedule': {'0': 2, '10': 4}}
    assert printed['integration'] == {'record_samples': False, 'log_values': True, 'max_steps_unit': 'steps',
                                      'oom_recovery': 'auto', 'oom_single_sample_retries': 2,
                                             'oom_grow_back_steps': 1, 'oom_probe_steps': 64, 'enabled': True,
                                      'fail_fast': False, 'replay': None, 'allow_config_change': False,
                                      'stream_window': 1024, 'packed_attention': 'auto', 'grpo_pass_tokens': None}
    assert err.startswith('swift-dynamic check: OK: ')


@pytest.mark.parametrize('section,words', [
    ({'batch_schedule': {'schedule': {0: 2}, 'via': 'foo'}}, ['dynamic_callbacks.batch_schedule.via', "'foo'"]),
    ({'batch_schedule': {'schedule': {0: 0}}}, ['schedule[0]', '>= 1']),
    ({'bogus': {}}, ['bogus', 'known: batch_growth, batch_schedule']),
    ({'batch_schedule': {'schedule': {0: 2}}, 'integration': {'record_samples': 'yes'}},
     ['integration.record_samples', 'true or false']),
])
def test_check_bad_yaml(tmp_path, capsys, section, words):
    path = write_yaml(tmp_path, swift_yaml(**section))
    assert cli.main(['check', path]) == 2
    out, err = capsys.readouterr()
    assert out == ''
    assert err.startswith('swift-dynamic: configuration error: ')
    for word in words:
        assert word in err


def test_check_unlisted_callback(tmp_path, capsys):
    data = swift_yaml(batch_schedule={'schedule': {0: 2}})
    del data['callbacks']
    assert cli.main(['check', write_yaml(tmp_path, data)]) == 2
    assert 'not listed in callbacks' in capsys.readouterr().err
    data['callbacks'] = 'batch_schedule'  # a single name as a string is accepted
    assert cli.main(['check', write_yaml(tmp_path, data, 'b.yaml')]) == 0


def test_check_yaml_not_a_mapping(tmp_path, capsys):
    path = tmp_path / 'list.yaml'
    path.write_text('- a\n- b\n', encoding='utf-8')
    assert cli.main(['check', str(path)]) == 2
    assert 'expected a YAML mapping' in capsys.readouterr().err


def test_check_yaml_section_is_a_list(tmp_path, capsys):
    path = write_yaml(tmp_path, {'callbacks': ['batch_schedule'], 'dynamic_callbacks': ['batch_schedule']})
    assert cli.main(['check', path]) == 2
    assert 'dynamic_callbacks' in capsys.readouterr().err


def test_plugin_path(capsys):
    assert cli.main(['plugin-path']) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == PLUGIN_FILE
    assert os.path.isabs(printed)
    assert os.path.isfile(printed)
    assert printed.endswith('swift_plugin.py')


def test_prepare_adds_plugin_and_strips_section(tmp_path):
    path = write_yaml(tmp_path, {**swift_yaml(batch_schedule={'schedule': {0: 2}}), 'external_plugins': 'mine.py'})
    config, pack = cli.prepare(path, [])
    assert 'dynamic_callbacks' not in config
    assert config['external_plugins'] == ['mine.py', PLUGIN_FILE]
    assert pack.callback_config('batch_schedule').schedule == {0: 2}
    # --callbacks after the file overrides the YAML list
    with pytest.raises(ConfigError, match='not listed'):
        cli.prepare(path, ['--callbacks', 'other_cb', '--num_train_epochs', '1'])


# ---- checkpoint state file -------------------------------------------------------------------------------


class Counter:

    def __init__(self, key, value=0):
        self.state_key = key
        self.value = value
        self.loaded = None

    def state_dict(self):
        return {'value': self.value, 'nested': {'list': [1, 2, 3]}}

    def load_state_dict(self, state):
        self.loaded = dict(state)
        self.value = state['value']


def test_state_round_trip(tmp_path):
    components = [Counter('a', 3), Counter('b', 7)]
    payload = build_payload(components, {'integration': {'record_samples': True}})
    path = write_state(tmp_path / 'checkpoint-5', payload)
    assert path == os.path.join(tmp_path / 'checkpoint-5', STATE_FILE)
    assert os.listdir(tmp_path / 'checkpoint-5') == [STATE_FILE]  # no temporary file left
    read = read_state(tmp_path / 'checkpoint-5')
    assert read == payload
    assert read['format'] == 2
    assert read['components'] == {'a': {'value': 3, 'nested': {'list': [1, 2, 3]}},
                                  'b': {'value': 7, 'nested': {'list': [1, 2, 3]}}}
    fresh = [Counter('a'), Counter('b')]
    assert restore_components(fresh, read) == []
    assert [c.value for c in fresh] == [3, 7]
    # overwrite in place
    write_state(tmp_path / 'checkpoint-5', build_payload([Counter('a', 9)]))
    assert read_state(tmp_path / 'checkpoint-5')['components'] == {'a': {'value': 9, 'nested': {'list': [1, 2, 3]}}}


def test_state_round_trip_of_callback_and_loader(tmp_path):
    from swift_dynamic_callbacks.data.elastic import ElasticDataLoader
    loader = ElasticDataLoader(list(range(10)), list, lambda epoch: list(range(10)), batch_size=3, entries_per_step=1)
    loader.next_step(1)
    callback = BatchScheduleCallback(BatchScheduleConfig(schedule={0: 3}))
    components = stateful_components([callback, loader, object(), 'text'])
    assert [c.state_key for c in components] == ['batch_schedule', 'integration.data']
    write_state(tmp_path, build_payload(components))
    fresh = ElasticDataLoader(list(range(10)), list, lambda epoch: list(range(10)), batch_size=1, entries_per_step=1)
    assert restore_components([callback, fresh], read_state(tmp_path)) == []
    assert (fresh.position, fresh.batch_size, fresh.samples_seen) == (3, 3, 3)


def test_read_state_missing(tmp_path):
    assert read_state(tmp_path) is None
    assert read_state(tmp_path / 'does-not-exist') is None


def test_read_state_corrupt_json(tmp_path):
    (tmp_path / STATE_FILE).write_text('{"format": 1, "components": {', encoding='utf-8')
    with pytest.raises(StateError, match='cannot read pack state'):
        read_state(tmp_path)


@pytest.mark.parametrize('content', [
    '[]',
    '{"format": 3, "components": {}}',
    '{"format": 1}',
    '{"format": 1, "components": []}',
    '{"components": {}}',
])
def test_read_state_wrong_shape(tmp_path, content):
    (tmp_path / STATE_FILE).write_text(content, encoding='utf-8')
    with pytest.raises(StateError, match='not a swift-dynamic-callbacks state file'):
        read_state(tmp_path)


def test_restore_components_reports_missing(tmp_path):
    payload = build_payload([Counter('a', 1), Counter('c', 5)])
    components = [Counter('a'), Counter('b'), Counter('c'), Counter('d')]
    missing = restore_components(components, payload)
    assert missing == ['b', 'd']
    assert [c.value for c in components] == [1, 0, 5, 0]
    assert components[1].loaded is None
    assert components[0].loaded == {'value': 1, 'nested': {'list': [1, 2, 3]}}


def test_stateful_components_rejects_duplicate_key():
    first, second = Counter('same'), Counter('same')
    with pytest.raises(StateError, match="'same'"):
        stateful_components([first, Counter('other'), second])


def test_stateful_components_filters_and_dedups():
    a, b = Counter('a'), Counter('b')
    found = stateful_components([a, object(), b, a, 42])  # the same object twice is one component
    assert found == [a, b]
    assert stateful_components([]) == []


def test_a_renamed_setting_is_read_with_a_note_and_both_at_once_refused():
    from swift_dynamic_callbacks.config.length_batching import LengthBatchingConfig
    from swift_dynamic_callbacks.config.memory_backoff import MemoryBackoffConfig
    from swift_dynamic_callbacks.config import from_mapping
    from swift_dynamic_callbacks.config.snapshot import settings_changes
    pack = parse_section({'length_batching': {'max_tokens': 4096}, 'memory_backoff': {
        'max_pass_tokens': 8192, 'cpu_budget_gib': 4}}, listed=['length_batching', 'memory_backoff'])
    assert pack.callback_config('length_batching').micro_batch_tokens == 4096
    assert pack.callback_config('memory_backoff').static_limit()['tokens'] == 8192
    assert any('length_batching.max_tokens is now called micro_batch_tokens' in n for n in pack.notes)
    assert any('memory_backoff.max_pass_tokens is now called pass_tokens_cap' in n for n in pack.notes)
    with pytest.raises(ConfigError, match='length_batching.max_tokens: renamed micro_batch_tokens, and both are set'):
        from_mapping(LengthBatchingConfig, {'max_tokens': 1, 'micro_batch_tokens': 2},
                     prefix='dynamic_callbacks.length_batching')
    assert not from_mapping(MemoryBackoffConfig, {'cpu_budget_gib': 4}, prefix='x').renamed_notes()
    # a checkpoint written under the old name resumes as the same settings
    assert settings_changes({'length_batching': {'max_tokens': 4096}},
                            {'length_batching': {'micro_batch_tokens': 4096}}) == {}
    assert settings_changes({'length_batching': {'max_tokens': 4096}},
                            {'length_batching': {'micro_batch_tokens': 2048}}) == {
        'length_batching.micro_batch_tokens': [4096, 2048]}

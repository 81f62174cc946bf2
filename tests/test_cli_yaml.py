"""``swift-dynamic sft my.yaml``: the pack's settings live in the same YAML file as ms-swift's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from swift_runs import decisions, indices_by_epoch, read_jsonl, sample_trace, sft_kwargs


def _yaml(path, **config):
    with open(path, 'w', encoding='utf-8') as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return str(path)


def _launch(*argv, cwd=None, env=None):
    cmd = [sys.executable, '-m', 'swift_dynamic_callbacks.cli', *argv]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def _base_config(model, gsm8k_16, output_dir, arch='qwen2'):
    config = sft_kwargs(model, arch, gsm8k_16, output_dir, max_steps=5)
    config['report_to'] = 'none'
    return config


@pytest.mark.e2e
# CI time: the launcher path is the model's business no more than the Python one, where LLaMA runs
# (test_e2e_swift.py::test_batch_changes_exactly_once[llama-*], test_rlhf.py's kto / orpo arms)
@pytest.mark.parametrize('arch', ['qwen2', pytest.param('llama', marks=pytest.mark.slow)])
def test_yaml_run_through_launcher(tmp_path, tiny_qwen, tiny_llama, gsm8k_16, arch):
    out = str(tmp_path / 'out')
    config = _base_config(tiny_qwen if arch == 'qwen2' else tiny_llama, gsm8k_16, out, arch)
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    held_out = str(write_gsm8k_dataset(tmp_path / 'eval.jsonl', 4, split='test'))
    config.update(
        val_dataset=[held_out],  # evaluation every 2 steps runs beside the changes
        eval_steps=2,
        callbacks=['batch_schedule'],
        dynamic_callbacks={
            'batch_schedule': {
                'schedule': {
                    0: 1,
                    2: 3
                },
                'via': 'dataloader'
            },
            'integration': {
                'record_samples': True
            }
        })
    result = _launch('sft', _yaml(tmp_path / 'run.yaml', **config))
    assert result.returncode == 0, result.stderr[-3000:]
    trace = sample_trace(out)
    assert [row['batch_size'] for row in trace] == [1, 1, 3, 3, 3]
    seen = indices_by_epoch(trace)[0]
    assert len(seen) == len(set(seen)) == 11
    assert [(d['step'], d['values']['new']) for d in decisions(out) if d['kind'] == 'batch_size'] == [(0, 1), (2, 3)]
    logged = [row for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'loss' in row]
    assert [row['dynamic/batch_size'] for row in logged] == [1, 1, 3, 3, 3]
    assert len([row for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'eval_loss' in row]) >= 2
    snapshot = yaml.safe_load(open(os.path.join(out, 'dynamic_callbacks_config.json')))
    assert snapshot['batch_schedule']['schedule'] == {'0': 1, '2': 3} or snapshot['batch_schedule']['schedule'] == {
        0: 1,
        2: 3
    }


@pytest.mark.parametrize(
    'section,callbacks,expected',
    [
        ({'batch_schedule': {'schedule': {0: 0}}}, ['batch_schedule'], 'dynamic_callbacks.batch_schedule.schedule[0]'),
        ({'batch_schedule': {'schedule': {0: 2}, 'grow': 2}}, ['batch_schedule'], 'unknown setting(s) grow'),
        ({'batch_schedule': {'schedule': {0: 2}, 'via': 'loader'}}, ['batch_schedule'], "via: must be one of"),
        ({'batch_schedul': {}}, ['batch_schedule'], 'unknown callback(s) batch_schedul'),
        ({'batch_schedule': {'schedule': {0: 2}}}, [], 'configured but not listed in callbacks'),
        ({'integration': {'record_samples': 'yes'}}, [], 'dynamic_callbacks.integration.record_samples'),
        ({}, ['batch_schedule'], 'schedule: give at least one'),
    ],
)
def test_bad_yaml_fails_before_training(tmp_path, section, callbacks, expected):
    config = {'model': 'does-not-matter', 'callbacks': callbacks, 'dynamic_callbacks': section}
    result = _launch('sft', _yaml(tmp_path / 'bad.yaml', **config))
    assert result.returncode == 2
    assert expected in result.stderr, result.stderr
    # rejected by the launcher: ms-swift never started (it logs its command line as 'run sh:' when it does)
    assert 'run sh:' not in result.stdout + result.stderr and 'swift.cli' not in result.stderr


@pytest.mark.e2e
def test_plain_swift_sft_with_plugin_path_and_env_config(tmp_path, tiny_llama, gsm8k_16):
    """Without the launcher: ``--external_plugins $(swift-dynamic plugin-path)`` and the settings file in the env."""
    plugin = _launch('plugin-path').stdout.strip()
    assert os.path.isfile(plugin)
    bad = _yaml(tmp_path / 'pack.yaml', dynamic_callbacks={'batch_schedule': {'schedule': {0: -3}}})
    config = _base_config(tiny_llama, gsm8k_16, str(tmp_path / 'out'), 'llama')
    config.update(callbacks=['batch_schedule'], external_plugins=[plugin])
    env = dict(os.environ, SWIFT_DYNAMIC_CALLBACKS_CONFIG=bad)
    cmd = [sys.executable, '-c', 'from swift.cli.main import cli_main; cli_main()', 'sft',
           _yaml(tmp_path / 'r.yaml', **config)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode != 0
    assert 'dynamic_callbacks.batch_schedule.schedule[0]: must be >= 1, got -3' in result.stderr
    assert not os.path.exists(os.path.join(str(tmp_path / 'out'), 'logging.jsonl'))  # failed before training

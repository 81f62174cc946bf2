"""``swift pt`` (continued pretraining on raw text) through ``swift-dynamic pt``: the pack's flags are honoured as
under ``swift sft``: batch sizes follow batch_growth, the token budget binds, every row is used exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from swift_dynamic_callbacks import cli
from swift_dynamic_callbacks.testing.tiny import MODEL_FLAGS
from swift_runs import decisions, indices_by_epoch, read_jsonl, sample_trace, train_logs

N = 12  # text rows


def write_texts(path, n: int = N) -> str:
    """``n`` raw-text rows (``{"text": ...}``, ms-swift's pretraining form) of varied lengths, from GSM8K."""
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    rows = read_jsonl(write_gsm8k_dataset(os.path.join(os.path.dirname(path), 'gsm8k.jsonl'), n))
    with open(path, 'w', encoding='utf-8') as f:
        for i, row in enumerate(rows):
            question, answer = (m['content'] for m in row['messages'])
            f.write(json.dumps({'text': ' '.join([question] * (1 + i % 3)) + '\n' + answer}) + '\n')
    return str(path)


def test_pt_is_a_launch_command_that_runs_swift_pt(tmp_path):
    path = tmp_path / 'run.yaml'
    path.write_text(yaml.safe_dump({'model': 'm', 'callbacks': ['batch_growth'],
                                    'dynamic_callbacks': {'batch_growth': {'initial': 1}}}), encoding='utf-8')
    config, pack = cli.prepare(str(path), [], 'pt')
    assert 'dynamic_callbacks' not in config and pack.callback_config('batch_growth').initial == 1
    command = cli.build_command('pt', 'launch.yaml', ['--max_steps', '2'])
    assert command[-4:] == ['pt', 'launch.yaml', '--max_steps', '2']


GROWTH = {'initial': 1, 'factor': 2, 'interval': 2, 'maximum': 4}
MAX_TOKENS = 360


@pytest.mark.e2e
def test_swift_dynamic_pt_grows_the_batch_within_a_token_budget_and_uses_every_row_once(tmp_path, tiny_qwen):
    out = tmp_path / 'out'
    config = {
        'model': tiny_qwen, **MODEL_FLAGS['qwen2'], 'tuner_type': 'lora', 'torch_dtype': 'float32',
        'dataset': [write_texts(tmp_path / 'texts.jsonl')], 'dataset_shuffle': False, 'num_train_epochs': 1,
        'per_device_train_batch_size': 1, 'gradient_accumulation_steps': 1, 'learning_rate': 1e-3,
        'logging_steps': 1, 'save_steps': 1000, 'check_model': False, 'report_to': ['none'], 'add_version': False,
        'dataloader_num_workers': 0, 'dataloader_pin_memory': False, 'dataset_num_proc': 1,
        'split_dataset_ratio': 0.0, 'max_length': 1024, 'gradient_checkpointing': False, 'output_dir': str(out),
        'callbacks': ['batch_growth', 'length_batching'],
        'dynamic_callbacks': {'integration': {'record_samples': True}, 'batch_growth': GROWTH,
                              'length_batching': {'max_tokens': MAX_TOKENS, 'bucketing': False}},
    }
    path = tmp_path / 'pt.yaml'
    path.write_text(yaml.safe_dump(config), encoding='utf-8')
    pythonpath = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(cli.__file__)))] + sys.path)
    result = subprocess.run([sys.executable, '-m', 'swift_dynamic_callbacks.cli', 'pt', str(path)],
                            capture_output=True, text=True, timeout=600, env={**os.environ, 'PYTHONPATH': pythonpath})
    assert result.returncode == 0, result.stderr[-4000:]

    with open(out / 'args.json', encoding='utf-8') as f:
        args = json.load(f)
    assert args['use_chat_template'] is False and args['loss_scale'] == 'all'  # swift pt's own defaults ran
    trace = sample_trace(str(out))
    assert sorted(indices_by_epoch(trace)[0]) == list(range(N)), 'every row exactly once'
    sizes = [row['batch_size'] for row in trace]
    expected = [min(GROWTH['initial'] * GROWTH['factor']**((row['step'] - 1) // GROWTH['interval']),
                    GROWTH['maximum']) for row in trace]
    assert sizes == expected, (sizes, expected)
    grown = [d['values']['new'] for d in decisions(str(out))
             if d['source'] == 'batch_growth' and d['reason'] == 'interval']
    assert grown == [2, 4]
    logs = train_logs(str(out))
    assert [row['dynamic/batch_size'] for row in logs] == sizes
    padded = [float(row['dynamic/tokens_per_batch']) for row in logs]
    drawn = [len(row['batches'][0]) for row in trace]
    assert all(p <= MAX_TOKENS or d == 1 for p, d in zip(padded, drawn))
    assert any(d < s for d, s in zip(drawn[:-1], sizes)), 'the token budget never bound'

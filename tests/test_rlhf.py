"""``swift rlhf`` (DPO, KTO, ORPO) through ``swift-dynamic rlhf``: a sample is a pair of rows, the token budget counts
both, batch sizes follow batch_growth and every pair is used exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from swift_dynamic_callbacks import cli
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.data.rows import dataset_lengths, dataset_real_tokens, item_lengths, row_cost
from swift_dynamic_callbacks.testing.tiny import MODEL_FLAGS
from swift_runs import decisions, indices_by_epoch, read_jsonl, sample_trace, train_logs

pytestmark = pytest.mark.start_first  # among the longest files of the default run (--dist loadfile): started first

N = 8  # pairs


def write_pairs(path, n: int = N, kto: bool = False) -> str:
    """``n`` short preference rows of varied lengths (DPO/ORPO: ``rejected_response``; KTO: ``label``)."""
    with open(path, 'w', encoding='utf-8') as f:
        for i in range(n):
            a, b = 3 + i, 7 * i + 1
            row = {'messages': [{'role': 'user', 'content': f'What is {a}+{b}?' + ' Explain.' * (i % 3)},
                                {'role': 'assistant', 'content': f'{a}+{b} = {a + b}.'}]}
            if kto:
                row['label'] = i % 2 == 0
            else:
                row['rejected_response'] = 'I do not know.' * (1 + (i * 5) % 4)
            f.write(json.dumps(row) + '\n')
    return str(path)


# ---- pair costs (no training) -----------------------------------------------------------------------------------


def test_row_cost_counts_every_row_of_a_sample():
    assert row_cost(7) == 7 and row_cost([7]) == 7
    assert row_cost([45, 53]) == 106  # chosen + rejected, padded together
    assert row_cost([]) == 0
    assert item_lengths({'chosen_input_ids': [1] * 5, 'chosen_labels': [1] * 5,
                         'rejected_input_ids': [1] * 3}) == [5, 3]
    assert item_lengths({'input_ids': [1] * 4}) == [4]
    assert item_lengths({'lengths': [9, 2], 'input_ids': [1]}) == [9, 2]
    with pytest.raises(ValueError, match='sample 3'):
        item_lengths({'x': 1}, 3)


def test_dataset_lengths_of_pairs_and_their_real_tokens():
    class Columns(list):
        column_names = ['lengths']

        def __getitem__(self, key):
            return [[3, 9], [4], 7] if key == 'lengths' else super().__getitem__(key)

    dataset = Columns([0, 1, 2])
    assert dataset_lengths(dataset) == [18, 4, 7]
    assert dataset_real_tokens(dataset) == [12, 4, 7]


@pytest.mark.e2e
def test_pair_cost_is_what_the_collator_runs(tiny_qwen, tmp_path):
    """The cost of a DPO/ORPO micro-batch (samples x the longest cost) equals the padded rows the collator makes;
    under KTO it bounds the completion + KL batches."""
    from swift.model import get_processor
    from swift.template import get_template
    template = get_template(get_processor(tiny_qwen, model_type='qwen2'), template_type='qwen2_5', max_length=1024)
    for mode, rows in (('rlhf', read_jsonl(write_pairs(tmp_path / 'dpo.jsonl'))),
                       ('kto', read_jsonl(write_pairs(tmp_path / 'kto.jsonl', kto=True)))):
        template.set_mode(mode)
        for start in range(0, N, 3):
            encoded = [template.encode(r, return_length=True) for r in rows[start:start + 3]]
            batch = template.data_collator(encoded)
            costs = [row_cost(item_lengths(e)) for e in encoded]
            planned = len(costs) * max(costs)
            ran = sum(v.numel() for k, v in batch.items() if k.endswith('input_ids'))
            assert (ran == planned) if mode == 'rlhf' else (ran <= planned), (mode, ran, planned)


# ---- configuration ------------------------------------------------------------------------------------------------


def _yaml(tmp_path, data) -> str:
    path = tmp_path / 'run.yaml'
    path.write_text(yaml.safe_dump(data), encoding='utf-8')
    return str(path)


@pytest.mark.parametrize('section,match', [
    ({'batch_growth': {'initial': 1, 'micro_batch_cap': 1}},
     'rlhf_type: dpo cannot be combined with .*micro_batch_cap'),
    ({'integration': {'oom_recovery': True}, 'batch_growth': {}}, 'oom_recovery: true is not supported with rlhf'),
])
def test_rlhf_refuses_split_passes(tmp_path, section, match):
    callbacks = [k for k in section if k != 'integration']
    path = _yaml(tmp_path, {'model': 'm', 'callbacks': callbacks, 'dynamic_callbacks': section})
    with pytest.raises(ConfigError, match=match):
        cli.prepare(path, [], 'rlhf')  # rlhf_type left out: ms-swift's default, dpo
    cli.prepare(path, [], 'sft')  # allowed under sft


@pytest.mark.parametrize('rlhf,callbacks,section,match', [
    ('grpo', ['batch_growth'], {},
     'rlhf_type: grpo cannot be combined with callbacks: batch_growth: its trainer draws'),
    ('gkd', ['lr_schedule', 'length_batching'], {}, 'rlhf_type: gkd cannot be combined with callbacks: '
                                                    'length_batching.*allowed under gkd: lr_schedule, early_stopping'),
    ('grpo', ['training_log'], {'training_log': {'noise_scale': True}},
     'training_log.noise_scale: true cannot be used'),
    ('grpo', ['lr_schedule'], {'integration': {'oom_recovery': True}}, 'oom_recovery: true cannot be used with '
                                                                       'rlhf_type: grpo'),
    ('ppo', ['lr_schedule'], {}, "rlhf_type: ppo is not supported.*TRL's own training loop"),
    ('dpo', ['lr_schedule'], {'integration': {'grpo_pass_tokens': 512}},
     "grpo_pass_tokens: 512 cuts GRPO's loss passes: it needs rlhf_type: grpo"),
])
def test_rlhf_refuses_what_a_rollout_trainer_cannot_run(tmp_path, rlhf, callbacks, section, match):
    """Under GRPO / GKD the run-level callbacks run; everything that builds batches or cuts passes is refused before
    anything launches, naming rlhf_type and why; PPO's own loop refuses every callback."""
    path = _yaml(tmp_path, {'model': 'm', 'rlhf_type': rlhf, 'callbacks': callbacks, 'dynamic_callbacks': section})
    with pytest.raises(ConfigError, match=match):
        cli.prepare(path, [], 'rlhf')


@pytest.mark.parametrize('settings,match', [
    ({'loss_type': 'real'}, "grpo_pass_tokens: 512 cannot be used with loss_type: 'real'"),
    ({'use_liger_kernel': True}, 'use_liger_kernel: True: the liger loss'),
    ({'deepspeed': 'zero2'}, "deepspeed: 'zero2': every backward under DeepSpeed"),
    ({'sequence_parallel_size': 2}, 'sequence_parallel_size: 2'),
    ({'loss_type': 'dapo'}, None),
])
def test_grpo_pass_tokens_is_checked_before_launch(tmp_path, settings, match):
    """``integration.grpo_pass_tokens`` under GRPO: what would make a pass's loss other than its share of the one-pass
    loss is refused at ``check`` time naming the setting; ``oom_recovery: true`` is allowed with it."""
    section = {'lr_schedule': {}, 'integration': {'grpo_pass_tokens': 512, 'oom_recovery': True}}
    path = _yaml(tmp_path, {'model': 'm', 'rlhf_type': 'grpo', 'callbacks': ['lr_schedule'],
                            'dynamic_callbacks': section, **settings})
    if match is None:
        cli.prepare(path, [], 'rlhf')
        return
    with pytest.raises(ConfigError, match=match):
        cli.prepare(path, [], 'rlhf')


def test_rlhf_runs_the_run_level_callbacks_under_grpo(tmp_path):
    section = {'lr_schedule': {}, 'early_stopping': {'monitor': 'reward', 'mode': 'max'},
               'checkpoint_rotation': {'keep_last': 1, 'keep_best': 1, 'metric': 'reward', 'mode': 'max'},
               'training_log': {}}
    path = _yaml(tmp_path, {'model': 'm', 'rlhf_type': 'grpo', 'callbacks': list(section),
                            'dynamic_callbacks': section})
    cli.prepare(path, [], 'rlhf')


# ---- end to end ---------------------------------------------------------------------------------------------------

GROWTH = {'initial': 1, 'factor': 2, 'interval': 1, 'maximum': 4}  # 1, 2, 4, then the last sample
GROWTH_KTO = {'initial': 2, 'factor': 2, 'interval': 2, 'maximum': 4}  # KTO needs a batch > 1: 2, 2, 4
MAX_TOKENS = 400


def run_rlhf(tmp_path, model: str, arch: str, rlhf_type: str, dataset: str, section: dict, callbacks: list[str],
             out: str | None = None, **overrides) -> str:
    out = out or tmp_path / f'out-{rlhf_type}'
    config = {
        'model': model, **MODEL_FLAGS[arch], 'rlhf_type': rlhf_type, 'tuner_type': 'lora',
        'torch_dtype': 'float32', 'dataset': [dataset], 'dataset_shuffle': False, 'num_train_epochs': 1,
        'per_device_train_batch_size': section['batch_growth']['initial'], 'gradient_accumulation_steps': 1,
        'learning_rate': 1e-3, 'logging_steps': 1, 'save_steps': 1000, 'check_model': False, 'report_to': ['none'],
        'add_version': False, 'dataloader_num_workers': 0, 'dataloader_pin_memory': False, 'dataset_num_proc': 1,
        'split_dataset_ratio': 0.0, 'max_length': 1024, 'output_dir': str(out), 'callbacks': callbacks,
        'dynamic_callbacks': {'integration': {'record_samples': True}, **section}, **overrides,
    }
    path = tmp_path / f'{rlhf_type}.yaml'
    path.write_text(yaml.safe_dump(config), encoding='utf-8')
    pythonpath = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(cli.__file__)))] + sys.path)
    result = subprocess.run([sys.executable, '-m', 'swift_dynamic_callbacks.cli', 'rlhf', str(path)],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, 'PYTHONPATH': pythonpath})
    assert result.returncode == 0, result.stderr[-4000:]
    return str(out)


def _pair_costs(model: str, arch: str, dataset: str) -> list[int]:
    from swift.model import get_processor
    from swift.template import get_template
    flags = MODEL_FLAGS[arch]
    template = get_template(get_processor(model, model_type=flags['model_type']), template_type=flags['template'],
                            max_length=1024)
    template.set_mode('rlhf')
    return [row_cost(item_lengths(template.encode(r, return_length=True))) for r in read_jsonl(dataset)]


@pytest.mark.e2e
@pytest.mark.parametrize('rlhf_type,arch', [('dpo', 'qwen2'), ('kto', 'llama'), ('orpo', 'llama')])
def test_rlhf_batch_growth_every_pair_once(request, tmp_path, rlhf_type, arch):
    model = request.getfixturevalue('tiny_qwen' if arch == 'qwen2' else 'tiny_llama')
    kto = rlhf_type == 'kto'
    dataset = write_pairs(tmp_path / 'pairs.jsonl', kto=kto)
    growth = GROWTH_KTO if kto else GROWTH
    callbacks = ['batch_growth'] + (['length_batching'] if rlhf_type == 'orpo' else [])
    section = {'batch_growth': growth}
    if rlhf_type == 'orpo':  # the budget binds: a pair costs both its rows
        section['length_batching'] = {'max_tokens': MAX_TOKENS, 'bucketing': False}
    out = run_rlhf(tmp_path, model, arch, rlhf_type, dataset, section, callbacks)

    trace = sample_trace(out)
    assert sorted(indices_by_epoch(trace)[0]) == list(range(N)), 'every pair exactly once'
    sizes = [row['batch_size'] for row in trace]
    expected = [min(growth['initial'] * growth['factor']**((row['step'] - 1) // growth['interval']), growth['maximum'])
                for row in trace]
    assert sizes == expected, (sizes, expected)
    grown = [d for d in decisions(out) if d['source'] == 'batch_growth' and d['reason'] == 'interval']
    assert [d['values']['new'] for d in grown] == sorted({s for s in expected if s != growth['initial']})
    logs = train_logs(out)
    assert [row['dynamic/batch_size'] for row in logs] == sizes
    drawn = [sum(len(b) for b in row['batches']) for row in trace]
    if rlhf_type != 'orpo':
        left = N
        for size, took in zip(sizes, drawn):
            assert took == min(size, left)
            left -= took
        return
    costs = _pair_costs(model, arch, dataset)  # dataset_shuffle: false, no split: index i is row i
    for row, log in zip(trace, logs):
        (batch, ) = row['batches']
        padded = len(batch) * max(costs[i] for i in batch)
        assert len(batch) <= row['batch_size']
        assert padded <= MAX_TOKENS or len(batch) == 1
        assert float(log['dynamic/tokens_per_batch']) == padded  # what the model ran: both rows of every pair
    assert any(len(b) < s for row in trace for b, s in [(row['batches'][0], row['batch_size'])]), 'budget never bound'


@pytest.mark.e2e
def test_dpo_resume_draws_and_trains_what_the_uninterrupted_run_did(tiny_llama, tmp_path):
    """DPO with batch growth (1, 2, 4, then the last pair), checkpointed at step 2 and resumed: the resumed steps take
    the pairs, batch sizes and losses of the uninterrupted run."""
    import shutil
    data = write_pairs(tmp_path / 'pairs.jsonl')
    section = {'batch_growth': GROWTH}
    full = run_rlhf(tmp_path, tiny_llama, 'llama', 'dpo', data, section, ['batch_growth'], save_steps=2)
    target = str(tmp_path / 'resumed')
    shutil.copytree(full, target)
    written = len(sample_trace(target))
    logged = len(train_logs(target))
    run_rlhf(tmp_path, tiny_llama, 'llama', 'dpo', data, section, ['batch_growth'], out=target, save_steps=2,
             resume_from_checkpoint=os.path.join(target, 'checkpoint-2'))
    straight = [(row['step'], row['batches']) for row in sample_trace(full)]
    resumed = [(row['step'], row['batches']) for row in sample_trace(target)[written:]]
    assert resumed == [s for s in straight if s[0] > 2] and len(resumed) >= 2
    losses = {row['global_step/max_steps']: row['loss'] for row in train_logs(full)}
    after = train_logs(target)[logged:]
    assert after and all(row['loss'] == pytest.approx(losses[row['global_step/max_steps']], rel=1e-5) for row in after)

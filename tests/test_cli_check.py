"""``swift-dynamic check`` / ``sft`` / ``rlhf``: every configuration mistake that depends only on the YAML file (and the
flags after it) is rejected before anything is launched, with exit code 2 and a message naming the key, the value and
what is allowed; the launcher imports no torch / transformers / peft / swift; ``rlhf`` runs ``swift rlhf``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from swift_dynamic_callbacks import cli
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.config.pack import ENV_CONFIG, PLUGIN_FILE, SWIFT_CALLBACKS, load_env_config

HEAVY = ('torch', 'transformers', 'peft', 'swift')
BASE = {'model': 'some/model', 'tuner_type': 'lora', 'dataset': ['data.jsonl']}
GROWTH = {'batch_growth': {}}


def write(tmp_path, data, name='run.yaml'):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding='utf-8')
    return str(path)


def case(callbacks, section, **settings):
    return {**BASE, 'callbacks': callbacks, 'dynamic_callbacks': section, **settings}


#: (id, YAML, flags after the file, words the error must contain)
PASS_TOKENS = {'length_batching': {'mode': 'balanced', 'pass_tokens': 4096}}
BAD = [
    ('nan_warmup', case(['lr_schedule'], {'lr_schedule': {'warmup': float('nan')}}), [],
     ['dynamic_callbacks.lr_schedule.warmup', 'nan', 'optimizer steps']),
    ('inf_hold', case(['lr_schedule'], {'lr_schedule': {'hold': float('inf')}}), [],
     ['dynamic_callbacks.lr_schedule.hold', 'inf']),
    ('bool_patience', case(['early_stopping'], {'early_stopping': {'monitor': 'loss', 'patience': True}}), [],
     ['dynamic_callbacks.early_stopping.patience', 'True']),
    ('unknown_callback', case(['batch_growht'], {}), [],
     ["callbacks: 'batch_growht' is not a known callback name", 'batch_growth', 'early_stop', 'lisa']),
    ('unknown_callback_flag', case(['lr_schedule'], {}), ['--callbacks', 'lr_schedule', 'nope'],
     ["callbacks: 'nope' is not a known callback name"]),
    ('table_with_interval', case(['batch_growth'], {'batch_growth': {'policy': 'interval', 'table': {0: 2}}}), [],
     ['dynamic_callbacks.batch_growth.table: only read by policy: table; the configured policy is interval']),
    ('schedule_and_growth', case(['batch_schedule', 'batch_growth'],
                                 {'batch_schedule': {'schedule': {0: 2}}, **GROWTH}), [],
     ['callbacks: batch_schedule and batch_growth both request the per-device batch size']),
    ('replay_missing', case(['batch_growth'], {**GROWTH, 'integration': {'replay': 'no/such/dynamic_decisions.jsonl'}}),
     [], ['dynamic_callbacks.integration.replay', "'no/such/dynamic_decisions.jsonl' does not exist"]),
    ('function_missing', case(['batch_growth'], {'batch_growth': {'policy': 'callable', 'function': 'no_such_mod:f'}}),
     [], ["dynamic_callbacks.batch_growth.function: cannot import 'no_such_mod:f'"]),
    ('rules_int', case(['length_batching'], {'length_batching': {'mode': 'rules', 'rules': 1}}), [],
     ['dynamic_callbacks.length_batching.rules: expected a mapping {longer_than: samples}', 'got 1']),
    ('negative_batch', case(['batch_growth'], GROWTH, per_device_train_batch_size=-1), [],
     ['per_device_train_batch_size: must be >= 1, got -1']),
    ('negative_batch_flag', case(['batch_growth'], GROWTH), ['--per_device_train_batch_size', '-3'],
     ['per_device_train_batch_size: must be >= 1, got -3']),
    ('zero_accumulation', case(['batch_growth'], GROWTH, gradient_accumulation_steps=0), [],
     ['gradient_accumulation_steps: must be >= 1, got 0']),
    ('negative_lr', case(['batch_growth'], GROWTH, learning_rate=-1), [], ['learning_rate: must be > 0, got -1']),
    ('typo_key', case(['batch_growth'], GROWTH, learnig_rate=1), [],
     ["learnig_rate: not a setting of ms-swift's swift", 'did you mean learning_rate?', 'remaining_argv']),
    ('typo_flag', case(['batch_growth'], GROWTH), ['--learnig_rate', '1'], ['learnig_rate: not a setting',
                                                                            'did you mean learning_rate?']),
    ('unknown_flag', case(['batch_growth'], GROWTH), ['--no_such_flag', 'x'], ['no_such_flag: not a setting']),
    ('wrong_type', case(['batch_growth'], GROWTH, per_device_train_batch_size='two'), [],
     ["per_device_train_batch_size: expected an int, got 'two'"]),
    ('wrong_choice', case(['batch_growth'], GROWTH, torch_dtype='fp32'), [],
     ["torch_dtype: 'fp32' is not one of bfloat16, float16, float32"]),
    ('misspelled_pack_callback', case(['batch_growht'], GROWTH), [],
     ["callbacks: 'batch_growht' is not a known callback name; did you mean batch_growth?"]),
    ('vl_padding_free', case(['length_batching'], {'length_batching': {'padding_free': True}},
                             model='Qwen/Qwen2.5-VL-7B-Instruct'), [],
     ['length_batching.padding_free: true is not supported with model: Qwen/Qwen2.5-VL-7B-Instruct']),
    ('vl_padding_free_type', case(['length_batching'], {'length_batching': {'padding_free': True}},
                                  model_type='qwen2_vl'), [],
     ['length_batching.padding_free: true is not supported with model_type: qwen2_vl']),
    ('streaming', case(['batch_growth'], GROWTH, streaming=True), [],
     ['max_steps: streaming: true needs max_steps > 0']),
    ('streaming_flag', case(['batch_growth'], GROWTH), ['--streaming', 'true'], ['max_steps: streaming: true needs']),
    ('streaming_samples', case(['batch_growth'], {**GROWTH, 'integration': {'max_steps_unit': 'samples'}},
                               streaming=True, max_steps=5),
     [], ['max_steps_unit: samples is not supported with streaming']),
    ('packing_cap', case(['batch_growth'], {'batch_growth': {'micro_batch_cap': 2}}, packing=True), [],
     ['packing: true cannot be combined with dynamic_callbacks.batch_growth.micro_batch_cap']),
    ('padding_free_backoff', case(['memory_backoff'], {}, padding_free=True), [],
     ['padding_free: true cannot be combined with callbacks: memory_backoff']),
    ('pieces_packing', case(['batch_schedule'], {'batch_schedule': {'schedule': {0: 4}, 'pieces': {0: 2}}}),
     ['--packing', 'true'], ['packing: true cannot be combined with dynamic_callbacks.batch_schedule.pieces']),
    ('deepspeed_noise_scale', case(['batch_growth'], {'batch_growth': {'policy': 'noise_scale'}}, deepspeed='zero2',
                                   gradient_accumulation_steps=2), [],
     ['dynamic_callbacks.batch_growth.policy', 'deepspeed', 'not supported']),
    ('deepspeed_flag', case(['batch_growth'], {'batch_growth': {'policy': 'noise_scale'}},
                            gradient_accumulation_steps=2), ['--deepspeed', 'zero3'],
     ['noise_scale', 'deepspeed']),
    ('fsdp_noise_scale', case(['training_log'], {'training_log': {'noise_scale': True}}, fsdp='full_shard',
                              gradient_accumulation_steps=2), [],
     ['dynamic_callbacks.training_log.noise_scale', 'fsdp2']),
    ('oom_true_deepspeed', case(['batch_growth'], {**GROWTH, 'integration': {'oom_recovery': True}},
                                deepspeed='zero2'), [], ['dynamic_callbacks.integration.oom_recovery', 'deepspeed']),
    ('sequence_parallel_oom', case(['batch_growth'], {**GROWTH, 'integration': {'oom_recovery': True}},
                                   sequence_parallel_size=2), [],
     ['oom_recovery: true cannot be used with sequence_parallel_size: 2', 'all-to-all']),
    ('sequence_parallel_padding_free', case(['length_batching'], {'length_batching': {'padding_free': True}},
                                            sequence_parallel_size=2), [],
     ['length_batching.padding_free: true is not supported with sequence_parallel_size: 2']),
    ('drop_last', case(['batch_growth'], GROWTH, dataloader_drop_last=True), [],
     ['dataloader_drop_last: must be false']),
    # no pack callback listed: the integration still runs (its loader uses every sample), so its rules hold
    ('drop_last_integration_alone', case(['lisa'], {}, dataloader_drop_last=True), [],
     ['dataloader_drop_last: must be false']),
    ('auto_find', case(['batch_growth'], GROWTH), ['--auto_find_batch_size', 'true'],
     ['auto_find_batch_size: must be false']),
    ('save_total_limit', case(['checkpoint_rotation'], {'checkpoint_rotation': {'metric': 'loss'}}, save_total_limit=2),
     [], ['save_total_limit: checkpoint_rotation deletes checkpoints itself', 'got 2']),
    ('eval_monitor_no_eval', case(['early_stopping'], {'early_stopping': {'monitor': 'eval_loss'}}), [],
     ["dynamic_callbacks.early_stopping.monitor: 'eval_loss' is an evaluation metric but this run never evaluates"]),
    ('eval_monitor_eval_no', case(['lr_schedule'], {'lr_schedule': {'monitor': 'eval_loss'}},
                                  split_dataset_ratio=0.1, eval_strategy='no'), [],
     ["dynamic_callbacks.lr_schedule.monitor: 'eval_loss'"]),
    ('rotation_default_metric_no_eval', case(['checkpoint_rotation'], {}), [],
     ["dynamic_callbacks.checkpoint_rotation.metric: 'eval_loss' is an evaluation metric"]),
    ('plateau_scheduler', case(['lr_schedule'], {}, lr_scheduler_type='reduce_lr_on_plateau'), [],
     ['lr_scheduler_type: reduce_lr_on_plateau is not a LambdaLR schedule', 'lr_schedule']),
    ('scaled_growth_scheduler', case(['batch_growth'], GROWTH), ['--lr_scheduler_type', 'reduce_lr_on_plateau'],
     ['lr_scheduler_type', 'batch_growth.lr_scaling: sqrt']),
    ('noise_scale_accumulation', case(['batch_growth'], {'batch_growth': {'policy': 'noise_scale'}},
                                      gradient_accumulation_steps=1), [],
     ['dynamic_callbacks.batch_growth.policy: noise_scale needs at least two', 'gradient_accumulation_steps is 1']),
    ('noise_scale_pass_tokens', case(['batch_growth', 'length_batching'],
                                     {'batch_growth': {'policy': 'noise_scale'}, **PASS_TOKENS},
                                     gradient_accumulation_steps=2), [],
     ['dynamic_callbacks.length_batching.pass_tokens cannot be combined with dynamic_callbacks.batch_growth.policy: '
      'noise_scale']),
    ('cpu_without_budget', case(['memory_backoff'], {}, use_cpu=True), [],
     ['dynamic_callbacks.memory_backoff.cpu_budget_gib: use_cpu: true']),
    ('cpu_probe_without_budget', case(['memory_backoff'], {'memory_backoff': {'probe': 'cpu'}}), [],
     ['dynamic_callbacks.memory_backoff.cpu_budget_gib: probe: cpu']),
    ('zero_epochs', case(['batch_growth'], GROWTH, num_train_epochs=0), [], ['num_train_epochs: must be > 0']),
    ('section_not_listed', case([], GROWTH), [], ['dynamic_callbacks.batch_growth: configured but not listed']),
    ('yaml_not_mapping', ['a', 'b'], [], ['expected a YAML mapping']),
    ('dashed_flag', case(['batch_growth'], GROWTH), ['--dataloader-drop-last', 'true'],
     ['dataloader_drop_last: must be false']),
    ('rlhf_split_passes', case(['length_batching'], {'length_batching': {'split': 'passes', 'bucketing': False}},
                               rlhf_type='orpo'), [],
     ['rlhf_type: orpo cannot be combined with dynamic_callbacks.length_batching.split: passes']),
    ('packing_split_passes', case(['length_batching'], {'length_batching': {'split': 'passes', 'bucketing': False}},
                                  packing=True), [],
     ['packing: true cannot be combined with dynamic_callbacks.length_batching.split: passes']),
    ('stream_window_without_streaming', case(['batch_growth'], {**GROWTH, 'integration': {'stream_window': 64}}), [],
     ['dynamic_callbacks.integration.stream_window: only read with streaming: true', 'got 64']),
    ('packed_attention_without_padding_free', case(['length_batching'], {'length_batching': {'mode': 'balanced'},
                                                                          'integration': {'packed_attention': 'keep'}}),
     [], ['dynamic_callbacks.integration.packed_attention: only read with length_batching.padding_free: true',
          "got 'keep'"]),
    ('samples_unit_without_max_steps', case(['batch_growth'], {**GROWTH, 'integration': {'max_steps_unit': 'samples'}},
                                            num_train_epochs=2), [],
     ['dynamic_callbacks.integration.max_steps_unit: samples counts max_steps in samples, but max_steps is not set']),
    ('oom_retries_without_recovery', case(['batch_growth'], {**GROWTH, 'integration': {
        'oom_recovery': False, 'oom_single_sample_retries': 3}}), [],
     ['dynamic_callbacks.integration.oom_single_sample_retries: only read by oom_recovery: auto | true']),
    ('pass_tokens_not_auto', case(['length_batching'], {'length_batching': {'mode': 'balanced', 'pass_tokens': 'big'}}),
     [], ["dynamic_callbacks.length_batching.pass_tokens: expected an integer >= 1, auto or null, got 'big'"]),
    ('recovery_true_infonce', case(['batch_growth'], {**GROWTH, 'integration': {'oom_recovery': True}},
                                   loss_type='infonce'), [],
     ['dynamic_callbacks.integration.oom_recovery: true cannot be combined with loss_type: infonce',
      'allowed: auto']),
    ('recovery_true_embedding', case(['batch_growth'], {**GROWTH, 'integration': {'oom_recovery': True}},
                                     task_type='embedding'), [],
     ['oom_recovery: true cannot be combined with task_type: embedding']),
    ('pass_tokens_label_smoothing', case(['length_batching'], PASS_TOKENS, label_smoothing_factor=0.1), [],
     ['label_smoothing_factor: 0.1 cannot be combined with dynamic_callbacks.length_batching.pass_tokens',
      'allowed: 0']),
    ('pass_tokens_seq_cls', case(['length_batching'], PASS_TOKENS, task_type='seq_cls'), [],
     ['task_type: seq_cls cannot be combined with dynamic_callbacks.length_batching.pass_tokens',
      'allowed: causal_lm']),
    ('split_passes_loss_type', case(['length_batching'], {'length_batching': {'split': 'passes', 'bucketing': False}},
                                    loss_type='infonce'), [],
     ['loss_type: infonce cannot be combined with dynamic_callbacks.length_batching.split: passes']),
    ('memory_backoff_moe_aux', case(['memory_backoff'], {'memory_backoff': {'cpu_budget_gib': 8}},
                                    router_aux_loss_coef=0.001), [],
     ['router_aux_loss_coef: 0.001 cannot be combined with callbacks: memory_backoff']),
]


@pytest.mark.parametrize('command', ['check', 'sft', 'rlhf', 'pt'])
@pytest.mark.parametrize('name,data,extra,words', BAD, ids=[b[0] for b in BAD])
def test_a_mistake_is_refused_before_launch(tmp_path, capsys, monkeypatch, command, name, data, extra, words):
    def launched(*args, **kwargs):
        raise AssertionError(f'launched despite {name}')

    monkeypatch.setattr(cli.subprocess, 'run', launched)
    monkeypatch.chdir(tmp_path)
    assert cli.main([command, write(tmp_path, data), *extra]) == 2
    out, err = capsys.readouterr()
    assert err.startswith('swift-dynamic: configuration error: '), err
    for word in words:
        assert word in err, err
    assert out == ''


GOOD = [
    ('plain', case(['batch_growth'], GROWTH), []),
    ('eval_monitor_with_split', case(['early_stopping', 'checkpoint_rotation'], {'early_stopping': {}},
                                     split_dataset_ratio=0.1), []),
    ('eval_monitor_with_val', case(['lr_schedule'], {'lr_schedule': {'monitor': 'eval_loss'}}, val_dataset=['v.jsonl']),
     []),
    ('growth_and_length', case(['batch_growth', 'length_batching', 'lr_schedule', 'memory_backoff'], GROWTH), []),
    ('builtin_swift_callback', case(['lisa', 'batch_growth'], GROWTH), []),
    ('deepspeed_without_splits', case(['batch_growth', 'lr_schedule'], GROWTH, deepspeed='zero2'), []),
    ('deepspeed_backoff', case(['memory_backoff'], {'memory_backoff': {'cpu_budget_gib': 8.0}}, deepspeed='zero2'),
     []),  # pass caps run under sharded engines: every rank the same passes
    ('fsdp_cap', case(['batch_growth'], {'batch_growth': {'micro_batch_cap': 2}}, fsdp='full_shard'), []),
    ('zero3_pass_tokens', case(['length_batching'], PASS_TOKENS, deepspeed='zero3'), []),
    ('packing_without_splits', case(['batch_growth', 'length_batching'], GROWTH, packing=True), []),
    ('integration_alone', case(['lisa'], {}, streaming=True, max_steps=100), []),
    ('plateau_scheduler_unscaled', case(['batch_growth'], {'batch_growth': {'lr_scaling': 'none'}},
                                        lr_scheduler_type='reduce_lr_on_plateau'), []),
    ('noise_scale_default_accumulation', case(['batch_growth'], {'batch_growth': {'policy': 'noise_scale'}},
                                              per_device_train_batch_size=2), []),
    ('streaming_with_max_steps', case(['batch_growth', 'length_batching'], GROWTH, streaming=True, max_steps=100), []),
    ('rlhf_dpo_growth', case(['batch_growth', 'length_batching'], GROWTH, rlhf_type='dpo'), []),
    ('flag_overrides_file', case(['batch_growth'], GROWTH, streaming=True), ['--streaming', 'false']),
    ('stream_window_with_streaming', case(['batch_growth', 'length_batching'], {
        **GROWTH, 'integration': {'stream_window': 64}}, streaming=True, max_steps=10), []),
    ('packed_attention_keep', case(['length_batching'], {'length_batching': {'mode': 'balanced', 'padding_free': True},
                                                         'integration': {'packed_attention': 'keep'}}), []),
    ('samples_unit_with_max_steps', case(['batch_growth'], {**GROWTH, 'integration': {'max_steps_unit': 'samples'}},
                                         max_steps=64), []),
    ('pass_tokens_auto', case(['length_batching'], {'length_batching': {'mode': 'balanced', 'pass_tokens': 'auto'}}),
     []),
    ('pass_tokens_causal_lm', case(['length_batching'], PASS_TOKENS, task_type='causal_lm', label_smoothing_factor=0),
     []),
    ('seq_cls_without_splits', case(['batch_growth'], GROWTH, task_type='seq_cls', label_smoothing_factor=0.1), []),
    ('recovery_true_label_smoothing', case(['batch_growth'], {**GROWTH, 'integration': {'oom_recovery': True}},
                                           label_smoothing_factor=0.1), []),  # a mean the pack weights piece by piece
]


@pytest.mark.parametrize('name,data,extra', GOOD, ids=[g[0] for g in GOOD])
def test_a_good_file_passes(tmp_path, capsys, name, data, extra):
    assert cli.main(['check', write(tmp_path, data), *extra]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert json.loads(out)['integration']['enabled'] is True
    assert err.startswith('swift-dynamic check: OK: ') and err.count('\n') == 1  # one OK line, no note


def test_group_by_length_is_refused_under_several_processes(tmp_path, capsys, monkeypatch):
    """Several processes: the pack deals a seeded permutation, so HF's length grouping would be silently lost."""
    path = write(tmp_path, case(['batch_growth'], GROWTH, group_by_length=True))
    monkeypatch.setenv('NPROC_PER_NODE', '2')
    assert cli.main(['check', path]) == 2
    assert 'group_by_length: true is not supported with swift-dynamic-callbacks under several processes' in (
        capsys.readouterr().err)
    monkeypatch.setenv('NPROC_PER_NODE', '1')
    assert cli.main(['check', path]) == 0  # one process: the host's own (length-grouped) sampler decides


def test_average_tokens_off_is_refused_with_pass_tokens_under_several_processes(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, case(['length_batching'], {'length_batching': {'mode': 'balanced', 'pass_tokens': 4096}},
                                average_tokens_across_devices=False))
    monkeypatch.setenv('NPROC_PER_NODE', '2')
    assert cli.main(['check', path]) == 2
    assert ('average_tokens_across_devices: false cannot be combined with dynamic_callbacks.length_batching.'
            'pass_tokens under 2 processes') in capsys.readouterr().err
    monkeypatch.setenv('NPROC_PER_NODE', '1')
    assert cli.main(['check', path]) == 0  # one process: the rank's count is the step's


def test_a_mean_loss_is_refused_at_start_too(monkeypatch):
    """The second line, in the training process: the same rule on the trainer's arguments and its callbacks."""
    from types import SimpleNamespace

    from swift_dynamic_callbacks.callbacks.length_batching import LengthBatchingCallback
    from swift_dynamic_callbacks.config.length_batching import LengthBatchingConfig
    from swift_dynamic_callbacks.integrations import data
    args = SimpleNamespace(dataloader_drop_last=False, auto_find_batch_size=False, max_steps=-1, loss_type=None,
                           label_smoothing_factor=0.1, router_aux_loss_coef=0.0, average_tokens_across_devices=True)
    callback = LengthBatchingCallback(LengthBatchingConfig(mode='balanced', pass_tokens=1200))
    trainer = SimpleNamespace(args=args, task_type='causal_lm', template=None,
                              callback_handler=SimpleNamespace(callbacks=[callback]))
    with pytest.raises(ConfigError, match='label_smoothing_factor: 0.1 cannot be combined with '
                                          'dynamic_callbacks.length_batching.pass_tokens'):
        data.check_supported(trainer)
    args.label_smoothing_factor = 0.0
    data.check_supported(trainer)


def test_group_by_length_is_refused_at_start_under_several_processes(monkeypatch):
    """The second line, in the training process (plain ``swift sft`` with the plugin skips the launcher)."""
    from types import SimpleNamespace

    from swift_dynamic_callbacks import distributed
    from swift_dynamic_callbacks.integrations import data
    args = SimpleNamespace(group_by_length=True, data_seed=42)
    monkeypatch.setattr(distributed, 'world_size', lambda: 2)
    refused = r'group_by_length: true is not supported .* several processes \(world size 2\)'
    with pytest.raises(ConfigError, match=refused):
        data.epoch_order_fn(None, list(range(8)), args)
    monkeypatch.setattr(distributed, 'rank', lambda: 1)
    assert data.epoch_order_fn(None, list(range(8)), SimpleNamespace(group_by_length=False, data_seed=42))(0)


def test_ignore_data_skip_is_refused_for_a_checkpoint_with_the_packs_state(tmp_path, capsys):
    checkpoint = tmp_path / 'out' / 'checkpoint-4'
    checkpoint.mkdir(parents=True)
    path = write(tmp_path, case(['batch_growth'], GROWTH, ignore_data_skip=True,
                                resume_from_checkpoint=str(checkpoint)))
    assert cli.main(['check', path]) == 0, capsys.readouterr().err  # a checkpoint without the pack: HF's rule holds
    (checkpoint / 'dynamic_callbacks_state.json').write_text('{}')
    assert cli.main(['check', path]) == 2
    assert f'ignore_data_skip: true cannot be honoured when resuming from {checkpoint}' in capsys.readouterr().err


def test_a_replay_folder_without_a_decision_log_is_refused(tmp_path, capsys):
    empty = tmp_path / 'first_run'
    empty.mkdir()
    path = write(tmp_path, case(['batch_growth'], {**GROWTH, 'integration': {'replay': str(empty)}}))
    assert cli.main(['check', path]) == 2
    assert 'holds no dynamic_decisions.jsonl' in capsys.readouterr().err
    (empty / 'dynamic_decisions.jsonl').write_text('')
    assert cli.main(['check', path]) == 0


@pytest.mark.parametrize('flag', [['--external_plugins', 'mine.py', 'yours.py'], ['--external-plugins=mine.py']])
def test_an_external_plugins_flag_keeps_the_packs_plugin(tmp_path, monkeypatch, flag):
    """ms-swift's flag replaces the file's ``external_plugins``: the launcher moves the flag's files into the launch
    file with its own plugin and drops the flag, so the pack's callbacks stay registered."""
    seen = {}

    def fake_run(cmd, env=None, **kwargs):
        seen.update(cmd=cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(cli.subprocess, 'run', fake_run)
    data = case(['batch_growth'], GROWTH, external_plugins=['from_file.py'])
    assert cli.main(['sft', write(tmp_path, data), '--max_steps', '3', *flag]) == 0
    cmd = seen['cmd']
    assert cmd[5:] == ['--max_steps', '3']
    with open(cmd[4], encoding='utf-8') as f:
        launched = yaml.safe_load(f)
    files = ['mine.py', 'yours.py'] if len(flag) == 3 else ['mine.py']
    assert launched['external_plugins'] == files + [PLUGIN_FILE]


def test_unknown_name_is_a_note_when_other_plugins_may_register_it(tmp_path, capsys):
    data = case(['my_callback', 'batch_growth'], GROWTH, external_plugins=['my_plugin.py', PLUGIN_FILE])
    assert cli.main(['check', write(tmp_path, data)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("swift-dynamic: note: callbacks: 'my_callback' is neither a pack nor an ms-swift callback")
    assert 'external_plugins my_plugin.py' in err and 'not checked here' in err and PLUGIN_FILE not in err


def test_static_swift_callback_names_match_ms_swift():
    # a fresh process: in this one, sdc.register() may have added the pack's names to callbacks_map
    code = 'import json; from swift.callbacks import callbacks_map; print(json.dumps(sorted(callbacks_map)))'
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(SWIFT_CALLBACKS) == json.loads(result.stdout.strip().split('\n')[-1])


def test_the_pack_names_match_the_callback_classes():
    from swift_dynamic_callbacks.config.pack import CALLBACK_CONFIGS
    from swift_dynamic_callbacks.integrations.swift import CALLBACKS
    assert {n: c.config_class for n, c in CALLBACKS.items()} == CALLBACK_CONFIGS
    assert not set(CALLBACKS) & set(SWIFT_CALLBACKS)


def test_conflicting_callbacks_are_refused_at_trainer_construction():
    """Python use through ms-swift: the factory refuses the pair before it builds anything."""
    from types import SimpleNamespace

    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        plugin.register({'batch_schedule': {'schedule': {0: 2}}})
        args = SimpleNamespace(callbacks=['batch_schedule', 'batch_growth'])
        with pytest.raises(ConfigError, match='batch_schedule and batch_growth both request'):
            plugin._factory('batch_schedule')(args, SimpleNamespace())
    finally:
        plugin.unregister()


# ---- the environment variable -----------------------------------------------------------------------------------


@pytest.mark.parametrize('raw,words', [
    ('{"batch_growth": ', ['not valid inline JSON']),
    ('[1, 2]', ['expected a mapping', 'list']),
    ('{"batch_growth": {"factor": NaN}}', ['batch_growth.factor', 'nan']),
    ('5', ["'5' is neither inline JSON"]),
    ('no/such/file.yaml', ["'no/such/file.yaml' is neither inline JSON"]),
])
def test_env_config_errors_name_the_variable(raw, words):
    with pytest.raises(ConfigError) as info:
        load_env_config({ENV_CONFIG: raw})
    message = str(info.value)
    assert message.startswith(ENV_CONFIG), message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize('content,words', [
    ('', ['is empty']),
    ('a: [1, 2\n', ['cannot read', 'as YAML']),
    ('- 1\n- 2\n', ['expected a mapping', 'list']),
    ('42\n', ['expected a mapping', 'int']),
    ('dynamic_callbacks: 5\n', ['expected a mapping', 'int']),
    ('dynamic_callbacks:\n  batch_growth: {factor: .nan}\n', ['dynamic_callbacks.batch_growth.factor']),
    ('{"batch_growth": {"initial": 0}}', ['batch_growth.initial: must be >= 1']),
])
def test_env_config_file_errors_name_the_variable(tmp_path, content, words):
    path = tmp_path / 'pack.yaml'
    path.write_text(content, encoding='utf-8')
    with pytest.raises(ConfigError) as info:
        load_env_config({ENV_CONFIG: str(path)})
    message = str(info.value)
    assert message.startswith(ENV_CONFIG), message
    for word in words:
        assert word in message, message


def test_env_config_good_forms(tmp_path):
    assert load_env_config({}) is None and load_env_config({ENV_CONFIG: ''}) is None
    inline = load_env_config({ENV_CONFIG: '{"batch_growth": {"initial": 2}}'})
    path = tmp_path / 'pack.yaml'
    path.write_text('dynamic_callbacks:\n  batch_growth: {initial: 2}\n', encoding='utf-8')
    assert load_env_config({ENV_CONFIG: str(path)}) == inline
    path.write_text('batch_growth: {initial: 2}\n', encoding='utf-8')  # just the section's content
    assert load_env_config({ENV_CONFIG: str(path)}) == inline


# ---- launching -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize('command', ['sft', 'rlhf', 'pt'])
def test_launch_runs_swift_command_on_the_rest_of_the_file(tmp_path, monkeypatch, command):
    seen = {}

    def fake_run(cmd, env=None, **kwargs):
        seen.update(cmd=cmd, env=env)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(cli.subprocess, 'run', fake_run)
    data = case(['batch_growth'], {'batch_growth': {'initial': 2}}, rlhf_type='dpo')
    assert cli.main([command, write(tmp_path, data), '--max_steps', '3']) == 0
    cmd = seen['cmd']
    assert cmd[:3] == [sys.executable, '-c', 'from swift.cli.main import cli_main; cli_main()']
    assert cmd[3] == command and cmd[5:] == ['--max_steps', '3']
    with open(cmd[4], encoding='utf-8') as f:
        launched = yaml.safe_load(f)
    assert 'dynamic_callbacks' not in launched and launched['external_plugins'] == [PLUGIN_FILE]
    assert launched['rlhf_type'] == 'dpo'
    assert json.loads(seen['env'][ENV_CONFIG])['batch_growth'] == {'initial': 2}
    assert cli.build_command('rlhf', 'x.yaml', ['--a', '1'])[3:] == ['rlhf', 'x.yaml', '--a', '1']
    with pytest.raises(ValueError, match='command'):
        cli.build_command('infer', 'x.yaml', [])


_PROBE = r'''
import json, subprocess, sys
from swift_dynamic_callbacks import cli
rc_check = cli.main(['check', sys.argv[1]])
subprocess.run = lambda cmd, env=None, **kw: subprocess.CompletedProcess(cmd, 0)  # launch nothing
rc_sft = cli.main(['sft', sys.argv[1]])
rc_rlhf = cli.main(['rlhf', sys.argv[2]])  # swift rlhf: nothing that splits a micro-batch of pairs
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'peft', 'swift'))
print(json.dumps({'rc': [rc_check, rc_sft, rc_rlhf], 'heavy': heavy}))
'''


def test_check_and_launch_import_no_torch_transformers_peft_or_swift(tmp_path):
    every = ['batch_growth', 'lr_schedule', 'memory_backoff', 'length_batching', 'early_stopping',
             'checkpoint_rotation', 'training_log']
    data = case(every, {'batch_growth': {'micro_batch_cap': 4}, 'early_stopping': {'monitor': 'loss'},
                        'checkpoint_rotation': {'metric': 'loss'}, 'integration': {'record_samples': True}})
    pairs = case([n for n in every if n != 'memory_backoff'], {'early_stopping': {'monitor': 'loss'},
                                                                'checkpoint_rotation': {'metric': 'loss'}})
    (tmp_path / 'pairs').mkdir()
    result = subprocess.run([sys.executable, '-c', _PROBE, write(tmp_path, data), write(tmp_path / 'pairs', pairs)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout.strip().split('\n')[-1])
    assert probe['rc'] == [0, 0, 0], result.stderr
    assert probe['heavy'] == []


def test_package_attributes_load_lazily():
    code = ('import sys, swift_dynamic_callbacks as sdc; light = "torch" not in sys.modules; '
            'cfg = sdc.BatchGrowthConfig(initial=2); light2 = "torch" not in sys.modules; '
            'from swift_dynamic_callbacks.callbacks import BatchGrowthConfig; '
            'print(light, light2, BatchGrowthConfig is type(cfg), callable(sdc.install), "torch" in sys.modules)')
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ['True', 'True', 'True', 'True', 'True'], result.stderr[-2000:]


def test_function_importing_torch_is_checked_in_the_training_process(tmp_path):
    (tmp_path / 'heavy_sizes.py').write_text('import torch\n\ndef size(step, batch_size):\n    return batch_size\n',
                                             encoding='utf-8')
    (tmp_path / 'light_sizes.py').write_text('def size(step, batch_size):\n    return 0\n', encoding='utf-8')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get('PYTHONPATH', '')]))
    heavy = write(tmp_path, case(['batch_growth'], {'batch_growth': {'policy': 'callable',
                                                                     'function': 'heavy_sizes:size'}}), 'heavy.yaml')
    code = ('import sys; from swift_dynamic_callbacks import cli; rc = cli.main(["check", sys.argv[1]]); '
            'print("RC", rc, "torch" in sys.modules, "heavy_sizes" in sys.modules)')
    result = subprocess.run([sys.executable, '-c', code, heavy], capture_output=True, text=True, env=env, timeout=120)
    assert 'RC 0 False False' in result.stdout, result.stdout + result.stderr
    assert "note: batch_growth.function: 'heavy_sizes:size' imports torch" in result.stderr
    assert 'checked when the trainer is built' in result.stderr
    light = write(tmp_path, case(['batch_growth'], {'batch_growth': {'policy': 'callable',
                                                                     'function': 'light_sizes:size'}}), 'light.yaml')
    result = subprocess.run([sys.executable, '-c', code, light], capture_output=True, text=True, env=env, timeout=120)
    assert 'RC 2 False' in result.stdout, result.stdout + result.stderr
    assert ('dynamic_callbacks.batch_growth.function: batch_growth.function returned 0 for (step=0, batch_size=1)'
            in result.stderr)
    # in the training process (torch loaded) the heavy one is imported and checked
    sys.path.insert(0, str(tmp_path))
    try:
        from swift_dynamic_callbacks.config.batch_growth import BatchGrowthConfig
        assert BatchGrowthConfig(policy='callable', function='heavy_sizes:size').resolved_function()(3, 2) == 2
    finally:
        sys.path.remove(str(tmp_path))


def test_which_python_loss_functions_count_as_custom():
    """ms-swift's own causal-LM loss (``loss_type: cross_entropy``) and a declared token sum pass; anything else is
    named in the refusal."""
    from swift.loss.causal_lm import CustomCrossEntropyLoss

    from swift_dynamic_callbacks.config.rules import custom_loss_name, mark_token_sum_loss

    def mean_loss(outputs, labels, num_items_in_batch=None):
        return outputs.loss

    assert custom_loss_name(None) is None
    assert custom_loss_name(CustomCrossEntropyLoss(None, None)) is None
    assert custom_loss_name(mean_loss).endswith('mean_loss')
    assert custom_loss_name(mark_token_sum_loss(mean_loss)) is None


def test_the_settings_table_holds_every_ms_swift_argument():
    """The vendored table of ms-swift's arguments (``config/swift_args.json``) against the installed ms-swift: every
    field is in it, with its type and the commands that take it (the table may hold more: it is the union over the
    transformers versions the pack supports). After an upgrade: ``python -m swift_dynamic_callbacks.config.
    swift_settings``."""
    from swift_dynamic_callbacks.config.swift_settings import fields, generate
    table = fields()
    for name, spec in generate()['fields'].items():
        assert name in table, name
        assert table[name]['type'] == spec['type'] or table[name]['type'] == 'any', (name, spec, table[name])
        assert set(spec['commands']) <= set(table[name]['commands']), name
        assert not spec['choices'] or set(spec['choices']) <= set(table[name]['choices'] or spec['choices']), name


def test_check_is_fast_and_imports_no_ms_swift(tmp_path):
    """``check`` of a shipped config in a fresh interpreter: under a second, without torch or ms-swift."""
    import time
    config = os.path.join(os.path.dirname(__file__), '..', 'configs', 'qwen2_5_7b_lora_all.yaml')
    code = ('import sys, time; t = time.perf_counter(); from swift_dynamic_callbacks import cli; '
            f'rc = cli.main(["check", {config!r}]); '
            'heavy = [m for m in ("torch", "transformers", "swift") if m in sys.modules]; '
            'print(rc, round(time.perf_counter() - t, 3), heavy, file=sys.stderr)')
    start = time.perf_counter()
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60)
    rc, seconds, heavy = result.stderr.strip().split('\n')[-1].split(' ', 2)
    assert rc == '0' and heavy == '[]', result.stderr
    assert float(seconds) < 1.0, (seconds, time.perf_counter() - start)

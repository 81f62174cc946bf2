"""Every rule the pack checks both before launch and at train start is written once (``config/rules.py``): the
launch check (from the YAML) and the train-start check (from the trainer) refuse the same runs with the same message.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.config.integration import IntegrationConfig
from swift_dynamic_callbacks.config.launch import LAUNCH_RULES, check_run
from swift_dynamic_callbacks.config.pack import parse_section
from swift_dynamic_callbacks.integrations.data import check_supported


def launch_message(settings, section=None):
    section = section or {'batch_schedule': {'schedule': {0: 2}}}
    listed = [name for name in section if name != 'integration']
    pack = parse_section(section, listed)
    with pytest.raises(ConfigError) as e:
        check_run(pack, {'model': 'm', 'callbacks': listed, **settings})
    return str(e.value)


def start_message(args, *, template=None, streaming=False, config=None):
    trainer = SimpleNamespace(args=SimpleNamespace(**{'dataloader_drop_last': False, 'auto_find_batch_size': False,
                                                      'max_steps': -1, **args}),
                              template=template or SimpleNamespace(sequence_parallel_size=1))
    with pytest.raises(ConfigError) as e:
        check_supported(trainer, config, streaming=streaming)
    return str(e.value)


@pytest.mark.parametrize('settings,args,template,streaming', [
    ({'dataloader_drop_last': True}, {'dataloader_drop_last': True}, None, False),
    ({'auto_find_batch_size': True}, {'auto_find_batch_size': True}, None, False),
    ({'sequence_parallel_size': 2, 'streaming': True, 'max_steps': 10}, {'max_steps': 10},
     SimpleNamespace(sequence_parallel_size=2), True),
    ({'streaming': True}, {'max_steps': -1}, None, True),
], ids=['drop_last', 'auto_find_batch_size', 'sequence_parallel_stream', 'stream_without_max_steps'])
def test_launch_and_start_refuse_with_one_message(settings, args, template, streaming):
    assert launch_message(settings) == start_message(args, template=template, streaming=streaming)


def test_a_stream_counted_in_samples_is_refused_alike():
    section = {'batch_schedule': {'schedule': {0: 2}}, 'integration': {'max_steps_unit': 'samples'}}
    config = IntegrationConfig(max_steps_unit='samples')
    assert launch_message({'streaming': True, 'max_steps': 10}, section) == start_message(
        {'max_steps': 10}, streaming=True, config=config)


def test_noise_scale_needs_two_passes_alike():
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback, BatchGrowthConfig
    growth = {'policy': 'noise_scale', 'initial': 1, 'maximum': 8}
    at_launch = launch_message({'gradient_accumulation_steps': 1}, {'batch_growth': growth})
    with pytest.raises(ConfigError) as e:
        BatchGrowthCallback(BatchGrowthConfig(**growth)).on_train_begin(
            TrainingArguments(output_dir='unused', gradient_accumulation_steps=1, report_to=[]), TrainerState(),
            TrainerControl())
    assert str(e.value) == at_launch


def test_the_training_log_noise_scale_needs_two_passes_alike():
    """``training_log: {noise_scale: true}`` reads the same probe as the growth policy: two passes a step, not with
    pass_tokens; its decay only with it."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from swift_dynamic_callbacks.callbacks.training_log import TrainingLogCallback
    from swift_dynamic_callbacks.config.training_log import TrainingLogConfig
    log = {'training_log': {'noise_scale': True}}
    at_launch = launch_message({'gradient_accumulation_steps': 1}, log)
    assert at_launch.startswith('dynamic_callbacks.training_log.noise_scale needs at least two forward/backward')
    with pytest.raises(ConfigError) as e:
        TrainingLogCallback(TrainingLogConfig(noise_scale=True)).on_train_begin(
            TrainingArguments(output_dir='unused', gradient_accumulation_steps=1, report_to=[]), TrainerState(),
            TrainerControl())
    assert str(e.value) == at_launch
    merged = launch_message({'gradient_accumulation_steps': 2},
                            {**log, 'length_batching': {'mode': 'balanced', 'pass_tokens': 4096}})
    assert merged.startswith('dynamic_callbacks.length_batching.pass_tokens cannot be combined with '
                             'dynamic_callbacks.training_log.noise_scale')
    with pytest.raises(ConfigError) as e:
        parse_section({'training_log': {'noise_decay': 0.9}}, ['training_log'])
    assert str(e.value).startswith('dynamic_callbacks.training_log.noise_decay: only read by noise_scale: true')


def test_check_run_is_a_list_of_small_named_rules():
    assert len(LAUNCH_RULES) >= 10 and all(rule.__name__.startswith('_') for rule in LAUNCH_RULES)
    import inspect
    assert all(len(inspect.getsource(rule).splitlines()) <= 20 for rule in LAUNCH_RULES)


def test_hfs_token_counter_under_several_processes_needs_transformers_5_alike(monkeypatch):
    """transformers before 5 counts input tokens inline (one gather a non-empty slot): refused under several
    processes, at launch and at start alike; transformers 5 (the pack's per-slot count), one process or the counter
    off run."""
    import transformers

    from swift_dynamic_callbacks import distributed
    from swift_dynamic_callbacks.config import launch
    monkeypatch.setenv('NPROC_PER_NODE', '2')
    monkeypatch.setattr(launch, '_transformers_major', lambda: 4)
    monkeypatch.setattr(distributed, 'world_size', lambda: 2)
    monkeypatch.delattr(transformers.Trainer, '_track_num_input_tokens', raising=False)
    at_launch = launch_message({'include_num_input_tokens_seen': True})
    assert at_launch.startswith('include_num_input_tokens_seen: on under 2 processes needs transformers >= 5')
    assert start_message({'include_num_input_tokens_seen': 'all'}) == at_launch
    monkeypatch.setattr(launch, '_transformers_major', lambda: 5)
    pack = parse_section({'batch_schedule': {'schedule': {0: 2}}}, ['batch_schedule'])
    check_run(pack, {'model': 'm', 'callbacks': ['batch_schedule'], 'include_num_input_tokens_seen': True})
    monkeypatch.setenv('NPROC_PER_NODE', '1')
    monkeypatch.setattr(launch, '_transformers_major', lambda: 4)
    check_run(pack, {'model': 'm', 'callbacks': ['batch_schedule'], 'include_num_input_tokens_seen': True})


def test_recovery_true_with_ms_swifts_packing_is_refused_alike():
    """``oom_recovery: true`` with ms-swift's ``packing`` / ``padding_free``: a micro-batch is one packed row of many
    samples, which recovery cannot cut (before, recovery stayed on and an OOM ran the packed row again as if it were
    one sample, then named it a "single sample" too large): refused at launch and at start with one message; with
    ``auto`` the step runner turns recovery off and says why."""
    from swift_dynamic_callbacks.integrations.engines import Engine
    from swift_dynamic_callbacks.integrations.steps import StepRunner
    section = {'batch_schedule': {'schedule': {0: 2}}, 'integration': {'oom_recovery': True}}
    at_launch = launch_message({'padding_free': True}, section)
    assert 'packing / padding_free' in at_launch
    assert at_launch == start_message({'padding_free': True}, config=IntegrationConfig(oom_recovery=True))
    trainer = SimpleNamespace(args=SimpleNamespace(padding_free=True, packing=False, loss_type=None,
                                                   label_smoothing_factor=0.0, router_aux_loss_coef=0.0),
                              template=None, state=SimpleNamespace(global_step=0), model=None, task_type=None,
                              compute_loss_func=None,
                              callback_handler=SimpleNamespace(callbacks=[]))
    runner = StepRunner(trainer, Engine(trainer), oom_recovery=False, single_sample_retries=0)
    record = runner.begin(IntegrationConfig(), {})
    assert record.values['oom_recovery'] is False and 'packing / padding_free' in record.values['oom_recovery_off']

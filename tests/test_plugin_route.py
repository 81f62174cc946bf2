"""The ``swift sft`` and Python routes run every launch check of the pack on ms-swift's parsed arguments before the
model loads (``integrations.swift.check_pipeline`` -> ``config.launch.check_settings``), as ``swift-dynamic check``
does on a YAML. Each setting below used to be refused only once training had started, after the model and the data
had loaded."""

from __future__ import annotations

import os
import traceback

import pytest

from swift_dynamic_callbacks.config import ConfigError

#: a run that evaluates (a quarter of the rows held out)
EVAL = {'split_dataset_ratio': 0.25, 'eval_strategy': 'steps', 'eval_steps': 2}
#: (pack settings, ms-swift settings that make the run refused, the same settings allowed, words of the refusal)
CASES = {
    'rotation_and_save_total_limit': ({'checkpoint_rotation': {'keep_last': 2, 'metric': 'loss'}},
                                      {'save_total_limit': 2}, {'save_total_limit': None},
                                      'save_total_limit: checkpoint_rotation deletes'),
    'eval_monitor_without_eval': ({'early_stopping': {'monitor': 'eval_loss'}}, {'eval_strategy': 'no'},
                                  EVAL,
                                  "'eval_loss' is an evaluation metric but this run never evaluates"),
    'non_lambda_scheduler': ({'lr_schedule': {}}, {'lr_scheduler_type': 'reduce_lr_on_plateau', **EVAL},
                             {'lr_scheduler_type': 'cosine', **EVAL}, 'reduce_lr_on_plateau is not a LambdaLR'),
    'noise_probe_one_pass': ({'batch_growth': {'policy': 'noise_scale', 'initial': 1, 'maximum': 2}},
                             {'gradient_accumulation_steps': 1}, {'gradient_accumulation_steps': 2},
                             'batch_growth.policy: noise_scale'),
    'cpu_probe_without_budget': ({'memory_backoff': {}}, {'use_cpu': True}, {'use_cpu': False},
                                 'memory_backoff.cpu_budget_gib: use_cpu: true'),
    'optimizer_without_betas': ({'batch_growth': {'initial': 1, 'maximum': 2, 'beta2_scaling': 'half_life'}},
                                {'optim': 'sgd'}, {'optim': 'adamw_torch'}, 'beta2_scaling: half_life sets Adam'),
}


def _sft_args(tiny_qwen: str, dataset: str, out: str, listed: list[str], **settings):
    from swift import SftArguments

    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
    return SftArguments(**offline_sft_kwargs(tiny_qwen, dataset, out, callbacks=listed, **settings))


@pytest.mark.parametrize('case', list(CASES))
def test_the_python_route_refuses_before_the_model_loads(case, tmp_path, tiny_qwen, gsm8k_16):
    """``sdc.register(...)`` then ``sft_main(SftArguments(...))``: the refusal is raised by ``check_pipeline`` and no
    model or tokenizer was built (the traceback has no loader frame); the same run with the setting changed is not
    refused there. The ms-swift settings reach the rules parsed (``lr_scheduler_type``, ``optim``, ``eval_strategy``:
    HF's enums), so this also shows the rules read them as a YAML's."""
    from swift import sft_main

    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations.swift import check_pipeline
    section, refused, allowed, words = CASES[case]
    listed = list(section)
    sdc.register(section)
    try:
        with pytest.raises(ConfigError, match=words) as caught:
            sft_main(_sft_args(tiny_qwen, gsm8k_16, str(tmp_path / 'refused'), listed, **refused))
        frames = traceback.extract_tb(caught.value.__traceback__)
        names = [frame.name for frame in frames]
        # raised in the pack's wrapper of _prepare_model_tokenizer, before it calls ms-swift's (which loads the model)
        assert names[names.index('check_pipeline') - 1] == 'checked', names
        assert not any(f'{os.sep}swift{os.sep}model{os.sep}' in frame.filename for frame in frames), names
        check_pipeline(_sft_args(tiny_qwen, gsm8k_16, str(tmp_path / 'allowed'), listed, **allowed))
    finally:
        sdc.unregister()


def test_parsed_settings_read_as_a_yaml():
    """Enums become their values, ``None`` is left out (an absent key: ms-swift's default to the rules)."""
    from types import SimpleNamespace

    from transformers.trainer_utils import IntervalStrategy, SchedulerType

    from swift_dynamic_callbacks.integrations.swift import parsed_settings
    args = SimpleNamespace(eval_strategy=IntervalStrategy.NO, lr_scheduler_type=SchedulerType.COSINE,
                           save_total_limit=None, deepspeed={'zero_optimization': {'stage': 3}}, _private=1)
    assert parsed_settings(args) == {'eval_strategy': 'no', 'lr_scheduler_type': 'cosine',
                                     'deepspeed': {'zero_optimization': {'stage': 3}}}

"""``swift rlhf --rlhf_type grpo`` with the pack: the run-level callbacks (``lr_schedule``, ``early_stopping`` on a
reward, ``checkpoint_rotation`` keeping the best by a reward, ``training_log``) decide the run through their flags
while GRPO draws its own prompts and runs its own passes; what would build its batches or cut its passes is refused
before the model loads on every route. Real GRPO trainings of the tiny Qwen2 (no vLLM, 2 generations a prompt, a
reward that varies: the completion's length)."""

from __future__ import annotations

import os

import pytest

from swift_runs import decisions, read_jsonl

pytestmark = pytest.mark.skipif(__import__('importlib').util.find_spec('msgspec') is None,
                                reason="ms-swift's GRPO imports msgspec (the grpo extra)")

REWARD_PLUGIN = '''from swift.rewards import orms
from swift.rewards.orm import ORM


class CompletionLength(ORM):
    """A reward that differs between the completions of a prompt: the completion's characters / 100."""

    def __call__(self, completions, **kwargs):
        return [len(text) / 100 for text in completions]


orms['completion_length'] = CompletionLength
'''

#: the run-level callbacks, each deciding something within 6 steps: warmup, a stop on the reward (no improvement of
#: 10 in 2 checks), the last and the best checkpoint by the reward
PACK = {'lr_schedule': {'warmup': 2, 'hold': 0},
        'early_stopping': {'monitor': 'reward', 'mode': 'max', 'patience': 2, 'min_delta': 10.0},
        'checkpoint_rotation': {'keep_last': 1, 'keep_best': 1, 'metric': 'reward', 'mode': 'max'},
        'training_log': {}}


def _grpo_kwargs(model, prompts, plugin, out, **extra):
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
    kwargs = offline_sft_kwargs(model, prompts, out, arch='qwen2', callbacks=list(PACK), max_steps=8,
                                per_device_train_batch_size=2, save_steps=1, gradient_checkpointing=False,
                                learning_rate=1e-3)
    kwargs.update(rlhf_type='grpo', reward_funcs=['completion_length'], external_plugins=[plugin], use_vllm=False,
                  num_generations=2, max_completion_length=16, temperature=1.0, **extra)
    return kwargs


@pytest.fixture
def grpo_inputs(tmp_path, tiny_qwen):
    from swift_dynamic_callbacks.testing.tiny import write_prompt_dataset
    plugin = tmp_path / 'reward_plugin.py'
    plugin.write_text(REWARD_PLUGIN, encoding='utf-8')
    return tiny_qwen, str(write_prompt_dataset(tmp_path / 'prompts.jsonl', 8)), str(plugin)


def _check_run_level(out: str) -> None:
    """What each run-level callback requested, and what the run shows of it."""
    records = decisions(out)
    [mode] = [d for d in records if d['kind'] == 'mode']
    assert mode['reason'] == 'run_level' and mode['values']['rlhf_type'] == 'grpo'
    assert mode['values']['trainer'] == 'GRPOTrainer' and set(mode['values']['callbacks']) == set(PACK)
    [schedule] = [d for d in records if d['kind'] == 'applied_request']
    assert schedule['step'] == 0 and schedule['values']['lr_schedule']['warmup'] == 2
    logs = [row for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'loss' in row]
    assert logs[0]['learning_rate'] == 0.0 and logs[1]['learning_rate'] == pytest.approx(5e-4)  # the pack's warmup
    assert all('reward' in row and 'dynamic/lr_scale' in row for row in logs)
    [stop] = [d for d in records if d['kind'] == 'stop']
    assert stop['reason'] == 'patience' and stop['values']['monitor'] == 'reward' and stop['step'] == 3
    assert len(logs) == 3  # stopped at step 3 of 8: the first reward, then two checks without a gain of 10
    rewards = {i + 1: row['reward'] for i, row in enumerate(logs)}
    kept = sorted(n for n in os.listdir(out) if n.startswith('checkpoint-'))
    best = max(rewards, key=rewards.get)
    assert kept == sorted({f'checkpoint-{len(logs)}', f'checkpoint-{best}'}), (kept, rewards)
    assert [d for d in records if d['kind'] == 'delete_checkpoint']
    assert os.path.getsize(os.path.join(out, 'dynamic_training_log.jsonl')) > 0


@pytest.mark.e2e
def test_grpo_runs_the_run_level_callbacks(grpo_inputs, tmp_path):
    """One process, the Python route: the LR warms up as ``lr_schedule`` asked (the cosine HF would run replaced),
    ``early_stopping`` stops on the reward, ``checkpoint_rotation`` keeps the last and the best checkpoint by the
    reward, ``training_log`` writes its file; GRPO's own batches (2 completions a prompt) are untouched."""
    import swift_dynamic_callbacks as sdc
    from swift import RLHFArguments, rlhf_main
    from swift_dynamic_callbacks.integrations import swift as plugin
    model, prompts, reward = grpo_inputs
    out = str(tmp_path / 'out')
    try:
        sdc.register(**PACK)
        rlhf_main(RLHFArguments(**_grpo_kwargs(model, prompts, reward, out)))
    finally:
        plugin.unregister()
    _check_run_level(out)


@pytest.mark.e2e
def test_grpo_refuses_a_batch_callback_before_the_model_loads(grpo_inputs, tmp_path, monkeypatch):
    """The Python route (and the plugin route, which imports the same registration): ``batch_growth`` under GRPO is
    refused once ms-swift has parsed the arguments, before the model loads, naming rlhf_type and why (at 03097fd the
    plugin route loaded the model and then stopped on ``dataloader_drop_last``, a setting GRPO sets itself)."""
    import swift_dynamic_callbacks as sdc
    from swift import RLHFArguments, rlhf_main
    from swift.arguments import BaseArguments

    from swift_dynamic_callbacks.config import ConfigError
    from swift_dynamic_callbacks.integrations import swift as plugin
    model, prompts, reward = grpo_inputs

    def no_model(self, *args, **kwargs):
        raise AssertionError('the model was loaded')

    monkeypatch.setattr(BaseArguments, 'get_model_processor', no_model)
    kwargs = _grpo_kwargs(model, prompts, reward, str(tmp_path / 'out'))
    kwargs['callbacks'] = ['lr_schedule', 'batch_growth']
    try:
        sdc.register(lr_schedule={}, batch_growth={})
        with pytest.raises(ConfigError, match='rlhf_type: grpo cannot be combined with callbacks: batch_growth: its '
                                              'trainer draws each step'):
            rlhf_main(RLHFArguments(**kwargs))
    finally:
        plugin.unregister()


@pytest.mark.e2e
def test_gkd_runs_the_run_level_callbacks(tmp_path, tiny_qwen):
    """``rlhf_type: gkd`` (the tiny model its own teacher): ``lr_schedule`` and ``training_log`` run at the step
    boundary while GKD generates its on-policy completions; the LR the steps log is the pack's warmup."""
    import swift_dynamic_callbacks as sdc
    from swift import RLHFArguments, rlhf_main
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs, write_gsm8k_dataset
    data = str(write_gsm8k_dataset(tmp_path / 'gsm8k.jsonl', 8))
    out = str(tmp_path / 'out')
    kwargs = offline_sft_kwargs(tiny_qwen, data, out, arch='qwen2', callbacks=['lr_schedule', 'training_log'],
                                max_steps=3, per_device_train_batch_size=2, gradient_checkpointing=False)
    kwargs.update(rlhf_type='gkd', teacher_model=tiny_qwen, max_completion_length=16)
    try:
        sdc.register(lr_schedule={'warmup': 2, 'hold': 0}, training_log={})
        rlhf_main(RLHFArguments(**kwargs))
    finally:
        plugin.unregister()
    [mode] = [d for d in decisions(out) if d['kind'] == 'mode']
    assert (mode['values']['rlhf_type'], mode['values']['trainer']) == ('gkd', 'GKDTrainer')
    logs = [row for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'loss' in row]
    assert [row['learning_rate'] for row in logs] == pytest.approx([0.0, 5e-4, 1e-3])

"""GRPO's training phase cut into passes by tokens (``integration.grpo_pass_tokens``): real ``swift rlhf --rlhf_type
grpo`` trainings of the tiny Qwen2 (no vLLM, a reward that varies: the completion's length) against the same run
with GRPO's own one pass a micro-batch. The completions are sampled from the same seed, so the steps whose rewards
agree trained on the same completions: their loss and grad_norm must agree."""

from __future__ import annotations

import os

import pytest

from swift_runs import decisions, read_jsonl
from test_grpo import REWARD_PLUGIN

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(__import__('importlib').util.find_spec('msgspec') is None,
                                 reason="ms-swift's GRPO imports msgspec (the grpo extra)")]


@pytest.fixture(scope='module')
def grpo_data(tmp_path_factory, tiny_qwen):
    from swift_dynamic_callbacks.testing.tiny import write_prompt_dataset
    root = tmp_path_factory.mktemp('grpo-passes')
    plugin = root / 'reward_plugin.py'
    plugin.write_text(REWARD_PLUGIN, encoding='utf-8')
    return tiny_qwen, str(write_prompt_dataset(root / 'prompts.jsonl', 8)), str(plugin)


def _run(data, out: str, integration: dict | None, *, faults: dict | None = None, pack: dict | None = None,
         stop_at: int | None = None, **extra) -> list[dict]:
    """One GRPO run (Python route, 4 completions of 2 prompts a micro-batch, 2 steps) with ``training_log`` listed
    (or the callbacks of ``pack``); ``stop_at``: the run ends after that step (and its checkpoint), as one killed
    there. Returns its logged steps."""
    import swift_dynamic_callbacks as sdc
    from swift import RLHFArguments, rlhf_main
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
    model, prompts, reward = data
    pack = pack or {'training_log': {}}
    from swift.callbacks import callbacks_map
    kwargs = offline_sft_kwargs(model, prompts, out, arch='qwen2', callbacks=list(pack), max_steps=2,
                                per_device_train_batch_size=4, gradient_checkpointing=False, learning_rate=1e-3,
                                seed=7, lora_dropout=0.0)  # dropout masks would differ by pass
    kwargs.update(rlhf_type='grpo', reward_funcs=['completion_length'], external_plugins=[reward], use_vllm=False,
                  num_generations=2, max_completion_length=16, temperature=1.0)
    kwargs.update(extra)
    if stop_at is not None:
        callbacks_map['_test_stop_at'] = lambda args, trainer: _StopAt(stop_at)
        kwargs['callbacks'] = kwargs['callbacks'] + ['_test_stop_at']
    injector = None
    try:
        sdc.register(**pack, integration=integration or {})
        if faults:
            from swift_dynamic_callbacks.testing.faults import OomInjector
            injector = OomInjector(**faults).install()
        rlhf_main(RLHFArguments(**kwargs))
    finally:
        plugin.unregister()
        callbacks_map.pop('_test_stop_at', None)
        if injector is not None:
            injector.remove()
    return [row for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'loss' in row]


class _StopAt(__import__('transformers').TrainerCallback):
    """Ends a run after step ``step`` (its checkpoint written first): a run killed right after a checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def _same_steps(a: list[dict], b: list[dict], rel: float) -> None:
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert y['reward'] == pytest.approx(x['reward'], rel=1e-6), (x, y)  # the same completions
        assert y['loss'] == pytest.approx(x['loss'], rel=rel, abs=1e-7), (x, y)
        assert y['grad_norm'] == pytest.approx(x['grad_norm'], rel=rel, abs=1e-7), (x, y)


@pytest.mark.parametrize('loss_type', ['grpo'] + [pytest.param(t, marks=pytest.mark.slow)  # weights: test_rl_passes
                                                   for t in ('bnpo', 'dr_grpo', 'dapo')])
def test_passes_of_one_completion_give_the_one_pass_gradient(grpo_data, tmp_path, loss_type):
    """Every completion its own pass (``grpo_pass_tokens: 1``: 4 passes a micro-batch, weighted by rows, completion
    tokens or the window as ``loss_type`` reduces; the old and reference log-probs, without a gradient, one completion
    a pass too): the loss and grad_norm of both steps within 1e-5 of GRPO's one pass; the passes are what the pack
    requested (a ``grpo_passes`` record, ``dynamic/grpo_passes`` and ``dynamic/grpo_logp_passes`` 4 a step)."""
    one = _run(grpo_data, str(tmp_path / 'one'), None, loss_type=loss_type)
    out = str(tmp_path / 'cut')
    cut = _run(grpo_data, out, {'grpo_pass_tokens': 1}, loss_type=loss_type)
    _same_steps(one, cut, 1e-5)
    [record] = [d for d in decisions(out) if d['kind'] == 'grpo_passes']
    assert record['values']['loss_type'] == loss_type and record['values']['grpo_pass_tokens'] == 1
    assert record['values']['oom_recovery'] is True
    assert [row['dynamic/grpo_passes'] for row in cut] == [4, 4]
    assert [row['dynamic/grpo_logp_passes'] for row in cut] == [4, 4]  # the old / reference log-probs cut too
    assert all('dynamic/grpo_passes' not in row for row in one)


def test_grpo_pass_tokens_auto_plans_from_free_memory_with_the_one_pass_gradient(grpo_data, tmp_path, monkeypatch):
    """``grpo_pass_tokens: auto`` with 1 MiB of memory read as available (the CPU's figure: the budget is half of it
    less the margin, at the model's bytes a token): the smallest budget on a CPU, 16 tokens, below one completion, so
    every completion runs as its own pass; a ``pass_tokens`` record (reason ``auto``, setting ``grpo_pass_tokens``) and
    the ``grpo_passes`` record carry the resolved budget, and both steps equal GRPO's one pass (1e-5)."""
    from swift_dynamic_callbacks.integrations import auto_budget
    one = _run(grpo_data, str(tmp_path / 'one'), None)
    monkeypatch.setattr(auto_budget, '_available_cpu_bytes', lambda: 2**20)
    out = str(tmp_path / 'auto')
    cut = _run(grpo_data, out, {'grpo_pass_tokens': 'auto'})
    _same_steps(one, cut, 1e-5)
    records = decisions(out)
    [auto] = [d for d in records if d['kind'] == 'pass_tokens']
    assert auto['reason'] == 'auto' and auto['values']['setting'] == 'grpo_pass_tokens'
    assert auto['values']['pass_tokens'] == 16 and auto['values']['free_gib'] < 0.001
    [passes] = [d for d in records if d['kind'] == 'grpo_passes']
    assert passes['values']['grpo_pass_tokens'] == 16
    assert [row['dynamic/grpo_passes'] for row in cut] == [4, 4] and cut[0]['dynamic/pass_budget'] == 16


def test_an_oom_in_a_loss_pass_runs_its_halves_with_the_same_gradient(grpo_data, tmp_path):
    """One pass a micro-batch by the budget; its first forward runs out of memory (injected), then the first half's
    backward: the halves run instead (the quarters where the half failed), the second half re-cut at the step's cap
    (the step runner's rule), the gradient as the run without OOMs (2e-4), two ``oom`` records (the step runner's:
    pass sizes and tokens), the step's OOMs folded into the budget once at its boundary (a ``pass_budget`` record)."""
    clean = _run(grpo_data, str(tmp_path / 'clean'), {'grpo_pass_tokens': 100_000})
    out = str(tmp_path / 'oom')
    hit = _run(grpo_data, out, {'grpo_pass_tokens': 100_000},
               faults={'forward_passes': (0, ), 'fail_passes': (1, )})
    _same_steps(clean, hit, 1e-5)  # the goal is 2e-4; the halves give the same sums
    records = decisions(out)
    ooms = [d for d in records if d['kind'] == 'oom']
    assert [(d['reason'], d['values']['pass_size']) for d in ooms] == [('recovered', 4), ('recovered', 2)]
    assert all(d['values']['unit'] == 'tokens' and d['values']['phase'] == 'loss' for d in ooms)
    budgets = [d for d in records if d['kind'] == 'pass_budget']
    assert budgets[0]['reason'] == 'oom' and budgets[0]['values']['new'] < budgets[0]['values']['old']
    assert hit[0]['dynamic/oom_count'] == 2 and hit[0]['dynamic/grpo_passes'] == 4  # 4 quarters
    assert len([d for d in budgets if d['reason'] == 'oom']) == 1  # folded once


@pytest.mark.start_first
@pytest.mark.distributed
@pytest.mark.engines
def test_two_processes_pass_by_pass_give_the_one_pass_gradient_and_the_callbacks_run(grpo_data, tmp_path):
    """``NPROC_PER_NODE=2 swift-dynamic rlhf run.yaml`` (the user's route; real DDP on CPU) with the four run-level
    callbacks, every completion its own pass against GRPO's one pass a micro-batch: the loss and grad_norm (of the
    gradient DDP reduced) of every step within 1e-5; the run-level callbacks decide as on one process (a warmup, a stop
    on the reward at step 3, the last and the best checkpoint kept), the decisions written once."""
    import json
    import subprocess
    import sys

    import yaml

    from swift_runs import free_port
    from test_grpo import PACK, _check_run_level, _grpo_kwargs
    model, prompts, reward = grpo_data
    logs = []
    for name, integration in (('one', {}), ('cut', {'grpo_pass_tokens': 1})):
        out = str(tmp_path / name)
        config = _grpo_kwargs(model, prompts, reward, out, use_cpu=True, ddp_backend='gloo', seed=7, lora_dropout=0.0,
                              per_device_train_batch_size=4)
        config.update(report_to='none', dynamic_callbacks={**PACK, 'integration': integration})
        path = tmp_path / f'{name}.yaml'
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding='utf-8')
        env = {**os.environ, 'NPROC_PER_NODE': '2', 'MASTER_PORT': str(free_port()), 'OMP_NUM_THREADS': '1'}
        result = subprocess.run([sys.executable, '-m', 'swift_dynamic_callbacks.cli', 'rlhf', str(path)],
                                capture_output=True, text=True, env=env, timeout=900, start_new_session=True)
        assert result.returncode == 0, result.stderr[-4000:]
        logs.append([row for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'loss' in row])
    _check_run_level(out)
    written = [json.loads(line) for line in open(os.path.join(out, 'dynamic_decisions.jsonl'), encoding='utf-8')]
    assert len([d for d in written if d['kind'] == 'mode']) == 1
    one, cut = logs
    assert len(one) == len(cut) == 3  # both stopped at step 3
    for x, y in zip(one, cut):
        assert y['reward'] == pytest.approx(x['reward'], rel=1e-6), (x, y)  # the same completions
        assert y['loss'] == pytest.approx(x['loss'], rel=1e-5, abs=1e-7), (x, y)
        assert y['grad_norm'] == pytest.approx(x['grad_norm'], rel=1e-5, abs=1e-7), (x, y)
    assert [row['dynamic/grpo_passes'] for row in cut] == [4, 4, 4]


def test_grpo_pass_tokens_is_refused_where_passes_would_change_the_loss(grpo_data, tmp_path, monkeypatch):
    """``loss_type: real`` (a loss over whole groups) with ``grpo_pass_tokens``: refused once ms-swift parsed the
    arguments, before the model loads, naming both settings."""
    from swift.arguments import BaseArguments

    from swift_dynamic_callbacks.config import ConfigError

    def no_model(self, *args, **kwargs):
        raise AssertionError('the model was loaded')

    monkeypatch.setattr(BaseArguments, 'get_model_processor', no_model)
    with pytest.raises(ConfigError, match=r"grpo_pass_tokens: 512 cannot be used with loss_type: 'real'"):
        _run(grpo_data, str(tmp_path / 'out'), {'grpo_pass_tokens': 512}, loss_type='real')


@pytest.mark.parametrize('loss_type', ['bnpo', pytest.param('grpo', marks=pytest.mark.slow)])
def test_overlong_filter_passes_give_the_one_pass_gradient(grpo_data, tmp_path, loss_type):
    """``overlong_filter: true`` drops truncated completions from the loss inside ms-swift's loss call (after the batch
    reached the pack): every completion its own pass gives GRPO's one-pass loss and grad_norm (1e-5), truncated
    completions among them (bnpo's weights count the completion tokens the loss keeps, not the collated mask's)."""
    from swift_dynamic_callbacks.testing.tiny import build_stopping_model
    model, prompts, reward = grpo_data
    data = (str(build_stopping_model(tmp_path.parent / 'tiny-qwen2-stopping', model)), prompts, reward)
    extra = dict(loss_type=loss_type, overlong_filter=True)
    one = _run(data, str(tmp_path / 'one'), None, **extra)
    cut = _run(data, str(tmp_path / 'cut'), {'grpo_pass_tokens': 1}, **extra)
    truncated = [row.get('completions/clipped_ratio') for row in one]
    assert all(0 < t < 1 for t in truncated), truncated  # some completions truncated, not all: the case in question
    _same_steps(one, cut, 1e-5)


@pytest.mark.parametrize('integration', [pytest.param({}, marks=pytest.mark.slow),  # CI time: the same layout state
                                         {'grpo_pass_tokens': 1}], ids=['one_pass', 'pass_tokens'])
def test_a_resumed_grpo_run_trains_as_the_uninterrupted_one(grpo_data, tmp_path, integration):
    """GRPO with the pack (``lr_schedule`` and ``training_log``; with and without ``grpo_pass_tokens``) run 4 steps,
    and again to step 2 then resumed from its checkpoint: steps 3-4 log the uninterrupted run's loss, grad_norm and LR
    (1e-5), and the pack's state came back (a ``resume`` record, the budget of the passes)."""
    pack = {'lr_schedule': {'warmup': 1, 'hold': 0}, 'training_log': {}}
    whole = _run(grpo_data, str(tmp_path / 'whole'), integration, pack=pack, max_steps=4)
    out = str(tmp_path / 'resumed')
    _run(grpo_data, out, integration, pack=pack, max_steps=4, save_steps=2, stop_at=2)
    _run(grpo_data, out, integration, pack=pack, max_steps=4, save_steps=2,
         resume_from_checkpoint=os.path.join(out, 'checkpoint-2'))
    rows = [row for row in read_jsonl(os.path.join(out, 'logging.jsonl')) if 'loss' in row]
    later = rows[-2:]
    assert len(whole) == 4 and len(later) == 2
    for x, y in zip(whole[2:], later):
        assert y['reward'] == pytest.approx(x['reward'], rel=1e-6), (x, y)
        assert y['loss'] == pytest.approx(x['loss'], rel=1e-5, abs=1e-7), (x, y)
        assert y['grad_norm'] == pytest.approx(x['grad_norm'], rel=1e-5, abs=1e-7), (x, y)
        assert y['learning_rate'] == pytest.approx(x['learning_rate'], rel=1e-6), (x, y)
    assert [d for d in decisions(out) if d['kind'] == 'resume']

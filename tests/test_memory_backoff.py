"""Memory-pressure backoff and OOM-safe steps: policies, the callback with a fake probe, real runs with OOMs."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.callbacks.memory_backoff import MemoryBackoffCallback, MemoryBackoffConfig
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.testing.faults import OomInjector
from swift_dynamic_callbacks.device_memory import MemorySample, is_oom
from swift_dynamic_callbacks.policies.memory import PressureState, oom_backoff, pass_cap, pressure_step
from swift_runs import decisions, indices_by_epoch, run_sft, sample_trace, train_logs


def test_pass_cap_table():
    assert pass_cap(2000, None) is None
    seed = {'samples': None, 'tokens': None, 'rules': [[1024, 2]]}
    assert pass_cap(2000, seed) == 2 and pass_cap(1024, seed) is None  # "longest > 1024 -> 2"
    assert pass_cap(300, {'samples': None, 'tokens': 1000, 'rules': []}) == 3
    assert pass_cap(3000, {'samples': None, 'tokens': 1000, 'rules': []}) == 1  # never below one sample
    both = {'samples': 4, 'tokens': 1000, 'rules': [[512, 3], [2048, 1]]}
    assert [pass_cap(n, both) for n in (100, 600, 3000)] == [4, 1, 1]  # longest matching rule first


def test_oom_backoff_halves():
    assert [oom_backoff(n) for n in (8, 5, 2, 1)] == [4, 2, 1, 1]


KW = dict(high=0.85, low=0.6, clean_steps=3, shrink=0.5, grow=2.0, minimum=1)


def test_pressure_hysteresis_table():
    state, actions = PressureState(), []
    fractions = [0.5, 0.9, 0.7, 0.5, 0.5, 0.7, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    sizes = [8, 8, 4, 4, 4, 4, 4, 4, 4, 8, 8, 8]
    caps = []
    for f, size in zip(fractions, sizes):
        state, action = pressure_step(state, f, size, **KW)
        actions.append(action)
        caps.append(state.cap)
    # 0.9 > 0.85: back off 8 -> 4; 0.7 is inside the band (hold, count restarts); three clean steps: grow back to 8
    # = the pre-backoff size, so the cap is removed
    assert actions == [None, 'backoff', None, None, None, None, None, None, 'grow_back', None, None, None]
    assert caps == [None, 4, 4, 4, 4, 4, 4, 4, None, None, None, None]


@given(fractions=st.lists(st.floats(0, 1), max_size=60), size=st.integers(1, 64), minimum=st.integers(1, 8))
def test_pressure_cap_never_below_minimum_nor_above_start(fractions, size, minimum):
    state = PressureState()
    for f in fractions:
        state, _ = pressure_step(state, f, min(size, state.cap or size), **{**KW, 'minimum': minimum})
        if state.cap is not None:
            assert minimum <= state.cap < size


def test_a_backoff_never_raises_the_cap():
    """Under a token cap the largest pass can be one row over the cap (rows are never cut): half of it may be above
    the cap in force, and backing off to it would raise the cap: it holds instead."""
    state = PressureState(cap=297, clean=3, unlimited=2000, unit='tokens')
    assert pressure_step(state, 1.5, 614, **KW) == (PressureState(cap=297, clean=0, unlimited=2000, unit='tokens'),
                                                   None)
    assert pressure_step(state, 1.5, 400, **KW)[0].cap == 200  # a cut that lowers it still happens


def test_is_oom():
    assert is_oom(torch.OutOfMemoryError('x'))
    assert is_oom(RuntimeError('CUDA error: out of memory'))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"))
    assert not is_oom(RuntimeError('shape mismatch'))
    assert not is_oom(ValueError('out of memory'))
    from torch._dynamo.exc import TorchRuntimeError
    assert not is_oom(TorchRuntimeError('out of memory while autotuning'))  # a compile failure


class FakeProbe:
    name = 'fake'

    def __init__(self, fractions):
        self.fractions = list(fractions)
        self.resets = 0

    def read(self):
        f = self.fractions.pop(0)
        return MemorySample('fake', int(f * 100), int(f * 100), int(f * 100), 100)

    def reset_peak(self):
        self.resets += 1


def _args():
    from transformers import TrainingArguments
    return TrainingArguments(output_dir='unused', report_to=[])


def test_callback_follows_the_thresholds_exactly():
    from transformers import TrainerControl, TrainerState
    probe = FakeProbe([0.5, 0.86, 0.84, 0.59, 0.59])
    cb = MemoryBackoffCallback(MemoryBackoffConfig(clean_steps=2, length_rules={1024: 2}), probe=probe)
    control, args = TrainerControl(), _args()
    cb.on_train_begin(args, TrainerState(), control)
    assert control.new_pass_limit == {'samples': None, 'tokens': None, 'rules': [[1024, 2]]}
    protocol.clear_requests(control)
    requested = []
    for step, pass_size in enumerate([8, 8, 4, 4, 4], start=1):
        cb.on_step_begin(args, TrainerState(global_step=step - 1), control)
        control.pass_size = pass_size
        cb.on_step_end(args, TrainerState(global_step=step), control)
        requested.append(control.new_pass_limit['samples'] if control.new_pass_limit else '-')
        protocol.clear_requests(control)
    # 0.86 > 0.85: cap 4; 0.84 holds (in the band); two steps < 0.6: grow back to 8 = the size before: no cap
    assert requested == ['-', 4, '-', '-', None]
    assert probe.resets == 5
    assert control.dynamic_metrics['dynamic/memory_fraction'] == 0.59
    kinds = [(r.reason, r.values['new_cap']) for r in control.dynamic_decisions if r.kind == 'pass_limit'
             and r.reason != 'length_rules']
    assert kinds == [('backoff', 4), ('grow_back', None)]
    restored = MemoryBackoffCallback(cb.config, probe=probe)
    restored.load_state_dict(cb.state_dict())
    assert restored.state == cb.state and restored.started


def test_after_an_oom_the_callback_requests_nothing_and_counts_again():
    """The integration lowers (and grows back) its own pass budget after an OOM: the callback does not copy the cap
    (two controllers of one cap would grow it back twice); its count of clean steps restarts."""
    from transformers import TrainerControl, TrainerState
    cb = MemoryBackoffCallback(MemoryBackoffConfig(clean_steps=2), probe=FakeProbe([0.3, 0.3, 0.3]))
    control, args = TrainerControl(), _args()
    cb.on_train_begin(args, TrainerState(), control)
    cb.state = PressureState(cap=2, clean=1, unlimited=4)
    control.pass_size = 2
    control.oom_event = protocol.OomEvent(pass_size=4, new_cap=2, retries=1, memory={})
    cb.on_step_end(args, TrainerState(global_step=1), control)
    assert cb.state == PressureState(cap=2, clean=0, unlimited=4)
    assert getattr(control, 'new_pass_limit', None) is None
    control.oom_event = None
    cb.on_step_end(args, TrainerState(global_step=2), control)
    assert getattr(control, 'new_pass_limit', None) is None and cb.state.clean == 1  # one clean step of two
    cb.on_step_end(args, TrainerState(global_step=3), control)
    assert control.new_pass_limit['samples'] == 4 or control.new_pass_limit['samples'] is None


class TokenProbe(FakeProbe):
    """Memory that follows a pass's tokens: the fraction is the step's largest pass cost over ``capacity``."""

    def __init__(self, capacity):
        super().__init__([])
        self.capacity, self.cost = capacity, 0

    def read(self):
        used = int(100 * self.cost / self.capacity)
        return MemorySample('fake', used, used, used, 100)


def test_under_pass_tokens_the_cap_is_in_tokens_and_a_pass_keeps_its_rows():
    """Passes cut by pass_tokens 16,384: a step of two 8,192-token rows and a step of sixty-four 256-token rows cost
    the same memory. The callback caps tokens (never rows): the peak moves, the cap settles (at 10,240 tokens with
    grow 1.25), and a pass of short rows keeps 40 of them instead of ratcheting down to one row a pass."""
    from transformers import TrainerControl, TrainerState
    plan, probe = 16384, TokenProbe(capacity=14000)
    cb = MemoryBackoffCallback(MemoryBackoffConfig(clean_steps=2, grow=1.25), probe=probe)
    control, args = TrainerControl(), _args()
    cb.on_train_begin(args, TrainerState(), control)
    cap, requested, rows_run = None, [], []
    for step in range(1, 25):
        cb.on_step_begin(args, TrainerState(global_step=step - 1), control)
        budget = min(plan, cap or plan)  # the integration plans the passes within the cap
        length = 8192 if step % 2 else 256
        rows = max(1, budget // length)  # rows of the largest pass
        probe.cost = rows * length
        control.pass_size, control.pass_cost = rows, rows * length
        rows_run.append((length, rows))
        cb.on_step_end(args, TrainerState(global_step=step), control)
        limit = control.new_pass_limit
        if limit:
            assert limit['samples'] is None  # never a row cap under a token budget
            cap = limit['tokens']
            requested.append(cap)
        protocol.clear_requests(control)
    assert requested == [8192, 10240]
    assert cb.state.unit == 'tokens' and cb.state.cap == 10240
    assert control.dynamic_metrics['dynamic/pass_cap'] == 10240 and control.dynamic_metrics['dynamic/pass_cap_unit']
    assert min(rows for length, rows in rows_run if length == 256) == 32  # short rows: never one a pass
    backoffs = [r for r in control.dynamic_decisions if r.kind == 'pass_limit' and r.reason == 'backoff']
    assert backoffs and backoffs[0].values['unit'] == 'tokens' and 'tokens a pass' in backoffs[0].message
    restored = MemoryBackoffCallback(cb.config, probe=probe)
    restored.load_state_dict(cb.state_dict())
    assert restored.state == cb.state


def test_cpu_probe_needs_a_budget():
    from transformers import TrainerControl, TrainerState
    with pytest.raises(ConfigError, match='cpu_budget_gib: probe: cpu'):  # known from the settings alone: config time
        MemoryBackoffConfig(probe='cpu')
    if torch.cuda.is_available():
        pytest.skip('probe auto picks CUDA here')
    cb = MemoryBackoffCallback(MemoryBackoffConfig(probe='auto'))  # auto on a CPU-only machine: known at train begin
    with pytest.raises(ConfigError, match='cpu_budget_gib'):
        cb.on_train_begin(_args(), TrainerState(), TrainerControl())


@pytest.mark.parametrize('settings,field', [
    ({'threshold': 1.2}, 'threshold'),
    ({'low': 0.9}, 'low'),
    ({'clean_steps': 0}, 'clean_steps'),
    ({'grow': 1.0}, 'grow'),
    ({'min_pass': 0}, 'min_pass'),
    ({'length_rules': {1024: 0}}, 'length_rules'),
    ({'probe': 'tpu'}, 'probe'),
    ({'cpu_budget_gib': -1}, 'cpu_budget_gib'),
])
def test_bad_config_names_the_field(settings, field):
    with pytest.raises(ConfigError) as e:
        MemoryBackoffConfig(**settings)
    assert str(e.value).startswith((f'{field}:', f'{field}[')), str(e.value)


# ---- real runs with a simulated memory cliff -------------------------------------------------------------
OOM_RUN = dict(max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2, lora_dropout=0.0,
               learning_rate=1e-3, lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=6,
               gradient_checkpointing=True)


def _adapter(out: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(out, 'checkpoint-6', 'adapter_model.safetensors'))


@pytest.fixture(scope='module')
def plain_run(tmp_path_factory, tiny_llama, gsm8k_16):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    out = str(tmp_path_factory.mktemp('oom') / 'plain')
    try:
        sdc.register(batch_schedule={'schedule': {0: 4}}, integration={'record_samples': True})
        run_sft(tiny_llama, 'llama', gsm8k_16, out, callbacks=['batch_schedule'], **OOM_RUN)
    finally:
        plugin.unregister()
    return out


@pytest.mark.e2e
@pytest.mark.parametrize('seed,snapshot', [(1, True), (2, False)])
def test_injected_ooms_lose_nothing_and_change_nothing(seed, snapshot, plain_run, tmp_path, tiny_llama, gsm8k_16,
                                                       monkeypatch):
    """OOMs in forward (over a token budget) and mid-backward (at random): the run finishes, every sample is used
    once, and the final LoRA weights equal those of a run that never ran out of memory. Both ways back to the
    step's earlier gradients are run: the snapshot (adapters) and running the earlier micro-batches again."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.integrations.steps import StepRunner
    monkeypatch.setattr(StepRunner, '_snapshot_grads', lambda self, model: snapshot)
    try:
        sdc.register(batch_schedule={'schedule': {0: 4}}, integration={'record_samples': True})
        with OomInjector(token_budget=1000, backward_rate=0.5, seed=seed) as injector:
            out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'oom'), callbacks=['batch_schedule'], **OOM_RUN)
    finally:
        plugin.unregister()
    assert injector.counts['forward'] > 0 and injector.counts['backward'] > 0, (injector.counts, injector.passes)
    ooms = [d for d in decisions(out) if d['kind'] == 'oom']
    assert len(ooms) >= 1 and all(d['values']['new_pass_cap'] >= 1 for d in ooms)
    assert [row['batches'] for row in sample_trace(out)] == [row['batches'] for row in sample_trace(plain_run)]
    assert sorted(indices_by_epoch(sample_trace(out))[0]) == list(range(16))
    logs = train_logs(out)
    assert logs[-1]['dynamic/oom_count'] == sum(d['values']['retries'] for d in ooms) >= 1
    assert [row['loss'] for row in logs] == pytest.approx([row['loss'] for row in train_logs(plain_run)], rel=1e-4)
    plain, recovered = _adapter(plain_run), _adapter(out)
    assert plain.keys() == recovered.keys()
    for key in plain:
        assert torch.allclose(plain[key], recovered[key], atol=1e-5, rtol=0), key


@pytest.mark.e2e
def test_a_sample_over_the_budget_stops_with_a_clear_message(tmp_path, tiny_llama, gsm8k_16):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.integrations.passes import SampleTooLargeError
    try:
        sdc.register(batch_schedule={'schedule': {0: 2}})
        with OomInjector(token_budget=60), pytest.raises(SampleTooLargeError) as e:
            run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'), callbacks=['batch_schedule'],
                    **{**OOM_RUN, 'max_steps': 2})
    finally:
        plugin.unregister()
    message = str(e.value)
    assert 'single sample (dataset index' in message and 'tokens' in message and 'not skipped' in message

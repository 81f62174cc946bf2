"""End-to-end: real ``swift sft`` LoRA runs on tiny Qwen2 / LLaMA models with batch-size changes through the flags."""

from __future__ import annotations

import os

import pytest
import torch

from swift_dynamic_callbacks.policies.schedule import scheduled_value
from swift_runs import decisions, indices_by_epoch, run_sft, sample_trace, train_logs

pytestmark = [pytest.mark.e2e, pytest.mark.start_first]  # start_first: among the longest files of the default run

N = 16  # rows of the vendored gsm8k slice used here


@pytest.fixture(autouse=True)
def _register():
    import swift_dynamic_callbacks as sdc
    yield sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    plugin.unregister()


def _assert_exactly_once(trace, n, epochs):
    by_epoch = indices_by_epoch(trace)
    assert sorted(by_epoch) == list(range(epochs))
    for epoch, seen in by_epoch.items():
        assert sorted(seen) == list(range(n)), f'epoch {epoch}: not every sample exactly once'


def _expected_sizes(trace, schedule, n, ga):
    """Per step, the micro-batch sizes the schedule asks for (full steps) given the samples left in the epoch."""
    left = {}
    for row in trace:
        step = row['step']
        size = scheduled_value(schedule, step - 1)
        remaining = left.get(row['epoch'], n)
        take = min(remaining, size * ga)
        left[row['epoch']] = remaining - take
        yield step, size, take, [len(b) for b in row['batches']]


@pytest.mark.parametrize(
    'arch,workers,ga,via',
    [
        ('llama', 0, 1, 'batch_size'),  # CI time: Qwen2 holds the dataloader arm and the plain-ms-swift test below
        ('qwen2', 2, 2, 'dataloader'),
        ('llama', 0, 2, 'batch_size'),
    ],
)
def test_batch_changes_exactly_once(_register, tmp_path, tiny_qwen, tiny_llama, gsm8k_16, arch, workers, ga, via):
    model = tiny_qwen if arch == 'qwen2' else tiny_llama
    schedule = {0: 2, 2: 4, 3: 1, 5: 3}
    _register.register(batch_schedule={'schedule': schedule, 'via': via}, integration={'record_samples': True})
    out = run_sft(
        model,
        arch,
        gsm8k_16,
        str(tmp_path / 'out'),
        callbacks=['batch_schedule'],
        max_steps=-1,
        num_train_epochs=2,
        gradient_accumulation_steps=ga,
        dataloader_num_workers=workers,
        dataloader_persistent_workers=workers > 0,
        lr_scheduler_type='linear',
        warmup_ratio=0.0,
        gradient_checkpointing=ga == 2 and arch == 'llama')  # ms-swift's default, kept on one variant
    trace = sample_trace(out)
    _assert_exactly_once(trace, N, epochs=2)
    # the new size is in effect from the next optimizer step on (short last steps of an epoch excepted)
    for step, size, take, sizes in _expected_sizes(trace, schedule, N, ga):
        assert sum(sizes) == take, f'step {step}: took {sizes}, expected {take} samples'
        if take == size * ga:
            assert sizes == [size] * ga, f'step {step}: sizes {sizes}, schedule says {size}'
        else:
            assert max(sizes) <= size and sizes[-1] > 0
    # the training logs carry the batch size that ran, step by step
    logs = train_logs(out)
    assert [row['dynamic/batch_size'] for row in logs] == [row['batch_size'] for row in trace]
    assert logs[-1]['dynamic/samples_seen'] == 2 * N
    assert logs[-1]['epoch'] == pytest.approx(2.0)
    # every change is one decision record with the numbers
    changes = [d for d in decisions(out) if d['kind'] == 'batch_size']
    assert [(d['step'], d['values']['new']) for d in changes] == [(2, 4), (3, 1), (5, 3)]
    assert any(d['kind'] == 'stop' and d['reason'] == 'epoch_budget' for d in decisions(out))
    # max_steps follows the epoch budget at the current batch size: progress ends at N/N, exactly when data does
    step, max_steps = logs[-1]['global_step/max_steps'].split('/')
    assert step == max_steps == str(len(trace))
    # the LR schedule spans the epoch budget at the initial batch size (not HF's loop bound)
    horizon = next(d['values']['max_steps'] for d in decisions(out) if d['kind'] == 'max_steps')
    assert horizon == 2 * -(-N // (2 * ga))
    # the logged LR is the one each step used: step 1 runs at lambda(0) = 1, step 2 at 1 - 1 / horizon
    assert logs[0]['learning_rate'] == pytest.approx(1e-3)
    assert logs[1]['learning_rate'] == pytest.approx(1e-3 * (1 - 1 / horizon), rel=1e-4)
    assert all(row['dynamic/lr_scale'] == 1.0 for row in logs)


def test_no_change_matches_plain_ms_swift(_register, tmp_path, tiny_qwen, gsm8k_16):
    """Installed but idle, the pack trains on the same samples in the same order as plain ms-swift."""
    from swift.dataloader import BatchSamplerShard
    plain = run_sft(tiny_qwen, 'qwen2', gsm8k_16, str(tmp_path / 'plain'), max_steps=10)
    _register.register(batch_schedule={'schedule': {0: 2}}, integration={'record_samples': True})
    pack = run_sft(tiny_qwen, 'qwen2', gsm8k_16, str(tmp_path / 'pack'), callbacks=['batch_schedule'], max_steps=10)
    plain_loss = [row['loss'] for row in train_logs(plain)]
    pack_loss = [row['loss'] for row in train_logs(pack)]
    assert len(plain_loss) == 10 and pack_loss == plain_loss
    # and the order is ms-swift's own sampler's, epoch by epoch
    sampler = BatchSamplerShard(N, batch_size=2, shuffle=True, drop_last=False, data_seed=42)
    for epoch, seen in indices_by_epoch(sample_trace(pack)).items():
        sampler.set_epoch(epoch)
        expected = [i for batch in sampler for i in batch]
        assert seen == expected[:len(seen)]


def test_resume_after_change_continues_with_unseen_samples(_register, tmp_path, tiny_llama, gsm8k_16):
    schedule = {0: 2, 2: 3, 4: 1}
    _register.register(batch_schedule={'schedule': schedule}, integration={'record_samples': True})
    # a constant LR makes the 3-step run an exact prefix of the 7-step one (the decay depends on max_steps)
    lr = dict(lr_scheduler_type='constant', warmup_ratio=0.0)
    full = run_sft(
        tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'full'), callbacks=['batch_schedule'], max_steps=7, save_steps=3,
        **lr)
    first = run_sft(
        tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'part'), callbacks=['batch_schedule'], max_steps=3, save_steps=3,
        **lr)
    checkpoint = os.path.join(first, 'checkpoint-3')
    assert os.path.exists(os.path.join(checkpoint, 'dynamic_callbacks_state.json'))
    resumed = run_sft(
        tiny_llama,
        'llama',
        gsm8k_16,
        first,
        callbacks=['batch_schedule'],
        max_steps=7,
        save_steps=3,
        resume_from_checkpoint=checkpoint,
        fresh=False,
        **lr)
    trace = sample_trace(resumed)  # steps 1..3 from the first run, 4..7 from the resumed one
    assert [row['step'] for row in trace] == list(range(1, 8))
    assert [row['batches'] for row in trace] == [row['batches'] for row in sample_trace(full)]
    seen = [i for row in trace if row['epoch'] == 0 for batch in row['batches'] for i in batch]
    assert len(seen) == len(set(seen)) and len(seen) == 2 * 2 + 2 * 3 + 3 * 1
    assert any(d['kind'] == 'resume' and d['reason'] == 'checkpoint' for d in decisions(resumed))
    full_loss = [row['loss'] for row in train_logs(full)]
    resumed_loss = [row['loss'] for row in train_logs(resumed)]
    assert resumed_loss == full_loss  # same samples, same RNG (dropout), same LR: the same run


def test_pieces_give_the_same_update(_register, tmp_path, tiny_llama, gsm8k_16):
    """A micro-batch run as 3 pieces gives the same LoRA weights as the unsplit micro-batch (fp32)."""
    from safetensors.torch import load_file
    common = dict(callbacks=['batch_schedule'], max_steps=3, save_steps=3, lora_dropout=0.0)  # dropout masks differ
    _register.register(batch_schedule={'schedule': {0: 4}})
    whole = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'whole'), **common)
    _register.register(batch_schedule={'schedule': {0: 4}, 'pieces': {0: 3}})
    split = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'split'), **common)
    a = load_file(os.path.join(whole, 'checkpoint-3', 'adapter_model.safetensors'))
    b = load_file(os.path.join(split, 'checkpoint-3', 'adapter_model.safetensors'))
    assert a.keys() == b.keys() and a
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5)
    assert [r['loss'] for r in train_logs(split)] == pytest.approx([r['loss'] for r in train_logs(whole)], rel=1e-5)
    assert [r['dynamic/num_pieces'] for r in train_logs(split)] == [3, 3, 3]

"""Today's Qwen with the pack: Qwen3.5 (natively multimodal, hybrid attention: a Gated DeltaNet linear-attention first
layer), Qwen3.5-MoE and Qwen3-VL, on image rows and on text-only rows. The input kind is chosen from the model's
config (the Qwen-VL layout), so OOM recovery is on (the ``engine`` record says so) and every way of cutting a
micro-batch keeps the gradient: one injected OOM in forward and one in backward, ``memory_backoff``,
``micro_batch_cap: 2`` and ``split: passes``, each against the same run uncut (2e-4); ``pass_tokens`` on 2 processes
deals every row once with one process's weights. At f3c4471 Qwen3.5 had recovery
silently off and every pass setting refused after the model loaded. Real ``swift sft`` LoRA runs of the tiny models
(``testing/tiny_vl.py`` ``build_tiny_qwen3_model``); ms-swift's Qwen3-VL / Qwen3.5 templates need ``qwen-vl-utils`` and
``torchvision`` (``scripts/test_vl.sh``)."""

from __future__ import annotations

import importlib.util

import pytest

from swift_runs import decisions, indices_by_epoch, run_sft, sample_trace, train_logs

VL_READY = all(importlib.util.find_spec(m) is not None for m in ('qwen_vl_utils', 'torchvision'))
pytestmark = [pytest.mark.vl, pytest.mark.e2e,
              pytest.mark.skipif(not VL_READY, reason='qwen-vl-utils / torchvision are not installed '
                                                      '(scripts/test_vl.sh)')]

RUN = dict(max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, lora_dropout=0.0,
           learning_rate=1e-3, lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=1000)
FIXED = {'batch_schedule': {'schedule': {0: 4}}, 'integration': {'record_samples': True}}

#: how each arm cuts a micro-batch of 4 rows: (the pack's settings, the OOM injector's settings)
SPLITS = {
    'oom_forward': (FIXED, {'forward_passes': (1, )}),  # step 1's second micro-batch: 4 rows
    'oom_backward': (FIXED, {'fail_passes': (2, )}),  # step 2's first micro-batch, mid-backward
    'memory_backoff': ({**FIXED, 'memory_backoff': {'probe': 'cpu', 'cpu_budget_gib': 0.05}}, {}),
    'micro_batch_cap': ({'batch_growth': {'initial': 4, 'interval': 1000, 'maximum': 4, 'micro_batch_cap': 2},
                         'integration': {'record_samples': True}}, {}),
    'split_passes': ({**FIXED, 'length_batching': {'split': 'passes', 'bucketing': False,
                                                   'micro_batch_tokens': 300}}, {}),
}
#: (arch, rows) -> the splits run in the default VL run (the rest are ``slow``)
CASES = [('qwen3_5', 'images', s) for s in SPLITS] + [('qwen3_5', 'text', 'oom_backward'),
                                                     ('qwen3_5', 'text', 'micro_batch_cap'),
                                                     ('qwen3_5_moe', 'images', 'micro_batch_cap'),
                                                     ('qwen3_vl', 'images', 'oom_forward')]
#: CI time: memory_backoff's and split: passes' cut is the same as the injected OOM's (held by the Qwen2-VL arms of
#: tests/test_multimodal.py too); text rows' cap is held by their OOM arm
SLOW = {('qwen3_5', 'images', 'memory_backoff'), ('qwen3_5', 'images', 'split_passes'),
        ('qwen3_5', 'text', 'micro_batch_cap')}


@pytest.fixture(scope='module')
def models(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny_vl import build_tiny_qwen3_model
    return {arch: str(build_tiny_qwen3_model(fixture_dir / f'tiny-{arch}', arch))
            for arch in ('qwen3_5', 'qwen3_5_moe', 'qwen3_vl')}


@pytest.fixture(scope='module')
def rows(fixture_dir):
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset, write_image_dataset
    return {'images': str(write_image_dataset(fixture_dir / 'qwen3' / 'images.jsonl', 28)),
            'text': str(write_gsm8k_dataset(fixture_dir / 'qwen3' / 'text.jsonl', 28))}


def _run(model, arch, data, out, pack, faults):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector
    try:
        sdc.register(**pack)
        with OomInjector(**faults) as injector:
            run_sft(model, arch, data, out, callbacks=[k for k in pack if k != 'integration'], **RUN)
    finally:
        plugin.unregister()
    return train_logs(out), injector


_PLAIN: dict[tuple[str, str], list[dict]] = {}


def _plain(models, rows, arch, kind, tmp_path_factory):
    """The run every split is held against: micro-batches of 4, never cut (once per model and rows)."""
    if (arch, kind) not in _PLAIN:
        out = str(tmp_path_factory.mktemp(f'plain-{arch}-{kind}'))
        logs, _ = _run(models[arch], arch, rows[kind], out, FIXED, {})
        assert max(r['dynamic/pass_size'] for r in logs) == 4
        _PLAIN[(arch, kind)] = logs
    return _PLAIN[(arch, kind)]


@pytest.mark.parametrize('arch,kind,split', [pytest.param(*c, marks=pytest.mark.slow) if c in SLOW else c
                                             for c in CASES], ids=['-'.join(c) for c in CASES])
def test_every_split_keeps_the_gradient_with_recovery_on(models, rows, tmp_path, tmp_path_factory, arch, kind, split):
    plain = _plain(models, rows, arch, kind, tmp_path_factory)
    pack, faults = SPLITS[split]
    out = str(tmp_path / split)
    logs, injector = _run(models[arch], arch, rows[kind], out, pack, faults)
    assert len(logs) == len(plain) == RUN['max_steps']
    for a, b in zip(plain, logs):
        assert b['loss'] == pytest.approx(a['loss'], rel=2e-4), (split, a, b)
        assert b['grad_norm'] == pytest.approx(a['grad_norm'], rel=2e-4), (split, a, b)
    assert min(r['dynamic/pass_size'] for r in logs) < 4  # the micro-batches did run in pieces
    records = decisions(out)
    [engine] = [d for d in records if d['kind'] == 'engine']
    assert engine['values']['oom_recovery'] is True and engine['values']['input_kind'] == 'qwen_vl'
    if split.startswith('oom'):
        assert sum(injector.counts.values()) == 1 and logs[-1]['dynamic/oom_count'] == 1
        assert [d['reason'] for d in records if d['kind'] == 'oom'] == ['recovered']
    seen = indices_by_epoch(sample_trace(out))[0]
    assert len(seen) == len(set(seen)) == 28  # 4 steps of 8: the epoch's 28 rows, each once


@pytest.mark.start_first
@pytest.mark.distributed
def test_two_processes_balanced_qwen3_5_rows_every_row_once(models, rows, tmp_path):
    """2 CPU processes under DDP, ``mode: balanced`` with ``pass_tokens`` over image and text rows of Qwen3.5: every
    row once over the ranks, several passes a step, and the weights equal one process's over the same micro-batches
    (1e-5)."""
    import os

    from engine_runs import assert_engine, assert_same_steps, assert_same_weights, reference, run_ranks
    from swift_runs import read_jsonl
    arch = 'qwen3_5'
    pack = {'integration': {'record_samples': True}, 'length_batching': {'mode': 'balanced', 'pass_tokens': 300}}
    common = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=4, arch=arch)
    out = run_ranks(str(tmp_path / 'ddp'), models[arch], rows['images'], engine='ddp', callbacks=['length_batching'],
                    pack=pack, **common)
    t0, t1 = assert_engine(out, 'ddp')
    assert_same_steps(t0, t1)
    seen = [i for rank in (0, 1) for i in indices_by_epoch(sample_trace(out, rank)).get(0, [])]
    assert sorted(seen) == list(range(28))
    passes = sum(row['dynamic/passes_per_step'] for row in read_jsonl(os.path.join(out, 'logging.jsonl'))
                 if 'loss' in row)
    assert passes > 4 * 2
    ref = reference(str(tmp_path / 'ref'), models[arch], rows['images'], out, gradient_accumulation_steps=2,
                    max_steps=4, arch=arch)
    assert_same_weights(out, ref)


def test_pass_tokens_auto_counts_the_linear_attention_layers_and_the_tower(models, rows, tmp_path):
    """``pass_tokens: auto`` on Qwen3.5 image rows, tokenised when read (ms-swift's default for the model): their
    lengths estimated with Qwen3.5's image rule (32 pixels a token side), the budget's bytes a token counting its Gated
    DeltaNet layer's widths (the ``pass_tokens`` record: ``linear_layers``, ``linear_width``), the ``engine`` record
    pricing its frozen tower (LoRA's ``freeze_vit``); an OOM injected in a pass is recovered under the token budget,
    and every step's loss and grad_norm equal the balanced run without a budget (2e-4)."""
    from swift_dynamic_callbacks.policies.pass_cost import bytes_per_token
    arch = 'qwen3_5'
    balanced = {'length_batching': {'mode': 'balanced'}, 'integration': {'record_samples': True}}
    plain, _ = _run(models[arch], arch, rows['images'], str(tmp_path / 'plain'), balanced, {})
    auto = {**balanced, 'length_batching': {'mode': 'balanced', 'pass_tokens': 'auto'}}
    out = str(tmp_path / 'auto')
    logs, injector = _run(models[arch], arch, rows['images'], out, auto, {'forward_passes': (1, )})
    assert len(logs) == len(plain) == RUN['max_steps']
    for a, b in zip(plain, logs):
        assert b['loss'] == pytest.approx(a['loss'], rel=2e-4), (a, b)
        assert b['grad_norm'] == pytest.approx(a['grad_norm'], rel=2e-4), (a, b)
    records = decisions(out)
    [budget] = [d['values'] for d in records if d['kind'] == 'pass_tokens']
    assert (budget['linear_layers'], budget['linear_width']) == (1, 2 * 2 * 16 + 4 * 16)
    assert budget['bytes_per_token'] == bytes_per_token(hidden=64, intermediate=256, layers=2, vocab=248320,
                                                        dtype_bytes=budget['dtype_bytes'],
                                                        checkpointing=budget['gradient_checkpointing'],
                                                        linear_layers=1, linear_width=128)
    [engine] = [d['values'] for d in records if d['kind'] == 'engine']
    assert engine['vision_trained'] is False and 0 < engine['vision_token_cost'] < 0.1
    [estimate] = [d['values'] for d in records if d['kind'] == 'length_estimate']  # rows tokenised when read
    assert estimate['image_rule']['factor'] == 32 and estimate['image_tokens'] > 0  # patch 16 x merge 2
    assert injector.counts['forward'] == 1 and [d['reason'] for d in records if d['kind'] == 'oom'] == ['recovered']
    assert sorted(indices_by_epoch(sample_trace(out))[0]) == sorted(indices_by_epoch(sample_trace(
        str(tmp_path / 'plain')))[0])

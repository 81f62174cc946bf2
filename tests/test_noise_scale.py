"""Gradient-noise-scale batch growth: the estimator, the probe's normalisation, the policy and a real swift run."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.callbacks.batch_growth import BatchGrowthCallback, BatchGrowthConfig
from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.integrations.passes import GradNoiseProbe
from swift_dynamic_callbacks.policies.growth import critical_batch, ema, noise_scale_size, noise_scale_terms
from swift_runs import decisions, indices_by_epoch, run_sft, sample_trace, train_logs


@given(g2=st.floats(1e-4, 1e3), trace=st.floats(1e-4, 1e4), small=st.integers(1, 500), extra=st.integers(1, 5000))
@example(g2=512.0, trace=0.0001, small=188, extra=1)  # CI, 2026-11-28: the trace far below |G|^2
def test_terms_are_exact_on_expected_norms(g2, trace, small, extra):
    big = small + extra
    # E|g_b|^2 = |G|^2 + tr(Sigma) / b
    est_g2, est_trace = noise_scale_terms(g2 + trace / small, small, g2 + trace / big, big)
    assert est_g2 == pytest.approx(g2, rel=1e-6, abs=1e-6)
    assert est_trace == pytest.approx(trace, rel=1e-6, abs=1e-6)
    # the trace is a difference of nearly equal norms: it is known to its absolute tolerance above, so the ratio to
    # that over |G|^2 (hypothesis found g2=512, trace=1e-4: 2.3e-5 relative, within 1e-6 absolute on the trace)
    assert critical_batch(est_g2, est_trace) == pytest.approx(trace / g2, rel=1e-5, abs=2e-6 / g2)


def test_smoothed_estimate_recovers_a_known_noise_scale():
    """Simulated per-token gradients G + noise: the EMA'd estimate lands near tr(Sigma) / |G|^2."""
    rng = random.Random(0)
    dim, sigma, small, big = 8, 0.5, 4, 16
    true = [0.1] * dim  # |G|^2 = 0.08, tr(Sigma) = dim * sigma^2 = 2 -> B_simple = 25 tokens
    g2_ema = trace_ema = None
    for _ in range(3000):
        tokens = [[g + rng.gauss(0, sigma) for g in true] for _ in range(big)]
        mean_small = [sum(t[i] for t in tokens[:small]) / small for i in range(dim)]
        mean_big = [sum(t[i] for t in tokens) / big for i in range(dim)]
        g2, trace = noise_scale_terms(sum(x * x for x in mean_small), small, sum(x * x for x in mean_big), big)
        g2_ema, trace_ema = ema(g2_ema, g2, 0.99), ema(trace_ema, trace, 0.99)
    assert critical_batch(g2_ema, trace_ema) == pytest.approx(25, rel=0.35)


def test_noise_scale_size_table():
    kw = dict(factor=2, maximum=16)
    assert noise_scale_size(None, 2, **kw) == 2  # no estimate: hold
    assert noise_scale_size(1.7, 2, **kw) == 2  # below the current size: never shrink
    assert noise_scale_size(3.9, 2, **kw) == 3  # toward floor(3.9), not past it
    assert noise_scale_size(40.0, 2, **kw) == 4  # one growth at a time
    assert noise_scale_size(40.0, 12, **kw) == 16  # clamped to maximum


@given(critical=st.one_of(st.none(), st.floats(0, 1e4)), current=st.integers(1, 64), extra=st.integers(0, 64),
       factor=st.floats(1.01, 8))
def test_noise_scale_size_is_bounded_and_monotone(critical, current, extra, factor):
    maximum = current + extra
    size = noise_scale_size(critical, current, factor=factor, maximum=maximum)
    assert current <= size <= maximum
    if critical is not None and size > current:
        assert size <= critical


def test_probe_measures_mean_gradients_under_token_sum_normalisation():
    """Two micro-batches of a real model with ms-swift's loss (token sum / num_items_in_batch): the probe's
    small/big norms equal the norms of the mean gradients over the first pass's tokens and over all tokens."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 11))
    ids = [torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (3, 5))]
    labels = [x.clone() for x in ids]
    labels[0][0, :2] = -100
    labels[1][2, :4] = -100
    num_items = sum(int(lab.ne(-100).sum()) for lab in labels)

    def token_losses(i):
        logits = model(ids[i])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels[i].reshape(-1), reduction='none',
                                                 ignore_index=-100)

    def mean_grad_sqnorm(batches):
        model.zero_grad()
        losses = torch.cat([token_losses(i) for i in batches])
        tokens = sum(int(labels[i].ne(-100).sum()) for i in batches)
        (losses.sum() / tokens).backward()
        return sum(float(p.grad.pow(2).sum()) for p in model.parameters())

    expected_small, expected_big = mean_grad_sqnorm([0]), mean_grad_sqnorm([0, 1])
    model.zero_grad()
    probe = GradNoiseProbe(5, world=1, tokens_averaged=True, num_items_in_batch=torch.tensor(num_items))
    for i in range(2):
        (token_losses(i).sum() / num_items).backward()
        probe.after_pass(model, {'labels': labels[i]}, torch.tensor(num_items))
        if i == 0:
            assert GradNoiseProbe(5, world=1, tokens_averaged=True, num_items_in_batch=num_items).finish(model) is None
    sample = probe.finish(model)
    assert sample.small_sqnorm == pytest.approx(expected_small, rel=1e-5)
    assert sample.big_sqnorm == pytest.approx(expected_big, rel=1e-5)
    assert (sample.small_tokens, sample.big_tokens, sample.samples) == (int(labels[0].ne(-100).sum()), num_items, 5)


def test_single_pass_steps_are_refused_at_start():
    from transformers import TrainerControl, TrainerState, TrainingArguments
    cb = BatchGrowthCallback(BatchGrowthConfig(policy='noise_scale', initial=1, maximum=8))
    args = TrainingArguments(output_dir='unused', gradient_accumulation_steps=1, report_to=[])
    with pytest.raises(ConfigError, match='gradient_accumulation_steps'):
        cb.on_train_begin(args, TrainerState(), TrainerControl())


def test_callback_grows_toward_the_estimate_and_keeps_its_averages_on_resume():
    from transformers import TrainerControl, TrainerState, TrainingArguments
    config = BatchGrowthConfig(policy='noise_scale', initial=1, interval=2, window=2, maximum=8)
    cb = BatchGrowthCallback(config)
    args = TrainingArguments(output_dir='unused', gradient_accumulation_steps=2, report_to=[])
    control = TrainerControl()
    cb.on_train_begin(args, TrainerState(), control)
    assert protocol.grad_noise_requested(control) and control.new_batch_size == 1
    protocol.clear_requests(control)
    # |G|^2 = 1, tr = 60 tokens, 10 tokens a sample -> critical global batch 6 samples -> 3 per pass (GA 2)
    g2, trace = 1.0, 60.0
    sample = protocol.GradNoiseSample(g2 + trace / 10, 10, g2 + trace / 20, 20, 2)
    for step in (1, 2):
        control.grad_noise_sample = sample
        cb.on_step_end(args, TrainerState(global_step=step), control)
    assert cb.strategy.critical_per_device == pytest.approx(3.0)
    assert control.dynamic_metrics['dynamic/grad_noise_scale'] == pytest.approx(6.0)
    assert control.new_batch_size == 2  # one growth toward 3 at the first due step
    record = control.dynamic_decisions[-1]
    assert record.reason == 'noise_scale' and record.values['critical_global_batch'] == pytest.approx(6.0)
    restored = BatchGrowthCallback(config)
    restored.load_state_dict(cb.state_dict())
    assert restored.strategy.noise == cb.strategy.noise
    assert restored.strategy.critical_per_device == cb.strategy.critical_per_device


@pytest.mark.e2e
def test_noise_scale_run(tmp_path, tiny_llama, gsm8k_16):
    """A real run with gradient accumulation: the estimate is logged, growth follows it, data stays exactly-once."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(batch_growth={'policy': 'noise_scale', 'initial': 1, 'interval': 2, 'window': 2, 'maximum': 4,
                                   'noise_decay': 0.5, 'lr_scaling': 'none'},
                     integration={'record_samples': True})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'), callbacks=['batch_growth'], max_steps=-1,
                      num_train_epochs=2, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                      learning_rate=1e-3)
        logs = train_logs(out)
        estimates = [row.get('dynamic/grad_noise_scale') for row in logs]
        assert all(e is not None and math.isfinite(e) and e > 0 for e in estimates[1:])
        growths = [d for d in decisions(out) if d['source'] == 'batch_growth' and d['reason'] == 'noise_scale']
        assert growths  # this seeded run's estimate (1-5 samples) passes 2 per pass within the run
        for d in growths:  # every growth stays at or below the estimate it was made on (per pass: / 2)
            assert d['values']['new'] <= d['values']['critical_global_batch'] / 2
        sizes = [row["dynamic/batch_size"] for row in logs]
        assert sizes == sorted(sizes) and max(sizes) <= 4
        by_epoch = indices_by_epoch(sample_trace(out))
        assert sorted(by_epoch[0]) == sorted(by_epoch[1]) == list(range(16))
    finally:
        plugin.unregister()


def test_the_training_log_measures_the_noise_scale_on_request():
    """``training_log: {noise_scale: true}``: a standing gradient-noise request at train start, B_simple (samples,
    all ranks) published after each measured step, nothing on a single-pass step, the EMAs kept across a resume."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from swift_dynamic_callbacks.callbacks.training_log import TrainingLogCallback
    from swift_dynamic_callbacks.config.training_log import TrainingLogConfig
    args = TrainingArguments(output_dir='unused', gradient_accumulation_steps=2, report_to=[])
    off = TrainerControl()
    TrainingLogCallback(TrainingLogConfig(memory=False)).on_train_begin(args, TrainerState(), off)
    assert not protocol.grad_noise_requested(off)
    config = TrainingLogConfig(memory=False, noise_scale=True, noise_decay=0.5)
    cb, control = TrainingLogCallback(config), TrainerControl()
    cb.on_train_begin(args, TrainerState(), control)
    assert protocol.grad_noise_requested(control)
    cb.on_step_end(args, TrainerState(global_step=1), control)  # a step of one pass: no sample, no figure
    assert 'dynamic/b_simple' not in (getattr(control, 'dynamic_metrics', None) or {})
    # |G|^2 = 1, tr = 60 tokens, 10 tokens a sample -> B_simple 6 samples
    control.grad_noise_sample = protocol.GradNoiseSample(1 + 60 / 10, 10, 1 + 60 / 20, 20, 2)
    cb.on_step_end(args, TrainerState(global_step=2), control)
    assert control.dynamic_metrics['dynamic/b_simple'] == pytest.approx(6.0)
    restored = TrainingLogCallback(config)
    restored.load_state_dict(cb.state_dict())
    assert restored.noise == cb.noise and restored.noise.count == 1


@pytest.mark.e2e
def test_the_noise_scale_in_a_real_runs_logs(tmp_path, tiny_llama, gsm8k_16):
    """A real swift run with ``training_log: {noise_scale: true}`` and GA 2: B_simple in every training log line
    after the first measured step, in logging.jsonl and in the training log's step lines; the batch is untouched."""
    import json
    import os

    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(training_log={'noise_scale': True, 'noise_decay': 0.5, 'memory': False})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'), callbacks=['training_log'],
                      max_steps=6, per_device_train_batch_size=1, gradient_accumulation_steps=2, learning_rate=1e-3)
        logs = train_logs(out)
        estimates = [row.get('dynamic/b_simple') for row in logs]
        assert len(estimates) == 6 and all(e is not None and math.isfinite(e) and e > 0 for e in estimates[1:])
        with open(os.path.join(out, 'dynamic_training_log.jsonl'), encoding='utf-8') as f:
            steps = [json.loads(line) for line in f if '"type": "step"' in line]
        assert [s['dynamic'].get('dynamic/b_simple') for s in steps][1:] == estimates[1:]
        assert {row['dynamic/batch_size'] for row in logs} == {1}
    finally:
        plugin.unregister()

"""NaN / inf training losses: HF's default ``logging_nan_inf_filter`` logs such a step's loss as a finite substitute
(0.0 with ``logging_steps: 1``); the integration counts the non-finite losses ``training_step`` returned and hands
the count over (``control.dynamic_loss_nonfinite``, ``dynamic/nonfinite_steps``), so the pack's decisions see the
true loss: early stopping stops as ``non_finite``, the LR is not restarted, the NaN step's checkpoint is not "best"."""

from __future__ import annotations

import math
import os

import pytest
import torch

from swift_dynamic_callbacks import protocol
from swift_dynamic_callbacks.integrations.losses import LossWatch
from swift_runs import decisions, run_sft, train_logs


def test_loss_watch_counts_steps_with_a_non_finite_micro_batch_loss():
    watch = LossWatch()
    assert watch.take() == 0
    for step, loss in [(0, torch.tensor(1.0)), (1, torch.tensor(float('nan'))), (1, torch.tensor(2.0)),
                       (2, torch.tensor(float('inf'))), (2, torch.tensor(-float('inf'))), (3, 0.5),
                       (4, float('nan')), (5, torch.tensor([1.0, float('nan')]))]:
        assert watch.note(step, loss) is loss  # returned unchanged
    assert watch.take() == 4  # steps 1, 2, 4, 5 (step 2 twice is one step)
    assert watch.take() == 0  # emptied
    watch.note(7, 'not a loss')
    assert watch.take() == 0


def test_loss_watch_flags_stay_on_the_device_until_taken():
    watch = LossWatch()
    watch.note(0, torch.tensor(float('nan')))
    assert isinstance(watch._bad[0], torch.Tensor)  # no .item() per micro-batch: one sync per log line in take()


def test_true_training_value():
    class Control:
        pass

    control = Control()
    logs = {'loss': 0.0, 'grad_norm': float('nan'), 'eval_loss': 1.0}
    assert protocol.true_training_value(control, logs, 'loss') == 0.0  # no integration: as logged
    control.dynamic_loss_nonfinite = 2
    assert math.isnan(protocol.true_training_value(control, logs, 'loss'))
    assert protocol.true_training_value(control, logs, 'eval_loss') == 1.0  # eval metrics are not filtered by HF
    assert protocol.true_training_value(control, logs, 'missing') is None
    assert math.isnan(protocol.true_training_value(Control(), {'loss': 0.0, 'dynamic/nonfinite_steps': 1}, 'loss'))
    assert protocol.loss_nonfinite(Control()) == 0


# ---- real swift sft runs with NaN losses injected ------------------------------------------------------------


def synthetic_losses(monkeypatch, nan_steps, value=lambda step: 10.0 - 0.1 * step):
    """Make every training step return a chosen loss (steadily falling) and NaN at ``nan_steps`` (1-based), as a step
    that overflowed would: the real forward/backward still runs (the gradients are the real ones, so training goes
    on), only the loss handed back to HF's loop is replaced — which is what HF logs and filters."""
    from swift.trainers import Seq2SeqTrainer
    original = Seq2SeqTrainer.training_step

    def training_step(self, model, inputs, *args, **kwargs):
        loss = original(self, model, inputs, *args, **kwargs)
        step = self.state.global_step + 1
        return loss * 0 + (float('nan') if step in nan_steps else value(step))

    monkeypatch.setattr(Seq2SeqTrainer, 'training_step', training_step)


@pytest.mark.e2e
def test_nan_steps_neither_restart_the_lr_nor_become_the_best_checkpoint(tmp_path, tiny_llama, gsm8k_16, monkeypatch):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    synthetic_losses(monkeypatch, nan_steps={5, 6})
    try:
        sdc.register(lr_schedule={'warmup': 0, 'hold': 0, 'patience': 2, 'smooth': 1, 'cooldown': 0,
                                  'max_restarts': 1},
                     checkpoint_rotation={'keep_last': 1, 'keep_best': 1, 'metric': 'loss', 'mode': 'min'})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'),
                      callbacks=['lr_schedule', 'checkpoint_rotation'], max_steps=10, save_steps=1,
                      lr_scheduler_type='cosine', warmup_ratio=0.0)
    finally:
        plugin.unregister()
    logs = train_logs(out)
    assert [row['loss'] for row in logs if row['dynamic/nonfinite_steps']] == [0.0, 0.0]  # HF's filter at work
    assert [row['dynamic/nonfinite_steps'] for row in logs] == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert logs[-1]['dynamic/lr_nonfinite_skipped'] == 2 and logs[-1]['dynamic/lr_restarts'] == 0
    assert not [d for d in decisions(out) if d['kind'] == 'lr_restart']  # measured: restarted after the NaN steps
    kept = sorted(n for n in os.listdir(out) if n.startswith('checkpoint-'))
    assert kept == ['checkpoint-10']  # measured: checkpoint-5 (loss 0.0) was kept as the best
    assert {'checkpoint-5', 'checkpoint-6'} <= {d['values']['checkpoint'] for d in decisions(out)
                                                  if d['kind'] == 'delete_checkpoint'}


@pytest.mark.e2e
def test_nan_step_stops_early_stopping_as_non_finite(tmp_path, tiny_llama, gsm8k_16, monkeypatch):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    synthetic_losses(monkeypatch, nan_steps={4})
    try:
        sdc.register(early_stopping={'monitor': 'loss', 'patience': 5, 'threshold': 1.0})
        out = run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'out'), callbacks=['early_stopping'], max_steps=10)
    finally:
        plugin.unregister()
    [stop] = [d for d in decisions(out) if d['source'] == 'early_stopping']
    assert (stop['kind'], stop['reason'], stop['step']) == ('stop', 'non_finite', 4)  # measured: threshold
    assert stop['values']['logged'] == 0.0 and stop['values']['nonfinite_steps'] == 1
    assert stop['values']['checkpoint'] == 'checkpoint-4'
    assert [row['dynamic/nonfinite_steps'] for row in train_logs(out)] == [0, 0, 0, 1]

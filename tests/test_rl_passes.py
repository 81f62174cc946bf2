"""GRPO's loss passes by tokens: the pure plan and weights (``policies/rl_passes.py``) and :class:`GrpoPasses` on a
fake GRPO trainer (what it asks of ms-swift's trainer: ``get_chunked_inputs``, ``_compute_loss_and_metrics``, the
accelerator's ``backward`` / ``no_sync``, ``_aggregate_and_update_metrics``); the real trainings are in
``test_grpo_passes.py``."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.config.rules import grpo_passes_refusal
from swift_dynamic_callbacks.integrations import grpo_passes as module
from swift_dynamic_callbacks.integrations.grpo_passes import GrpoPasses, GrpoPassTooLargeError
from swift_dynamic_callbacks.policies.rl_passes import WEIGHTING, pass_weight, plan_passes


def test_the_plan_covers_every_row_once_within_the_budget():
    assert plan_passes(5, 10, 25) == [(0, 2), (2, 4), (4, 5)]
    assert plan_passes(3, 10, 5) == [(0, 1), (1, 2), (2, 3)]  # a row over the budget runs alone
    assert plan_passes(4, 10, 1000) == [(0, 4)]
    assert plan_passes(0, 10, 100) == []


@pytest.mark.parametrize('loss_type', sorted(WEIGHTING))
def test_the_weights_of_a_cut_add_up_to_the_one_pass_loss(loss_type):
    rows, tokens = [1, 2, 1], [3, 9, 0]
    weights = [pass_weight(loss_type, r, 4, t, 12) for r, t in zip(rows, tokens)]
    if WEIGHTING[loss_type] == 'window':
        assert weights == [1.0, 1.0, 1.0]
    elif WEIGHTING[loss_type] == 'tokens':
        assert weights == [0.25, 0.75, 0.0]
    else:
        assert weights == [0.25, 0.5, 0.25]
    with pytest.raises(ValueError, match='real'):
        pass_weight('real', 1, 2, 1, 2)


def test_the_refusals_name_the_setting_and_why():
    settings = {'rlhf_type': 'grpo', 'loss_type': 'grpo'}
    assert grpo_passes_refusal(512, settings.get) is None
    assert grpo_passes_refusal(None, {}.get) is None
    assert "needs rlhf_type: grpo (got 'dpo')" in grpo_passes_refusal(512, {'rlhf_type': 'dpo'}.get)
    assert 'top_entropy_quantile: 0.2' in grpo_passes_refusal(512, {**settings, 'top_entropy_quantile': 0.2}.get)
    assert 'deepspeed' in grpo_passes_refusal(512, {**settings, 'deepspeed': 'zero2'}.get)
    assert 'off_policy_sequence_mask_delta' in grpo_passes_refusal(
        512, {**settings, 'loss_type': 'bnpo', 'off_policy_sequence_mask_delta': 0.1}.get)
    assert grpo_passes_refusal(512, {**settings, 'off_policy_sequence_mask_delta': 0.1}.get) is None


class FakeGrpo:
    """The slice of ms-swift's GRPOTrainer the passes use: a loss per row ``(w * x_row).sum()``, reduced over the
    call's rows as ``grpo`` does (the mean), ``oom_rows``: calls of more rows than this run out of memory."""

    def __init__(self, oom_rows: int = 99) -> None:
        self.w = torch.nn.Parameter(torch.ones(3))
        self.model = torch.nn.Module()
        self.model.register_parameter('w', self.w)
        self.oom_rows = oom_rows
        self.calls: list[tuple[int, int]] = []
        self.backwards: list[float] = []
        self.synced: list[bool] = []
        self.aggregated = None
        self._no_sync = False
        self.args = SimpleNamespace(gradient_accumulation_steps=1)
        self.state = SimpleNamespace(global_step=0)
        self.current_gradient_accumulation_steps = 2
        self.accelerator = SimpleNamespace(backward=self._backward, no_sync=self._no_sync_context)

    @contextlib.contextmanager
    def _no_sync_context(self, model):
        self._no_sync = True
        yield
        self._no_sync = False

    def _backward(self, loss):
        self.backwards.append(float(loss.detach()))
        self.synced.append(not self._no_sync)
        loss.backward()

    def get_chunked_inputs(self, model_inputs, batch, start, end, origin=None):
        part = SimpleNamespace(completion_mask=batch.completion_mask[start:end])
        return {'input_ids': model_inputs['input_ids'][start:end]}, part

    def _compute_loss_and_metrics(self, model, inputs, batch):
        rows = inputs['input_ids'].shape[0]
        self.calls.append((rows, len(self.backwards)))
        if rows > self.oom_rows:
            raise torch.OutOfMemoryError('injected')
        return (inputs['input_ids'].float() @ self.w).mean(), {'rows': rows}

    def _aggregate_and_update_metrics(self, metrics, mode):
        self.aggregated = metrics


def _inputs(rows: int = 4, length: int = 3):
    x = torch.arange(rows * length, dtype=torch.float32).reshape(rows, length)
    batch = SimpleNamespace(completion_mask=torch.ones(rows, length))
    return {'model_inputs': {'input_ids': x}, 'grpo_batch': batch}, x


def _passes(budget: int, **kwargs) -> GrpoPasses:
    return GrpoPasses(budget, 'grpo', oom_recovery=kwargs.pop('oom_recovery', True), single_sample_retries=1,
                      grow_back_steps=1, probe_steps=0, **kwargs)


def test_passes_give_the_one_pass_gradient_and_the_last_one_syncs():
    trainer, (inputs, x) = FakeGrpo(), _inputs()
    passes = _passes(6)  # 2 rows of 3 tokens a pass
    loss = passes.compute_loss(trainer, trainer.model, inputs, None)
    expected = (x @ torch.ones(3)).mean()
    assert float(loss) == pytest.approx(float(expected)) and loss.requires_grad and loss.grad_fn is None
    assert [rows for rows, _ in trainer.calls] == [2, 2] and trainer.synced == [False, True]
    assert torch.allclose(trainer.w.grad, x.mean(0) / 2)  # / current_gradient_accumulation_steps, as HF divides
    assert [m[1] for m in trainer.aggregated] == [2, 2] and passes.step_passes == 2


def test_a_rank_with_fewer_passes_runs_zero_weight_passes(monkeypatch):
    monkeypatch.setattr(module.distributed, 'max_ints', lambda values: [4])  # another rank runs 4 passes
    trainer, (inputs, x) = FakeGrpo(), _inputs()
    _passes(6).compute_loss(trainer, trainer.model, inputs, None)
    assert len(trainer.calls) == 4 and trainer.backwards[2:] == [0.0, 0.0] and trainer.synced == [False] * 3 + [True]
    assert torch.allclose(trainer.w.grad, x.mean(0) / 2)  # the padding passes add nothing
    assert len(trainer.aggregated) == 2  # nor metrics


def test_an_oom_runs_the_halves_with_the_same_gradient_and_lowers_the_budget():
    """Passes of 2 rows and more run out of memory: the first (4 rows, 12 tokens) runs as halves, the first half again
    as halves; the passes still to run are re-cut at the step's cap (the step runner's rule), so the second half never
    fails. The step's OOMs are folded into the budget once, at its boundary (the step runner's records: pass sizes
    and tokens), as ``swift sft`` folds them."""
    trainer, (inputs, x) = FakeGrpo(oom_rows=1), _inputs()
    passes = _passes(100)
    loss = passes.compute_loss(trainer, trainer.model, inputs, None)
    assert [rows for rows, _ in trainer.calls] == [4, 2, 1, 1, 1, 1]
    assert float(loss) == pytest.approx(float((x @ torch.ones(3)).mean()))
    assert torch.allclose(trainer.w.grad, x.mean(0) / 2)
    assert passes.oom_count == 2 and passes.budget == 3  # the step's cap: half the 2-row pass (1 row x 3 tokens)
    records = passes.end_step(1)
    ooms = [r for r in records if r.kind == 'oom']
    assert [(r.values['pass_size'], r.values['pass_tokens'], r.values['new_pass_tokens']) for r in ooms] == [
        (4, 12, 6), (2, 6, 3)]
    assert [r.kind for r in records] == ['oom', 'oom', 'pass_budget'] and records[-1].reason == 'oom'
    assert (records[-1].values['unit'], records[-1].values['new']) == ('tokens', 3) and passes.budget == 3
    assert passes.metrics()['dynamic/oom_count'] == 2
    [grown] = passes.end_step(2)  # one clean step (oom_grow_back_steps: 1): toward the smallest failed pass, 6
    assert grown.reason == 'grow_back' and passes.budget == 4


def test_a_row_that_never_fits_ends_the_run_naming_what_to_lower():
    trainer, (inputs, _) = FakeGrpo(oom_rows=0), _inputs()
    with pytest.raises(GrpoPassTooLargeError, match='max_completion_length'):
        _passes(100).compute_loss(trainer, trainer.model, inputs, None)


def test_without_recovery_an_oom_ends_the_run_naming_the_setting():
    trainer, (inputs, _) = FakeGrpo(oom_rows=1), _inputs()
    with pytest.raises(RuntimeError, match='grpo_pass_tokens below 12 ') as e:
        _passes(100, oom_recovery=False).compute_loss(trainer, trainer.model, inputs, None)
    assert 'now 100' in str(e.value)


def test_an_unrecovered_oom_at_one_completion_advises_what_can_still_be_lowered():
    """A pass of one completion cannot be cut: the message never asks for a lower ``grpo_pass_tokens`` (at f3c4471 it
    said "lower grpo_pass_tokens (now 1)"), it names ``max_completion_length`` and memory."""
    trainer, (inputs, _) = FakeGrpo(oom_rows=0), _inputs()
    with pytest.raises(RuntimeError) as e:
        _passes(1, oom_recovery=False).compute_loss(trainer, trainer.model, inputs, None)
    message = str(e.value)
    assert 'cannot be cut' in message and 'max_completion_length' in message
    assert 'grpo_pass_tokens below' not in message


def test_oom_recovery_true_under_several_processes_is_refused_before_the_model_loads(monkeypatch):
    """GRPO's passes recover on one process only: ``oom_recovery: true`` under 2 processes is refused by the one rule,
    on the launch route (``NPROC_PER_NODE``) and the plugin route (torchrun's ``WORLD_SIZE``), before any model loads
    (at f3c4471 it was refused 42 s in, after the model loaded)."""
    from swift_dynamic_callbacks.config.rules import rlhf_refusal
    from swift_dynamic_callbacks.integrations import swift as plugin
    settings = {'rlhf_type': 'grpo', 'loss_type': 'grpo'}
    assert rlhf_refusal('grpo', [], {}, True, grpo_pass_tokens=64, get=settings.get, world_size=1) is None
    message = rlhf_refusal('grpo', [], {}, True, grpo_pass_tokens=64, get=settings.get, world_size=2)
    assert 'oom_recovery: true cannot be used with rlhf_type: grpo under 2 processes' in message
    assert rlhf_refusal('grpo', [], {}, 'auto', grpo_pass_tokens=64, get=settings.get, world_size=2) is None
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setattr(plugin, '_active', True)
    monkeypatch.setattr(plugin, '_configured', plugin.parse_section(
        {'integration': {'oom_recovery': True, 'grpo_pass_tokens': 64}}))
    args = SimpleNamespace(callbacks=[], **settings)
    with pytest.raises(ConfigError, match='under 2 processes'):
        plugin.check_pipeline(args)


def test_the_launch_refuses_grpo_recovery_under_several_processes(tmp_path, monkeypatch):
    import yaml

    from swift_dynamic_callbacks.cli import prepare
    path = tmp_path / 'grpo.yaml'
    path.write_text(yaml.safe_dump({'model': 'm', 'dataset': ['p.jsonl'], 'rlhf_type': 'grpo', 'tuner_type': 'lora',
                                    'dynamic_callbacks': {'integration': {'oom_recovery': True,
                                                                          'grpo_pass_tokens': 64}}}), encoding='utf-8')
    prepare(str(path), [], 'rlhf')  # one process: recovered in the passes
    monkeypatch.setenv('NPROC_PER_NODE', '2')
    with pytest.raises(ConfigError, match='under 2 processes'):
        prepare(str(path), [], 'rlhf')


def test_the_budget_state_survives_a_checkpoint():
    passes = _passes(100)
    trainer, (inputs, _) = FakeGrpo(oom_rows=1), _inputs()
    passes.compute_loss(trainer, trainer.model, inputs, None)
    again = _passes(100)
    passes.end_step(1)  # the step's OOMs folded: the budget a checkpoint carries
    again.load_state_dict(passes.state_dict())
    assert again.budget == passes.budget == 3 and again.oom_count == 2
    other = _passes(200)
    other.load_state_dict(passes.state_dict())  # another ceiling: the lowered budget is not carried over
    assert other.budget == 200


def test_the_setting_is_checked_at_config_time():
    from swift_dynamic_callbacks.config.integration import IntegrationConfig
    with pytest.raises(ConfigError, match='grpo_pass_tokens'):
        IntegrationConfig.from_mapping({'grpo_pass_tokens': 0})
    assert IntegrationConfig.from_mapping({'grpo_pass_tokens': 4096}).grpo_pass_tokens == 4096


def test_a_micro_batch_reads_the_device_once_whatever_its_passes(monkeypatch):
    """The passes read nothing back from the device while they run: one read of the completions' token counts a
    micro-batch (``tolist``), none a pass (at 36c848d: a token count and the loss, two reads a pass)."""
    reads = []
    for name in ('item', 'tolist', '__float__', '__int__', '__bool__'):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n),
                                                                                             _o(self, *a, **k))[1])

    class Quiet(FakeGrpo):
        def _backward(self, loss):
            self.synced.append(not self._no_sync)
            loss.backward()

    trainer, (inputs, x) = Quiet(), _inputs(rows=4)
    loss = _passes(3).compute_loss(trainer, trainer.model, inputs, None)  # one completion a pass: 4 passes
    assert len(trainer.calls) == 4 and reads == ['tolist'], reads
    reads.clear()
    assert float(loss) == pytest.approx(float((x @ torch.ones(3)).mean()))


class FakeAdapterGrpo(FakeGrpo):
    """:class:`FakeGrpo` whose base is frozen: 3 trainable weights beside 100 frozen ones (an adapter run)."""

    def __init__(self, oom_rows: int = 99) -> None:
        super().__init__(oom_rows)
        self.model.register_parameter('base', torch.nn.Parameter(torch.zeros(100), requires_grad=False))


def _counting_snapshots(monkeypatch) -> list[int]:
    taken: list[int] = []
    original = module.grad_snapshot
    monkeypatch.setattr(module, 'grad_snapshot', lambda model: (taken.append(1), original(model))[1])
    return taken


def test_an_adapter_run_snapshots_once_a_micro_batch_and_recovers_the_same_gradient(monkeypatch):
    """The step runner's one snapshot rule: where the base is frozen, one copy of the trainable gradients a micro-batch,
    however many passes it runs (at 4951e3b: one a pass, so 4 here); after an OOM the micro-batch runs again from it,
    cut at the step's cap, with the gradient of the run without the OOM."""
    taken = _counting_snapshots(monkeypatch)
    trainer, (inputs, x) = FakeAdapterGrpo(), _inputs(rows=4)
    _passes(3).compute_loss(trainer, trainer.model, inputs, None)  # one completion a pass: 4 passes
    assert len(trainer.calls) == 4 and len(taken) == 1
    taken.clear()
    trainer, (inputs, x) = FakeAdapterGrpo(oom_rows=1), _inputs(rows=4)
    trainer.w.grad = torch.full((3,), 5.0)  # an earlier micro-batch's gradient in this step: kept
    loss = _passes(100).compute_loss(trainer, trainer.model, inputs, None)
    assert len(taken) == 1 and [rows for rows, _ in trainer.calls] == [4, 2, 1, 1, 1, 1]
    assert torch.allclose(trainer.w.grad, torch.full((3,), 5.0) + x.mean(0) / 2)
    assert float(loss) == pytest.approx(float((x @ torch.ones(3)).mean()))
    assert [m[1] for m in trainer.aggregated] == [1, 1, 1, 1]  # the run's passes' metrics, not the failed ones'


def test_a_full_fine_tune_keeps_no_copy_and_runs_the_step_again_after_an_oom(monkeypatch):
    """A full fine-tune takes no gradient copy (at 4951e3b: a copy of every gradient before every pass): an OOM in the
    step's second micro-batch drops the step's gradients and runs its first micro-batch again, cut at the new cap, then
    the second; the gradient is the one of the run without the OOM and the first micro-batch's metrics are counted once.
    The next step starts afresh (its first micro-batch is not run again)."""
    taken = _counting_snapshots(monkeypatch)
    trainer = FakeGrpo()
    (first, x1), (second, x2) = _inputs(rows=2), _inputs(rows=4)
    passes = _passes(100)
    passes.compute_loss(trainer, trainer.model, first, None)
    trainer.oom_rows = 2  # memory is shorter from now on: passes of more than 2 completions fail
    trainer.calls.clear()
    passes.compute_loss(trainer, trainer.model, second, None)
    assert not taken
    # the failing pass; the first micro-batch again at the cap; the second at the cap
    assert [rows for rows, _ in trainer.calls] == [4, 2, 2, 2]
    assert torch.allclose(trainer.w.grad, x1.mean(0) / 2 + x2.mean(0) / 2)
    assert [m[1] for m in trainer.aggregated] == [2, 2]  # the second micro-batch's own passes
    passes.end_step(1)
    trainer.w.grad = None
    trainer.calls.clear()
    trainer.oom_rows = 1
    passes.compute_loss(trainer, trainer.model, _inputs(rows=2)[0], None)  # the budget 6: 2 rows of 3, fails
    assert [rows for rows, _ in trainer.calls] == [2, 1, 1]  # nothing of the last step runs again


class FakeLogps(FakeGrpo):
    """:class:`FakeGrpo` with ms-swift's one-call log-prob computation: each completion's per-token values are its
    own (``x_row * w``), calls of more rows than ``oom_rows`` run out of memory."""

    template = SimpleNamespace(padding_free=False)

    def _get_per_token_logps_and_entropies_single(self, model, model_inputs, grpo_batch, compute_entropy=False):
        rows = model_inputs['input_ids'].shape[0]
        self.calls.append((rows, -1))
        if rows > self.oom_rows:
            raise torch.OutOfMemoryError('injected')
        logps = model_inputs['input_ids'] * self.w
        return logps, (-logps if compute_entropy else None)


def test_the_log_prob_forwards_run_as_passes_with_the_one_call_result():
    """A rollout's old / reference log-probs (no gradient): passes of whole completions within the budget, their rows
    put back in order: the one call's values; a micro-batch that fits runs the trainer's own call; an OOM in a pass
    runs the forwards again at the step's cap (an ``oom`` record with ``phase: logps``)."""
    trainer, (inputs, x) = FakeLogps(), _inputs(rows=4)
    whole_calls = []

    def whole():
        whole_calls.append(1)
        return trainer._get_per_token_logps_and_entropies_single(trainer.model, inputs['model_inputs'], None, True)

    passes = _passes(6)  # 2 completions of 3 tokens a pass
    with torch.no_grad():
        logps, entropies = passes.logps(trainer, trainer.model, inputs['model_inputs'], inputs['grpo_batch'],
                                        compute_entropy=True, origin=None, whole=whole)
    assert torch.equal(logps, x * trainer.w) and torch.equal(entropies, -x * trainer.w)
    assert [rows for rows, _ in trainer.calls] == [2, 2] and not whole_calls
    assert passes.metrics()['dynamic/grpo_logp_passes'] == 2
    trainer.calls.clear()
    _passes(100).logps(trainer, trainer.model, inputs['model_inputs'], inputs['grpo_batch'], compute_entropy=False,
                       origin=None, whole=whole)
    assert whole_calls == [1]  # fits: ms-swift's own call
    trainer, passes = FakeLogps(oom_rows=1), _passes(6)
    logps, _ = passes.logps(trainer, trainer.model, inputs['model_inputs'], inputs['grpo_batch'],
                            compute_entropy=False, origin=None, whole=whole)
    assert torch.equal(logps, x * trainer.w) and [rows for rows, _ in trainer.calls] == [2, 1, 1, 1, 1]
    [oom] = [r for r in passes.end_step(1) if r.kind == 'oom']
    assert oom.values['phase'] == 'logps' and oom.values['pass_size'] == 2

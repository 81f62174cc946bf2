"""OOM recovery keeps the gradient for every loss it runs under: a mean per call (label smoothing, a sequence
classifier) is weighted piece by piece; a loss whose pieces do not add up turns recovery off (``auto``, said in the
``engine`` record) or is refused (``true``). Unit layer: the loss kinds and piece weights; end to end: real ``swift
sft`` runs with one OOM injected, against the same run without it."""

from __future__ import annotations

import glob
import json
import os
from types import SimpleNamespace

import pytest
import torch

from swift_dynamic_callbacks.integrations.loss_kind import LossKind, loss_kind, piece_weights, weigh
from swift_dynamic_callbacks.testing.faults import OomInjector
from swift_runs import decisions, run_sft, train_logs

pytestmark = pytest.mark.start_first  # among the longest files of the default run (--dist loadfile): started first


def _trainer(**args):
    defaults = dict(loss_type=None, label_smoothing_factor=0.0, router_aux_loss_coef=0.0)
    return SimpleNamespace(args=SimpleNamespace(**{**defaults, **args}), template=None, task_type=None,
                           compute_loss_func=None, model=None)


def test_loss_kinds_from_the_settings():
    assert loss_kind(_trainer()).kind == 'token_sum'
    smoothed = loss_kind(_trainer(label_smoothing_factor=0.1))
    assert (smoothed.kind, smoothed.setting) == ('token_mean', 'label_smoothing_factor: 0.1')
    seq_cls = _trainer()
    seq_cls.task_type = 'seq_cls'
    assert loss_kind(seq_cls).kind == 'row_mean'
    for task in ('embedding', 'reranker'):
        t = _trainer()
        t.task_type = task
        assert loss_kind(t).kind == 'unknown' and loss_kind(t).setting == f'task_type: {task}'
    assert loss_kind(_trainer(loss_type='infonce')).setting == 'loss_type: infonce'
    assert loss_kind(_trainer(loss_type='cross_entropy')).kind == 'token_sum'
    custom = _trainer()
    custom.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.loss
    assert loss_kind(custom).kind == 'unknown' and loss_kind(custom).setting.startswith('compute_loss_func:')
    assert loss_kind(_trainer(router_aux_loss_coef=0.01)).kind == 'unknown'


def test_piece_weights_add_up_to_the_whole_mean():
    """Two pieces of a token mean: each weighted by its share of the label tokens (after the causal shift), the
    weighted means add up to the mean over the whole micro-batch."""
    labels = torch.tensor([[-100, 1, 2, 3, -100], [-100, -100, 4, -100, -100], [5, 6, 7, 8, 9]])
    losses = torch.arange(15, dtype=torch.float).view(3, 5)
    kind = LossKind('token_mean', 'label_smoothing_factor: 0.1', '', shift=True)
    pieces = [{'labels': labels[:2]}, {'labels': labels[2:]}]
    weights = piece_weights(kind, pieces)
    assert weights == [4 / 8, 4 / 8]  # 3 + 1 shifted label tokens, then 4 (the first column is never a target)

    def mean(part_labels, part_losses):
        mask = part_labels[:, 1:] != -100
        return part_losses[:, 1:][mask].mean()

    whole = mean(labels, losses)
    split = weights[0] * mean(labels[:2], losses[:2]) + weights[1] * mean(labels[2:], losses[2:])
    assert float(split) == pytest.approx(float(whole))
    rows = piece_weights(LossKind('row_mean', 'task_type: seq_cls', ''), pieces)
    assert rows == [2 / 3, 1 / 3]
    assert piece_weights(LossKind('token_sum', None, ''), pieces) is None
    assert weigh((torch.tensor(2.0), 'outputs'), 0.5)[0] == 1.0 and weigh(torch.tensor(2.0), None) == 2.0


# ---- end to end: one OOM injected, against the run without it ------------------------------------------------
RUN = dict(max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, lora_dropout=0.0,
           learning_rate=1e-3, lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=1000)


def _run(model, arch, data, out, *, inject, integration=None, **extra):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    try:
        sdc.register(batch_schedule={'schedule': {0: 4}}, integration=integration or {})
        with OomInjector(forward_passes=(3, ) if inject else ()) as injector:
            run_sft(model, arch, data, out, callbacks=['batch_schedule'], **{**RUN, **extra})
    finally:
        plugin.unregister()
    return injector


def _same_after_the_oom(tmp_path, model, arch, data, **extra):
    _run(model, arch, data, str(tmp_path / 'plain'), inject=False, **extra)
    injector = _run(model, arch, data, str(tmp_path / 'oom'), inject=True, **extra)
    assert injector.counts['forward'] == 1
    [oom] = [d for d in decisions(str(tmp_path / 'oom')) if d['kind'] == 'oom']
    plain, recovered = train_logs(str(tmp_path / 'plain')), train_logs(str(tmp_path / 'oom'))
    assert len(plain) == len(recovered) == RUN['max_steps']
    for a, b in zip(plain, recovered):  # the OOM's step and every later one (its passes cut in two from then on)
        assert b['loss'] == pytest.approx(a['loss'], rel=2e-4), (a, b)
        assert b['grad_norm'] == pytest.approx(a['grad_norm'], rel=2e-4), (a, b)
    assert recovered[-1]['dynamic/pass_size'] < plain[-1]['dynamic/pass_size']  # later passes did run in pieces
    return oom


@pytest.mark.e2e
def test_label_smoothing_keeps_loss_and_gradient_after_an_oom(tmp_path, tiny_llama, gsm8k_16):
    """``label_smoothing_factor: 0.1``: HF's label smoother averages each call's label tokens; after one OOM the
    micro-batches run as two pieces for several steps, each weighted by its share, so the loss and gradient norm
    of every step equal the run without the OOM (at 55fa141 they doubled for the rest of the run)."""
    oom = _same_after_the_oom(tmp_path, tiny_llama, 'llama', gsm8k_16, label_smoothing_factor=0.1)
    assert oom['values']['loss'] == 'token_mean' and 'label_smoothing_factor: 0.1' in oom['message']


@pytest.fixture
def labelled_16(tmp_path, gsm8k_16):
    out = tmp_path / 'cls.jsonl'
    with open(gsm8k_16, encoding='utf-8') as src, open(out, 'w', encoding='utf-8') as dst:
        for i, line in enumerate(src):
            row = json.loads(line)
            dst.write(json.dumps({'messages': row['messages'][:1], 'label': i % 2}) + '\n')
    return str(out)


@pytest.mark.e2e
def test_seq_cls_keeps_loss_and_gradient_after_an_oom(tmp_path, tiny_llama, labelled_16):
    """``task_type: seq_cls`` (ms-swift's plain Trainer: the model's loss is a mean over the call's rows): pieces
    weighted by their rows."""
    oom = _same_after_the_oom(tmp_path, tiny_llama, 'llama', labelled_16, task_type='seq_cls', num_labels=2)
    assert oom['values']['loss'] == 'row_mean'


@pytest.fixture
def mean_loss_type():
    """A ``loss_type`` registered the way a user adds one (ms-swift's ``loss_map``): a mean over the call's tokens,
    which the pack cannot know from its name."""
    from swift.loss.base import BaseLoss
    from swift.loss.mapping import loss_map

    class MeanTokenLoss(BaseLoss):
        def __call__(self, outputs, labels, *, num_items_in_batch=None, loss_scale=None, **kwargs):
            logits = outputs.logits[:, :-1].float()
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     labels[:, 1:].reshape(-1), ignore_index=-100)

    loss_map['mean_token_ce'] = MeanTokenLoss
    yield 'mean_token_ce'
    loss_map.pop('mean_token_ce', None)


@pytest.mark.e2e
def test_a_loss_the_pack_cannot_split_turns_recovery_off_or_is_refused(tmp_path, tiny_llama, gsm8k_16,
                                                                        mean_loss_type, caplog):
    """A custom ``loss_type``: under ``oom_recovery: auto`` recovery is off for the run, with a warning and the
    ``engine`` record naming the setting; ``oom_recovery: true`` is refused before step 1, naming it."""
    from swift_dynamic_callbacks.config import ConfigError
    out = str(tmp_path / 'auto')
    with caplog.at_level('WARNING', logger='swift_dynamic_callbacks'):
        _run(tiny_llama, 'llama', gsm8k_16, out, inject=False, loss_type=mean_loss_type, max_steps=1)
    [engine] = [d for d in decisions(out) if d['kind'] == 'engine']
    assert engine['values']['oom_recovery'] is False and engine['values']['loss'] == 'unknown'
    assert 'loss_type: mean_token_ce' in engine['values']['oom_recovery_off']
    assert any('OOM recovery off (loss_type: mean_token_ce' in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match='oom_recovery: true cannot be combined with loss_type: mean_token_ce'):
        _run(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'true'), inject=False, loss_type=mean_loss_type,
             max_steps=1, integration={'oom_recovery': True})


@pytest.mark.e2e
def test_a_resume_after_an_unrecovered_oom_never_splits_a_loss_the_pack_cannot_split(tmp_path, tiny_llama, gsm8k_16,
                                                                                    mean_loss_type, caplog):
    """A custom ``loss_type`` (a mean per call, unknown to the pack), micro-batches of 3 x GA 2, a checkpoint every
    step, one OOM in step 2: recovery is off, so the run ends, and its message says what to set instead of promising
    smaller passes; the run resumed from step 1's checkpoint reads the OOM note but does not lower its pass budget
    (a ``pass_budget`` ``not_lowered`` record with the same advice): every later step's loss and grad_norm equal the
    run without the OOM. At 03097fd the resumed run cut 3-row micro-batches into 1- and 2-row passes in silence
    (3.4 % off)."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin

    def train(out, *, inject=False, **extra):
        try:
            sdc.register(batch_schedule={'schedule': {0: 3}})
            with OomInjector(forward_passes=(2, ) if inject else ()):
                run_sft(tiny_llama, 'llama', gsm8k_16, out, callbacks=['batch_schedule'],
                        **{**RUN, 'per_device_train_batch_size': 3, 'save_steps': 1, 'loss_type': mean_loss_type,
                           **extra})
        finally:
            plugin.unregister()

    plain, crashed = str(tmp_path / 'plain'), str(tmp_path / 'crashed')
    train(plain)
    with caplog.at_level('ERROR', logger='swift_dynamic_callbacks'), pytest.raises(torch.OutOfMemoryError):
        train(crashed, inject=True)  # the third forward: step 2's first micro-batch
    [message] = [r.getMessage() for r in caplog.records if 'out of memory on rank 0' in r.getMessage()]
    assert 'cannot cut a micro-batch into smaller passes' in message and 'loss_type: mean_token_ce' in message
    assert 'gradient_accumulation_steps: 6 (now 2)' in message and 'plans its passes within' not in message
    assert [os.path.basename(p) for p in glob.glob(os.path.join(crashed, 'checkpoint-*'))] == ['checkpoint-1']
    train(crashed, resume_from_checkpoint=os.path.join(crashed, 'checkpoint-1'), fresh=False)
    [record] = [d for d in decisions(crashed) if d['kind'] == 'pass_budget']
    assert record['reason'] == 'not_lowered' and 'loss_type: mean_token_ce' in record['values']['why']
    assert record['values']['advice'].startswith('gradient_accumulation_steps: 6 (now 2)')
    before, after = train_logs(plain), train_logs(crashed)
    assert [r['global_step/max_steps'] for r in after] == ['1/4', '2/4', '3/4', '4/4']  # 2-4 resumed
    for a, b in zip(before[1:], after[1:]):
        assert b['loss'] == pytest.approx(a['loss'], rel=2e-4), (a, b)
        assert b['grad_norm'] == pytest.approx(a['grad_norm'], rel=2e-4), (a, b)
    assert max(r['dynamic/pass_size'] for r in after[1:]) == 3  # never cut


def test_one_rule_for_every_split_under_a_loss_the_pack_cannot_split():
    """The step runner's one rule (``split_refusal``) is asked by every source of a split: a requested pass limit
    (``memory_backoff``, ``split: passes``, a user callback's ``new_pass_limit``) and pieces are refused naming the
    loss setting; the over-estimate split (lengths that are estimates) and the budget read back from an OOM note do not
    cut (``splittable`` is false); a token-sum loss may split."""
    from swift_dynamic_callbacks.config import ConfigError
    from swift_dynamic_callbacks.integrations.engines import Engine
    from swift_dynamic_callbacks.integrations.steps import StepRunner
    trainer = SimpleNamespace(args=SimpleNamespace(padding_free=False, packing=False), template=None)
    runner = StepRunner(trainer, Engine(trainer), oom_recovery=False, single_sample_retries=0)
    assert runner.split_refusal() is None and runner.splittable()
    runner.loss, runner._can_split = LossKind('unknown', 'loss_type: mean_token_ce', 'a mean per call'), None
    assert 'loss_type: mean_token_ce' in runner.split_refusal()
    assert not runner.splittable()
    for setting, feature in (('control.new_pass_limit', 'pass_limit'), ('control.new_num_pieces', 'pieces')):
        with pytest.raises(ConfigError, match=f'{setting}: a micro-batch cannot run as several passes under '
                                              'loss_type: mean_token_ce'):
            runner.check_splittable(setting, feature)
    with pytest.raises(ConfigError, match='loss_type: mean_token_ce'):
        runner.set_pass_limit({'samples': 2, 'tokens': None, 'rules': []})
    runner.budget.configure(tokens_ceiling=None, rows=4)
    runner.budget.start_step(estimate=100)  # a step whose lengths are estimates, under a 100-token budget
    batch = {'input_ids': torch.ones(4, 50, dtype=torch.long), 'labels': torch.ones(4, 50, dtype=torch.long)}
    assert runner._pieces(batch) == 1  # not cut by the estimate's budget: it runs over it (warned)
    runner.loss, runner._can_split = LossKind('token_sum', None, ''), None
    assert runner._pieces(batch) == 2  # two passes of 2 x 50 tokens


def test_the_advice_keeps_the_global_batch():
    from swift_dynamic_callbacks.integrations.oom_report import fewer_rows, fewer_rows_advice
    assert fewer_rows(3, 2) == (1, 6) and fewer_rows(4, 4) == (2, 8) and fewer_rows(6, 1) == (3, 2)
    assert fewer_rows(2, 3) == (1, 6)
    for rows in range(2, 40):
        smaller, steps = fewer_rows(rows, 5)
        assert smaller * steps == rows * 5 and smaller <= rows // 2
    assert fewer_rows_advice(3, 2).startswith('gradient_accumulation_steps: 6 (now 2)')


@pytest.mark.e2e
def test_with_no_pack_callback_listed_the_integration_still_recovers_an_oom(tmp_path, tiny_llama, gsm8k_16):
    """The pack registered with its settings and no pack callback listed (``callbacks: []``): the integration is
    installed all the same, so an OOM injected in a pass of 4 rows is recovered (an ``oom`` record, the run ends)
    with every step's loss and grad_norm equal to plain ms-swift's without the OOM (at f3c4471 the OOM ended the run as
    in plain ms-swift: the integration came only with a listed callback)."""
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    extra = dict(per_device_train_batch_size=4, max_steps=3)
    run_sft(tiny_llama, 'llama', gsm8k_16, str(tmp_path / 'plain'), **{**RUN, **extra})
    out = str(tmp_path / 'alone')
    try:
        sdc.register(integration={'oom_recovery': 'auto'})
        with OomInjector(forward_passes=(1, )) as injector:
            run_sft(tiny_llama, 'llama', gsm8k_16, out, callbacks=[], **{**RUN, **extra})
    finally:
        plugin.unregister()
    assert injector.counts['forward'] == 1
    records = decisions(out)
    [engine] = [d for d in records if d['kind'] == 'engine']
    assert engine['values']['oom_recovery'] is True
    assert [d['reason'] for d in records if d['kind'] == 'oom'] == ['recovered']
    plain, alone = train_logs(str(tmp_path / 'plain')), train_logs(out)
    assert len(plain) == len(alone) == 3
    for a, b in zip(plain, alone):
        assert b['loss'] == pytest.approx(a['loss'], rel=2e-4), (a, b)
        assert b['grad_norm'] == pytest.approx(a['grad_norm'], rel=2e-4), (a, b)


def test_settings_nothing_reads_are_refused_when_no_callback_is_listed(tmp_path):
    """The integration alone: a pack callback's settings with the callback not listed, and ``grpo_pass_tokens``
    under ``swift sft``, are refused at launch (``swift-dynamic check``), never ignored."""
    import yaml

    from swift_dynamic_callbacks.cli import prepare
    from swift_dynamic_callbacks.config import ConfigError
    base = {'model': 'm', 'dataset': ['d.jsonl'], 'tuner_type': 'lora'}
    for section, match in (({'batch_growth': {'maximum': 8}}, 'batch_growth'),
                           ({'integration': {'grpo_pass_tokens': 64}}, 'needs rlhf_type: grpo')):
        path = tmp_path / 'run.yaml'
        path.write_text(yaml.safe_dump({**base, 'dynamic_callbacks': section}), encoding='utf-8')
        with pytest.raises(ConfigError, match=match):
            prepare(str(path), [])
    path.write_text(yaml.safe_dump({**base, 'dynamic_callbacks': {'integration': {'oom_recovery': True}}}),
                    encoding='utf-8')
    config, pack = prepare(str(path), [])
    assert pack.integration.oom_recovery is True and 'callbacks' not in config

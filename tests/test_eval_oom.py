"""Evaluation an OOM cannot end (``integrations/eval_passes.py``): an eval batch that runs out of memory runs again in
halves, its loss put together from theirs (weighted by their label tokens) and its logits and labels concatenated, so
every eval metric equals the run without the OOM; later eval batches are cut in advance. Unit layer: the pieces put
together by hand and through :class:`EvalPasses` with a fake prediction; what turns it off. End to end: real ``swift
sft`` runs with ``eval_strategy: steps`` and OOMs injected in eval forwards."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from swift_dynamic_callbacks.integrations.eval_passes import EvalPasses, eval_loss_kind, put_together
from swift_dynamic_callbacks.integrations.loss_kind import LossKind


def _predict_mean(fail_over: int | None, calls: list[int], num_items=None):
    """A prediction step whose loss is the token sum over the batch's label tokens after the causal shift divided by
    their count (the mean, as a causal LM's eval loss without a count) or, with ``num_items`` (the trainer's
    ``_get_num_items_in_batch``, asked first, as transformers does), by the count it gives; logits the ids as floats;
    an OOM for a batch of more than ``fail_over`` rows."""
    def predict(batch):
        count = num_items([batch]) if num_items is not None else None
        rows = batch['input_ids'].shape[0]
        calls.append(rows)
        if fail_over is not None and rows > fail_over:
            raise torch.OutOfMemoryError('CUDA out of memory (test)')
        labels = batch['labels'][..., 1:]
        values = batch['input_ids'][..., 1:].float()
        mask = labels != -100
        loss = (values * mask).sum() / (mask.sum() if count is None else count)
        return loss, batch['input_ids'].float() * 2, batch['labels']
    return predict


def _batch(rows: int = 6, length: int = 7):
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (rows, length))
    labels = ids.clone()
    for r in range(rows):  # uneven label tokens a row
        labels[r, : 1 + r % 4] = -100
    return {'input_ids': ids, 'labels': labels, 'attention_mask': torch.ones_like(ids)}


def _eval_passes(**runner):
    from swift_dynamic_callbacks.integrations.engines import Engine
    from swift_dynamic_callbacks.integrations.input_kinds import TextRows
    records = []
    fake = SimpleNamespace(**{'loss': LossKind('token_sum', None, ''), 'kind': TextRows(),
                              'split_refusal': lambda: None, 'engine': Engine(SimpleNamespace()), **runner})
    passes = EvalPasses(fake, records.append)
    return passes, records


def test_an_eval_oom_runs_the_batch_in_halves_with_the_whole_batchs_results():
    passes, records = _eval_passes()
    record = passes.begin(SimpleNamespace(args=SimpleNamespace(predict_with_generate=False)))
    assert record.kind == 'eval_oom_recovery' and record.reason == 'on'
    batch = _batch()
    whole = _predict_mean(None, [])(batch)
    calls = []
    loss, logits, labels = passes.run(None, batch, _predict_mean(2, calls))
    assert calls == [6, 3, 2, 1, 2, 1]  # 6 fails, its first half of 3 fails (cap 2): pieces of 2 and 1 run
    assert loss.item() == pytest.approx(whole[0].item(), rel=1e-6)
    assert torch.equal(logits, whole[1]) and torch.equal(labels, whole[2])
    assert passes.cap == 2 and passes.oom_count == 2
    assert records == []  # written when the eval ends (every rank's: gathered)
    passes.end_eval()
    assert [(r.kind, r.values['phase'], r.values['rank'], r.values['rows']) for r in records] == [
        ('oom', 'eval', 0, 6), ('oom', 'eval', 0, 3)]
    calls.clear()  # later batches: cut in advance to the cap, no OOM
    loss, _, _ = passes.run(None, batch, _predict_mean(2, calls))
    assert calls == [2, 2, 2] and loss.item() == pytest.approx(whole[0].item(), rel=1e-6)
    assert passes.state_dict() == {'cap': 2, 'oom_count': 2}


def test_what_keeps_an_eval_batch_whole(monkeypatch):
    passes, _ = _eval_passes()
    record = passes.begin(SimpleNamespace(args=SimpleNamespace(predict_with_generate=True)))
    assert record.reason == 'off' and 'predict_with_generate' in record.values['why']
    with pytest.raises(torch.OutOfMemoryError):  # off: raised as it was
        passes.run(None, _batch(), _predict_mean(2, []))
    refused, _ = _eval_passes(split_refusal=lambda: 'swift rlhf: rows compared by the loss')
    assert refused.begin(SimpleNamespace(args=SimpleNamespace())).values['why'].startswith('swift rlhf')
    unknown, _ = _eval_passes(loss=LossKind('unknown', 'loss_type: custom', 'not additive'))
    assert 'loss_type: custom' in unknown.begin(SimpleNamespace(args=SimpleNamespace())).values['why']
    from swift_dynamic_callbacks import distributed
    from swift_dynamic_callbacks.integrations.engines import DDPEngine, DeepSpeedEngineAdapter, FSDP2Engine
    monkeypatch.setattr(distributed, 'world_size', lambda: 2)  # several processes: on where an eval forward is alone
    assert _eval_passes(engine=DDPEngine(SimpleNamespace()))[0].begin(SimpleNamespace(args=SimpleNamespace())).reason \
        == 'on'
    for engine in (FSDP2Engine, DeepSpeedEngineAdapter):
        sharded, _ = _eval_passes(engine=engine(SimpleNamespace()))
        assert sharded.begin(SimpleNamespace(args=SimpleNamespace())).values['why'].startswith(
            f'{engine.name} on 2 processes: every eval forward enters')
    monkeypatch.setattr(distributed, 'sequence_parallel_size', lambda: 2)
    grouped, _ = _eval_passes(engine=DDPEngine(SimpleNamespace()))
    assert grouped.begin(SimpleNamespace(args=SimpleNamespace())).values['why'].startswith('sequence_parallel_size: 2')
    assert eval_loss_kind(LossKind('token_sum', None, '')).kind == 'token_mean'
    assert eval_loss_kind(LossKind('row_mean', 'x', 'y')).kind == 'row_mean'


def test_the_pieces_of_an_eval_batch_share_its_label_count_counted_once():
    """transformers passes a batch's label count, summed over the ranks (a collective), to its eval loss: every piece
    of a batch run again gets the whole batch's count, counted once a batch (the ranks stay in step), and the pieces'
    losses add up to the whole batch's; outside an eval batch (training) a batch's own count."""
    passes, _ = _eval_passes()
    passes.begin(SimpleNamespace(args=SimpleNamespace(predict_with_generate=False)))
    counted = []

    def count(batches):  # HF's count, "gathered": one call a collective
        counted.append(sum(b['input_ids'].shape[0] for b in batches))
        return sum(int((b['labels'][..., 1:] != -100).sum()) for b in batches) * 2  # and another rank's as many

    def num_items(batches):
        return passes.num_items(batches, count)

    batch = _batch()
    whole = _predict_mean(None, [], lambda batches: count(batches))(batch)
    counted.clear()
    calls = []
    loss, _, labels = passes.run(None, batch, _predict_mean(2, calls, num_items))
    assert calls == [6, 3, 2, 1, 2, 1] and counted == [6]  # one count a batch, of the whole batch, whatever its pieces
    assert loss.item() == pytest.approx(whole[0].item(), rel=1e-6) and torch.equal(labels, whole[2])
    counted.clear()
    loss, _, _ = passes.run(None, batch, _predict_mean(2, calls, num_items))  # cut in advance: counted once too
    assert counted == [6] and loss.item() == pytest.approx(whole[0].item(), rel=1e-6)
    counted.clear()
    assert passes.num_items([batch], count) == count([batch]) and counted == [6, 6]  # outside eval: each call counts


def test_pieces_put_together_by_hand():
    a = (torch.tensor(2.0), torch.ones(1, 3), (torch.zeros(1, 2), torch.ones(1, 2)))
    b = (torch.tensor(5.0), torch.zeros(2, 3), (torch.ones(2, 2), torch.zeros(2, 2)))
    loss, logits, labels = put_together([a, b], [0.25, 0.75])
    assert loss.item() == pytest.approx(0.25 * 2 + 0.75 * 5)
    assert logits.shape == (3, 3) and labels[0].shape == (3, 2) and labels[1][0].tolist() == [1.0, 1.0]
    assert put_together([(None, None, None), (None, None, None)], None) == (None, None, None)
    # pieces whose logits ms-swift kept from their own first label position on: padded at the end with -100, as HF
    # pads eval batches of other lengths (a row's logits and labels alike)
    short = (torch.tensor(1.0), torch.ones(1, 2, 4), torch.tensor([[-100, 7]]))
    long = (torch.tensor(1.0), torch.zeros(2, 3, 4), torch.tensor([[-100, -100, 5], [-100, 6, 8]]))
    _, logits, labels = put_together([short, long], [0.5, 0.5])
    assert logits.shape == (3, 3, 4) and (logits[0, 2] == -100).all() and (logits[0, :2] == 1).all()
    assert labels.tolist() == [[-100, 7, -100], [-100, -100, 5], [-100, 6, 8]]


# ---- end to end ---------------------------------------------------------------------------------------------------

def _run(model, data, val, out, injector_kwargs, **sft):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_runs import run_sft
    try:
        sdc.register(batch_schedule={'schedule': {0: 4}})
        with OomInjector(**injector_kwargs) as injector:
            run_sft(model, 'llama', data, out, callbacks=['batch_schedule'], max_steps=4,
                    per_device_train_batch_size=4, val_dataset=[val], eval_strategy='steps', eval_steps=2,
                    per_device_eval_batch_size=4, learning_rate=1e-3, lr_scheduler_type='constant', **sft)
    finally:
        plugin.unregister()
    return injector


@pytest.mark.e2e
@pytest.mark.parametrize('eval_metric', [None, 'acc'])
def test_swift_sft_eval_ooms_change_no_metric(tmp_path, tiny_llama, eval_metric):
    """Two evals of 12 rows in batches of 4; OOMs injected in the first eval's first forward and the second eval's
    second: the run ends, every eval metric and every training loss equal the run without them (1e-6), one ``oom``
    record ``phase: eval`` each, and later batches run at the cap each OOM set (2 rows, then 1). With ``eval_metric:
    acc`` the batches' logits are kept for the metric, each piece's as long as ms-swift keeps it (from the piece's own
    first label position on): the pieces used to fail to concatenate, ending the run."""
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    from swift_runs import decisions, read_jsonl
    data = str(write_gsm8k_dataset(tmp_path / 'train.jsonl', 24))
    val = str(write_gsm8k_dataset(tmp_path / 'val.jsonl', 12, 'test'))
    runs = {}
    for name, faults in (('plain', {}), ('oom', {'eval_passes': (0, 8)})):
        out = str(tmp_path / name)
        injector = _run(tiny_llama, data, val, out, faults, eval_metric=eval_metric)
        lines = read_jsonl(f'{out}/logging.jsonl')
        runs[name] = ([r for r in lines if 'eval_loss' in r], [r['loss'] for r in lines if 'loss' in r], injector,
                      decisions(out))
    (plain_evals, plain_losses, plain_injector, _), (evals, losses, injector, records) = runs['plain'], runs['oom']
    assert len(evals) == len(plain_evals) == 2 and losses == pytest.approx(plain_losses, rel=1e-6)
    for a, b in zip(plain_evals, evals):
        metrics = [k for k in a if k.startswith('eval_') and k not in ('eval_runtime', 'eval_samples_per_second',
                                                                      'eval_steps_per_second')]
        assert 'eval_token_acc' in metrics or len(metrics) > 1, a
        for k in metrics:
            assert b[k] == pytest.approx(a[k], rel=1e-6), (k, a, b)
    assert injector.eval_ooms == 2 and injector.counts == {'forward': 0, 'backward': 0}
    assert plain_injector.eval_forwards == [4, 4, 4] * 2
    # the first eval: 4 rows fail, 2 + 2, then its batches cut to the cap of 2; the second eval starts at the cap,
    # its second piece fails: 1 + 1, and the rest at the cap of 1
    assert injector.eval_forwards == [4, 2, 2, 2, 2, 2, 2] + [2, 2, 1, 1] + [1] * 8
    ooms = [d for d in records if d['kind'] == 'oom']
    assert [(d['reason'], d['values']['phase'], d['values']['rows'], d['values']['eval_cap']) for d in ooms] == [
        ('recovered', 'eval', 4, 2), ('recovered', 'eval', 2, 1)]
    [on] = [d for d in records if d['kind'] == 'eval_oom_recovery']
    assert on['reason'] == 'on'



@pytest.mark.e2e
@pytest.mark.engines
@pytest.mark.distributed
def test_two_processes_an_eval_oom_on_rank_1_changes_no_metric(tmp_path, tiny_llama):
    """DDP on 2 processes, two evals of 12 rows (6 a rank, batches of 4): rank 1 alone runs out of memory in its first
    eval forward (4 rows: run as 2 + 2, its batches capped at 2) and in a 2-row piece of the second eval (1 + 1). Each
    piece gets its batch's label count, counted once a batch on every rank (transformers sums it over the ranks: a
    rank that made more counts than the others used to put the ranks' collectives out of step and end the run), so
    the run ends and every eval metric and training loss equals the 2-process run without the OOMs (1e-6); rank 0
    writes both ``oom`` records with ``rank: 1``."""
    from engine_runs import assert_engine, run_ranks
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    from swift_runs import decisions, read_jsonl
    data = str(write_gsm8k_dataset(tmp_path / 'train.jsonl', 24))
    val = str(write_gsm8k_dataset(tmp_path / 'val.jsonl', 12, 'test'))
    runs = {}
    for name, faults in (('plain', {}), ('oom', {'1': {'oom_eval_passes': [0, 5]}})):
        out = run_ranks(str(tmp_path / name), tiny_llama, data, engine='ddp', callbacks=['batch_schedule'],
                        pack={'batch_schedule': {'schedule': {0: 2}}}, faults=faults, max_steps=4,
                        per_device_train_batch_size=2, val_dataset=[val], eval_strategy='steps', eval_steps=2,
                        per_device_eval_batch_size=4, learning_rate=1e-3, lr_scheduler_type='constant',
                        eval_metric='acc')  # logits kept: each rank's pieces padded, then HF pads across the ranks
        assert_engine(out, 'ddp')
        lines = read_jsonl(f'{out}/logging.jsonl')
        runs[name] = ([r for r in lines if 'eval_loss' in r], [r['loss'] for r in lines if 'loss' in r], out)
    (plain_evals, plain_losses, _), (evals, losses, out) = runs['plain'], runs['oom']
    assert len(evals) == len(plain_evals) == 2 and losses == pytest.approx(plain_losses, rel=1e-6)
    for a, b in zip(plain_evals, evals):
        metrics = [k for k in a if k.startswith('eval_') and not k.endswith(('_runtime', '_per_second'))]
        assert 'eval_loss' in metrics and 'eval_token_acc' in metrics, a
        for k in metrics:
            assert b[k] == pytest.approx(a[k], rel=1e-6), (k, a, b)
    with open(f'{out}/rank1.injected.json', encoding='utf-8') as f:
        assert json.load(f)['eval_ooms'] == 2
    ooms = [d for d in decisions(out) if d['kind'] == 'oom']
    assert [(d['reason'], d['values']['phase'], d['values']['rank'], d['values']['rows'], d['values']['eval_cap'])
            for d in ooms] == [('recovered', 'eval', 1, 4, 2), ('recovered', 'eval', 1, 2, 1)]
    [on] = [d for d in decisions(out) if d['kind'] == 'eval_oom_recovery']
    assert on['reason'] == 'on'

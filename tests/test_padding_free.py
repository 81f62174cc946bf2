"""Padding-free micro-batches (``length_batching.padding_free``): the packed row gives the padded micro-batch's loss
and gradient and never attends across rows (both tiny models, sdpa and eager, fp32), the train-start proof refuses
what would mix rows, the token budget counts real tokens, and a real swift sft run trains as the padded one does."""

from __future__ import annotations

import pytest
import torch

from swift_dynamic_callbacks.config import ConfigError
from swift_dynamic_callbacks.integrations.padding_free import check_packed_attention, flatten_rows
from swift_dynamic_callbacks.policies.length import BatchPlan, greedy_pieces


def padded_batch(rows, labels, *, left=False):
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    lab = torch.full((len(rows), longest), -100)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for k, (row, label) in enumerate(zip(rows, labels)):
        at = slice(longest - len(row), longest) if left else slice(0, len(row))
        ids[k, at], lab[k, at], mask[k, at] = row, label, 1
    return {'input_ids': ids, 'labels': lab, 'attention_mask': mask}


def model_of(path, implementation):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=implementation)


def rows_and_labels(vocab, lengths=(7, 12, 1, 5), seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab, (n, ), generator=generator) for n in lengths]
    labels = [r.clone() for r in rows]
    for label in labels:
        label[:2] = -100  # a prompt
    return rows, labels


def loss_and_grads(model, batch, num_items):
    model.zero_grad()
    inputs = {k: v for k, v in batch.items() if k != 'labels'}
    logits = model(**inputs).logits[0 if batch['input_ids'].shape[0] == 1 else slice(None)]
    labels = batch['labels'] if batch['input_ids'].shape[0] > 1 else batch['labels'][0]
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]  # what transformers' loss does
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift.reshape(-1),
                                             ignore_index=-100, reduction='sum') / num_items
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize('implementation', ['sdpa', 'eager'])
@pytest.mark.parametrize('arch', ['qwen2', 'llama'])
@pytest.mark.parametrize('left', [False, True])
def test_packed_row_has_the_padded_loss_and_gradient(arch, implementation, left, tiny_qwen, tiny_llama):
    model = model_of(tiny_qwen if arch == 'qwen2' else tiny_llama, implementation)
    rows, labels = rows_and_labels(model.config.vocab_size)
    padded = padded_batch(rows, labels, left=left)
    flat = flatten_rows(padded)
    assert flat['input_ids'].shape == (1, sum(len(r) for r in rows)) and 'attention_mask' not in flat
    assert flat['position_ids'][0].tolist() == [p for r in rows for p in range(len(r))]
    assert flat['use_cache'] is False
    items = int((padded['labels'][:, 1:] != -100).sum())
    assert int((flat['labels'][:, 1:] != -100).sum()) == items  # the same (prediction, label) pairs
    loss_padded, grads_padded = loss_and_grads(model, padded, items)
    loss_flat, grads_flat = loss_and_grads(model, flat, items)
    assert float(loss_flat) == pytest.approx(float(loss_padded), rel=1e-6)
    assert len(grads_flat) == len(grads_padded) > 0
    assert max(float((a - b).abs().max()) for a, b in zip(grads_flat, grads_padded)) < 1e-5


@pytest.mark.parametrize('implementation', ['sdpa', 'eager'])
@pytest.mark.parametrize('arch', ['qwen2', 'llama'])
def test_no_attention_across_packed_rows(arch, implementation, tiny_qwen, tiny_llama):
    model = model_of(tiny_qwen if arch == 'qwen2' else tiny_llama, implementation).eval()
    rows, labels = rows_and_labels(model.config.vocab_size, lengths=(6, 9, 4))
    other = [(rows[0] + 3) % model.config.vocab_size, rows[1], (rows[2] + 5) % model.config.vocab_size]
    with torch.no_grad():
        a = model(**{k: v for k, v in flatten_rows(padded_batch(rows, labels)).items() if k != 'labels'}).logits
        b = model(**{k: v for k, v in flatten_rows(padded_batch(other, labels)).items() if k != 'labels'}).logits
    # row B (positions 6..14) is unchanged and must not see row A's change; row C changed
    assert torch.equal(a[0, 6:15], b[0, 6:15])
    assert not torch.allclose(a[0, 15:], b[0, 15:])
    check_packed_attention(model)  # the train-start proof passes on both architectures


class Mixing(torch.nn.Module):
    """A model that ignores position_ids: every token sees every earlier one, packed or not."""

    def __init__(self, implementation='sdpa'):
        super().__init__()
        self.config = type('Config', (), {'vocab_size': 16, '_attn_implementation': implementation})()
        self.embed = torch.nn.Embedding(16, 16)

    def forward(self, input_ids, position_ids=None, use_cache=None):
        return type('Out', (), {'logits': self.embed(input_ids).cumsum(dim=1)})()


def test_the_train_start_proof_refuses_what_would_mix_rows():
    with pytest.raises(ConfigError, match='attends across rows'):
        check_packed_attention(Mixing())
    with pytest.raises(ConfigError, match='attn_impl sdpa or eager'):
        check_packed_attention(Mixing('flash_attention_2'))


def test_flatten_refuses_what_it_cannot_flatten():
    rows = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    batch = padded_batch(rows, [r.clone() for r in rows])
    batch['pixel_values'] = torch.zeros(2, 3, 4, 4)
    with pytest.raises(ValueError, match="'pixel_values'"):
        flatten_rows(batch)
    batch.pop('pixel_values')
    batch['position_ids'] = torch.zeros(3, 2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match='position_ids of shape'):
        flatten_rows(batch)


def test_padding_free_token_budget_counts_real_tokens():
    plan = BatchPlan(max_tokens=100, padding_free=True, bucketing=False)
    lengths = [10, 90, 5, 60, 30, 150, 1, 1]
    sizes = greedy_pieces(lengths, plan)
    at = 0
    for size in sizes:
        piece = lengths[at:at + size]
        assert sum(piece) <= 100 or size == 1
        at += size
    assert sizes == [2, 3, 1, 2]  # 10+90 | 5+60+30 | 150 (alone, over) | 1+1
    assert greedy_pieces(lengths, BatchPlan(max_tokens=100, bucketing=False)) != sizes  # padded: n x longest


@pytest.mark.e2e
def test_swift_sft_padding_free_trains_as_the_padded_run(tmp_path, tiny_llama):
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    from swift_runs import decisions, run_sft, sample_trace, train_logs
    data = str(write_mixed_length_dataset(tmp_path / 'mixed.jsonl', n=12))
    runs = {}
    for padding_free in (False, True):
        try:
            sdc.register(length_batching={'mode': 'balanced', 'padding_free': padding_free},
                         integration={'record_samples': True})
            runs[padding_free] = run_sft(
                tiny_llama, 'llama', data, str(tmp_path / f'out-{padding_free}'), callbacks=['length_batching'],
                max_steps=-1, num_train_epochs=1, per_device_train_batch_size=3, gradient_accumulation_steps=1,
                max_length=2048, lora_dropout=0.0, attn_impl='sdpa')
        finally:
            plugin._configured = None
    padded, packed = (train_logs(runs[k]) for k in (False, True))
    assert [r['batches'] for r in sample_trace(runs[False])] == [r['batches'] for r in sample_trace(runs[True])]
    assert len(padded) == len(packed) == 4
    for a, b in zip(padded, packed):
        assert b['loss'] == pytest.approx(a['loss'], rel=1e-4)  # the same samples, the same gradients
        assert b['dynamic/padding_fraction'] == 0.0 and a['dynamic/padding_fraction'] > 0
    assert packed[-1]['dynamic/padded_tokens_seen'] == packed[-1]['dynamic/tokens_seen']
    [plan] = [d for d in decisions(runs[True]) if d['kind'] == 'batch_plan']
    assert 'padding-free' in plan['message']

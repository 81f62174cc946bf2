"""A step's batches made ready at the step boundary (``integrations/inputs.py``): packed on the host with their rows'
lengths, cut into smaller packed passes at row boundaries, mask-free when every row has the same length (the same
loss), slots with several passes prepared pass by pass."""

from __future__ import annotations

import pytest
import torch

from swift_dynamic_callbacks.integrations.inputs import prepare_batch, prepare_slot, same_length_rows, to_device
from swift_dynamic_callbacks.integrations.padding_free import PackedBatch, flatten_rows, split_packed
from swift_dynamic_callbacks.integrations.passes import batch_shape, row_tokens, split_micro_batch
from swift_dynamic_callbacks.data.slots import EmptyMicroBatch, PassGroup


def padded(lengths, width=None, left=False):
    width = width or max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, n in enumerate(lengths):
        span = slice(width - n, width) if left else slice(0, n)
        ids[r, span] = torch.arange(1, n + 1) + 100 * r
        mask[r, span] = 1
        labels[r, span] = ids[r, span]
    return {'input_ids': ids, 'attention_mask': mask, 'labels': labels}


def test_equal_rows_lose_their_mask_and_unequal_rows_keep_it():
    same = padded([5, 5, 5])
    assert same_length_rows(same) and 'attention_mask' not in prepare_batch(same, padding_free=False, device=None)
    ragged = padded([5, 3])
    assert not same_length_rows(ragged)
    kept = prepare_batch(ragged, padding_free=False, device=None)
    assert torch.equal(kept['attention_mask'], ragged['attention_mask'])
    assert to_device(ragged, None) is ragged and to_device(ragged, torch.device('cpu')) is ragged


def test_packed_rows_know_their_lengths_and_split_at_row_boundaries():
    batch = padded([4, 2, 3, 1], left=True)
    packed = prepare_batch(batch, padding_free=True, device=None)
    assert isinstance(packed, PackedBatch) and packed.row_lengths == (4, 2, 3, 1)
    assert batch_shape(packed) == (4, 4) and row_tokens(packed, 2) == 3
    assert packed['input_ids'].shape == (1, 10)
    for pieces in (1, 2, 3, 4, 9):
        parts = split_micro_batch(packed, pieces)
        assert len(parts) == min(pieces, 4)
        assert torch.equal(torch.cat([p['input_ids'] for p in parts], dim=1), packed['input_ids'])
        assert torch.equal(torch.cat([p['labels'] for p in parts], dim=1), packed['labels'])
        assert sum((p.row_lengths for p in parts), ()) == packed.row_lengths
        for part in parts:  # each piece is a packed row of its own: positions restart at its first token
            assert int(part['position_ids'][0, 0]) == 0 and part['input_ids'].shape[1] == sum(part.row_lengths)
            assert part['labels'][0, 0] == -100  # a row's first label is ignored, as in the whole packed row
    assert split_packed(packed, 1) == [packed]
    # the same pieces as flattening the padded rows piece by piece (the runner's way before this)
    by_rows = [flatten_rows(p) for p in split_micro_batch(batch, 2)]
    for a, b in zip(split_micro_batch(packed, 2), by_rows):
        assert all(torch.equal(a[k], b[k]) for k in ('input_ids', 'labels', 'position_ids'))


def test_slots_are_prepared_pass_by_pass():
    group = PassGroup([padded([3, 3]), padded([5, 2])])
    ready = prepare_slot(group, padding_free=False, device=None)
    assert isinstance(ready, PassGroup) and len(ready.passes) == 2
    assert 'attention_mask' not in ready.passes[0] and 'attention_mask' in ready.passes[1]
    empty = EmptyMicroBatch()
    assert prepare_slot(empty, padding_free=True, device=None) is empty


@pytest.mark.parametrize('arch', ['qwen2', 'llama'])
def test_a_mask_free_batch_has_the_loss_of_its_all_ones_mask(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    from swift_dynamic_callbacks.testing.tiny import build_tiny_model
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / arch, arch), attn_implementation='sdpa')
    batch = padded([6, 6])
    free = prepare_batch(batch, padding_free=False, device=None)
    with torch.no_grad():
        a = model(**batch).loss
        b = model(**free).loss
    assert torch.allclose(a, b, atol=1e-6, rtol=0)

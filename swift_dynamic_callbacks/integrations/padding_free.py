"""Padding-free micro-batches for any attention implementation that masks packed rows by ``position_ids``.

ms-swift's own ``padding_free`` / ``packing`` need flash attention. transformers (5.x ``masking_utils``) also keeps
attention inside each row for sdpa and eager when a batch has no ``attention_mask``, no cache, and ``position_ids``
that restart at 0 for every row. :func:`flatten_rows` turns the host's padded micro-batch into that form at the step
boundary, on the host (no device synchronisation): the rows' real tokens concatenated into one ``[1, N]`` row,
``position_ids`` restarting per row, each row's first label ignored (in the padded batch nothing predicts a row's first
token; here the previous row's last token would), ``use_cache=False``. The result is a :class:`PackedBatch` that knows
its rows' lengths, so a pass can still be cut into smaller ones at row boundaries (:func:`split_packed`: OOM recovery,
pass limits) without reading the device. The loss is the same sum over the same (prediction, label) pairs, so with
ms-swift's token-sum normalisation the gradient is the padded batch's.

:func:`check_packed_attention` proves it on the model at hand before training: two rows run packed, and changing the
first row must not change the second row's logits (causal attention already keeps the first from the second).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Mapping, Sequence

import torch

from ..config import ConfigError

#: attention implementations whose masks follow packed ``position_ids`` (checked by :func:`check_packed_attention`)
SUPPORTED_ATTENTION = ('sdpa', 'eager')
#: per-token tensors that are flattened with the tokens
TOKEN_KEYS = ('input_ids', 'labels', 'attention_mask', 'position_ids', 'loss_scale')


class PackedBatch(dict):
    """A micro-batch flattened by :func:`flatten_rows`: ``input_ids`` ``[1, N]`` and the rest, plus ``row_lengths``
    (host ints: the real tokens of each packed row, in order)."""

    def __init__(self, values: Mapping[str, Any], row_lengths: Sequence[int]) -> None:
        super().__init__(values)
        self.row_lengths = tuple(int(n) for n in row_lengths)


def split_packed(batch: PackedBatch, pieces: int) -> list[PackedBatch]:
    """Cut a packed row into at most ``pieces`` packed rows at row boundaries (as :func:`~.passes.split_micro_batch`
    cuts a padded one: rows as even as possible, in order); slicing by host ints, no device synchronisation. Every
    piece is a valid packed row: positions restart per row and each row's first label is already ignored."""
    from ..policies.data_plan import piece_bounds
    lengths = [n for n in batch.row_lengths if n]
    bounds = piece_bounds(len(lengths), pieces)
    if len(bounds) <= 1:
        return [batch]
    starts = [0, *accumulate(lengths)]
    out = []
    for a, b in bounds:
        lo, hi = starts[a], starts[b]
        values = {k: (v[:, lo:hi] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[-1] == starts[-1]
                      else v) for k, v in batch.items()}
        out.append(PackedBatch(values, lengths[a:b]))
    return out


def flatten_rows(batch: Mapping[str, Any]) -> PackedBatch:
    """The padded micro-batch ``batch`` (``input_ids`` ``[b, T]``, ``attention_mask`` marking real tokens, left or
    right padding) as one packed ``[1, N]`` row (module docstring). Values that are not per-row tensors are kept.
    Reads the mask on the tensors' device: call it on the host.

    Raises:
        ValueError: a per-row tensor this cannot flatten (e.g. images, 3-D position ids), named.
    """
    ids = batch.get('input_ids')
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError('padding_free: the micro-batch has no 2-D input_ids tensor to flatten')
    rows = ids.shape[0]
    mask = batch.get('attention_mask')
    padded = isinstance(mask, torch.Tensor) and mask.shape == ids.shape
    keep = mask.bool() if padded else torch.ones_like(ids, dtype=torch.bool)
    lengths = keep.sum(dim=1).tolist()
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ('attention_mask', 'position_ids'):
            continue
        if key in TOKEN_KEYS and isinstance(value, torch.Tensor) and value.shape == ids.shape:
            out[key] = value[keep][None]
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows and rows > 1:
            raise ValueError(f'padding_free: cannot flatten the micro-batch key {key!r} of shape {tuple(value.shape)} '
                             '(only input_ids, labels, loss_scale and the attention mask are per-token); use '
                             'padding_free: false for this data')
        else:
            out[key] = value
    positions = batch.get('position_ids')
    if isinstance(positions, torch.Tensor) and positions.dim() != 2:
        raise ValueError(f'padding_free: position_ids of shape {tuple(positions.shape)} (e.g. multimodal rope) '
                         'cannot be rebuilt per row; use padding_free: false')
    out['position_ids'] = torch.cat([torch.arange(n, device=ids.device) for n in lengths if n])[None]
    if isinstance(out.get('labels'), torch.Tensor):
        labels = out['labels'].clone()
        starts = [0, *accumulate(lengths[:-1])]  # where each row begins in the packed row
        labels[0, [s for s, n in zip(starts, lengths) if n]] = -100
        out['labels'] = labels
    out['use_cache'] = False
    return PackedBatch(out, [n for n in lengths if n])


def attention_implementation(model: Any) -> str | None:
    config = getattr(model, 'config', None)
    return getattr(config, '_attn_implementation', None) or getattr(config, 'attn_implementation', None)


@torch.no_grad()
def check_packed_attention(model: Any, setting: str = 'length_batching.padding_free') -> None:
    """Refuse padding-free micro-batches where the model would attend across packed rows: an attention
    implementation outside :data:`SUPPORTED_ATTENTION`, or a model whose second row's logits change with the first
    row's tokens (two tiny forwards, in eval mode, on the model's device; causal attention never lets the first row
    see the second, so the second is the one to watch)."""
    implementation = attention_implementation(model)
    if implementation not in SUPPORTED_ATTENTION:
        raise ConfigError(f'{setting}: true needs attn_impl sdpa or eager (got {implementation!r}): those mask packed '
                          'rows by position_ids in transformers; with flash attention use ms-swift\'s own '
                          'padding_free: true')
    device = next(model.parameters()).device
    vocab = int(getattr(getattr(model, 'config', None), 'vocab_size', 0) or 32)
    second = torch.arange(1, 5, device=device) % vocab
    positions = torch.arange(4, device=device).repeat(2)[None]
    was_training = model.training
    model.eval()
    try:
        a = model(input_ids=torch.cat([(second + 7) % vocab, second])[None], position_ids=positions, use_cache=False)
        b = model(input_ids=torch.cat([(second + 11) % vocab, second])[None], position_ids=positions, use_cache=False)
    finally:
        model.train(was_training)
    if not torch.allclose(a.logits[0, 4:].float(), b.logits[0, 4:].float(), atol=1e-5, rtol=1e-4):
        raise ConfigError(f'{setting}: this model ({type(model).__name__}, attn_impl {implementation}) attends '
                          'across rows packed by position_ids (the second row\'s logits changed with the first '
                          'row\'s tokens), so padding-free micro-batches would mix samples; use padding_free: false')

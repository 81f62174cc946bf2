"""Padding-free micro-batches: every micro-batch one packed row, attention kept inside each row.

ms-swift's own ``padding_free`` / ``packing`` need flash attention. transformers (5.x) keeps attention inside each
row of a packed batch for every attention implementation when a batch has no ``attention_mask``, no cache, and
``position_ids`` that restart at 0 for every row. :func:`flatten_rows` turns the host's padded micro-batch into that
form at the step boundary, on the host (no device synchronisation): the rows' real tokens concatenated into one
``[1, N]`` row, ``position_ids`` restarting per row, each row's first label ignored (in the padded batch nothing
predicts a row's first token; here the previous row's last token would), ``use_cache=False``. The result is a
:class:`PackedBatch` that knows its rows' lengths, so a pass can still be cut into smaller ones at row boundaries
(:func:`split_packed`: OOM recovery, pass limits) without reading the device. The loss is the same sum over the same
(prediction, label) pairs, so with ms-swift's token-sum normalisation the gradient is the padded batch's.

What a packed row of ``N`` tokens in rows of ``L_i`` costs, and what is added to it on the host before it runs
(flex's filler, flash's boundaries), is its attention backend's (:mod:`.attention`, one module a backend:
:func:`~.attention.finish_packed`). Which of them the rows run with, and the proof that it keeps rows apart, is
:mod:`.packed_attention`'s (this module only packs: host tensors in, host tensors out).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Mapping

import torch

from .attention import PackedBatch, backend_for, finish_packed

#: per-token tensors that are flattened with the tokens
TOKEN_KEYS = ('input_ids', 'labels', 'attention_mask', 'position_ids', 'loss_scale')

def packed_rows_only(batch: PackedBatch) -> PackedBatch:
    """``batch`` without what :func:`finish_packed` added (the filler row, the keys its backend adds)."""
    tokens = sum(batch.row_lengths)
    added = backend_for(batch.attention).added_keys
    values = {k: (v[:, :tokens] if batch.fill and isinstance(v, torch.Tensor) and v.dim() == 2
                  and v.shape[-1] == tokens + batch.fill else v) for k, v in batch.items() if k not in added}
    return PackedBatch(values, batch.row_lengths)


def split_packed(batch: PackedBatch, pieces: int) -> list[PackedBatch]:
    """Cut a packed row into at most ``pieces`` packed rows at row boundaries (as :func:`~.passes.split_micro_batch`
    cuts a padded one: rows as even as possible, in order), each finished again for the batch's attention; slicing
    by host ints, no device synchronisation. Every piece is a valid packed row: positions restart per row and each
    row's first label is already ignored."""
    from ..policies.data_plan import piece_bounds
    lengths = [n for n in batch.row_lengths if n]
    bounds = piece_bounds(len(lengths), pieces)
    if len(bounds) <= 1:
        return [batch]
    rows = packed_rows_only(batch)
    starts = [0, *accumulate(lengths)]
    out = []
    for a, b in bounds:
        lo, hi = starts[a], starts[b]
        values = {k: (v[:, lo:hi] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[-1] == starts[-1]
                      else v) for k, v in rows.items()}
        out.append(finish_packed(PackedBatch(values, lengths[a:b]), batch.attention))
    return out


def flatten_rows(batch: Mapping[str, Any], attention: str = 'sdpa') -> PackedBatch:
    """The padded micro-batch ``batch`` (``input_ids`` ``[b, T]``, ``attention_mask`` marking real tokens, left or
    right padding) as one packed ``[1, N]`` row (module docstring), finished for ``attention``
    (:func:`finish_packed`). Values that are not per-row tensors are kept. Reads the mask on the tensors' device:
    call it on the host.

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
    return finish_packed(PackedBatch(out, [n for n in lengths if n]), attention)

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

What each attention implementation computes for a packed row of ``N`` tokens in rows of ``L_i`` (what
:func:`finish_packed` adds for it):

- ``sdpa`` / ``eager``: a dense ``N x N`` mask from the positions, every masked pair computed (``N^2``); nothing added;
- ``flex_attention``: a block mask from the positions, whole masked ``128 x 128`` blocks skipped (about
  ``sum L_i^2``); the row is filled up to a multiple of 128 tokens with a filler row of its own (labels ignored,
  positions restarting), so the compiled kernels see few distinct lengths (and torch 2.13's CPU kernel, wrong at some
  lengths that are not multiples of 16, is never asked for them);
- ``flash_attention_2`` / ``_3`` / ``_4``: the varlen kernel (``sum L_i^2``), given the rows' boundaries
  (``cu_seq_lens_q`` / ``_k``, ``max_length_q`` / ``_k``) from the host: without them transformers finds the rows
  from the positions on the device, a synchronisation in every layer.

Which of them the rows run with, and the proof that it keeps rows apart, is :mod:`.packed_attention`'s (this module
only packs: host tensors in, host tensors out).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Mapping, Sequence

import torch

#: attention implementations that keep packed rows apart by ``position_ids`` (proven by
#: :func:`.packed_attention.check_packed_attention`)
DENSE_ATTENTION = ('sdpa', 'eager')
FLASH_ATTENTION = ('flash_attention_2', 'flash_attention_3', 'flash_attention_4')
SUPPORTED_ATTENTION = DENSE_ATTENTION + ('flex_attention', ) + FLASH_ATTENTION
#: ``flex_attention``: a packed row is filled up to a multiple of this many tokens (its block size)
FLEX_BLOCK = 128
#: per-token tensors that are flattened with the tokens
TOKEN_KEYS = ('input_ids', 'labels', 'attention_mask', 'position_ids', 'loss_scale')
#: the rows' boundaries handed to flash attention's varlen kernel
VARLEN_KEYS = ('cu_seq_lens_q', 'cu_seq_lens_k', 'max_length_q', 'max_length_k')


class PackedBatch(dict):
    """A micro-batch flattened by :func:`flatten_rows`: ``input_ids`` ``[1, N]`` and the rest, plus ``row_lengths``
    (host ints: the real tokens of each packed row, in order), the ``attention`` it was finished for
    (:func:`finish_packed`) and ``fill`` (filler tokens after the rows)."""

    def __init__(self, values: Mapping[str, Any], row_lengths: Sequence[int], attention: str = 'sdpa',
                 fill: int = 0) -> None:
        super().__init__(values)
        self.row_lengths = tuple(int(n) for n in row_lengths)
        self.attention = attention
        self.fill = int(fill)


def finish_packed(batch: PackedBatch, attention: str) -> PackedBatch:
    """``batch`` (packed rows only: no filler, no boundaries) made ready for ``attention`` (module docstring): a
    filler row up to a multiple of :data:`FLEX_BLOCK` for ``flex_attention``, the rows' boundaries for flash
    attention, nothing for the others. Built from host ints on the batch's device, without reading it."""
    if attention == 'flex_attention':
        tokens = sum(batch.row_lengths)
        fill = -tokens % FLEX_BLOCK
        if not fill:
            return PackedBatch(batch, batch.row_lengths, attention)
        values = dict(batch)
        ids = batch['input_ids']
        filler = {'input_ids': torch.zeros(1, fill, dtype=ids.dtype, device=ids.device),
                  'labels': torch.full((1, fill), -100, dtype=ids.dtype, device=ids.device),
                  'position_ids': torch.arange(fill, device=ids.device)[None]}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[-1] == tokens:
                extra = filler.get(key, torch.zeros(1, fill, dtype=value.dtype, device=value.device))  # loss_scale: 0
                values[key] = torch.cat([value, extra.to(value.dtype)], dim=1)
        return PackedBatch(values, batch.row_lengths, attention, fill)
    if attention in FLASH_ATTENTION:
        device = batch['input_ids'].device
        bounds = torch.tensor([0, *accumulate(batch.row_lengths)], dtype=torch.int32)
        bounds = bounds.pin_memory().to(device, non_blocking=True) if device.type == 'cuda' else bounds.to(device)
        longest = max(batch.row_lengths, default=0)
        values = {**batch, 'cu_seq_lens_q': bounds, 'cu_seq_lens_k': bounds, 'max_length_q': longest,
                  'max_length_k': longest}
        return PackedBatch(values, batch.row_lengths, attention)
    return PackedBatch(batch, batch.row_lengths, attention)


def packed_rows_only(batch: PackedBatch) -> PackedBatch:
    """``batch`` without what :func:`finish_packed` added (the filler row, the rows' boundaries)."""
    tokens = sum(batch.row_lengths)
    values = {k: (v[:, :tokens] if batch.fill and isinstance(v, torch.Tensor) and v.dim() == 2
                  and v.shape[-1] == tokens + batch.fill else v) for k, v in batch.items() if k not in VARLEN_KEYS}
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

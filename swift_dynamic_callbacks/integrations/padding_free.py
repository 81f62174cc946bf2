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

:func:`best_packed_attention` chooses among them (``integration.packed_attention: auto``: flash-attn where it is
installed, else ``flex_attention`` on CUDA, else what the model has), and :func:`check_packed_attention` proves the
choice on the model at hand before training: two rows run packed, and changing the first row must not change the
second row's logits (causal attention already keeps the first from the second); a kernel switched to must also run
backward (:func:`check_packed_backward`).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Mapping, Sequence

import torch

from ..config import ConfigError

#: attention implementations that keep packed rows apart by ``position_ids`` (checked by :func:`check_packed_attention`)
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


def attention_implementation(model: Any) -> str | None:
    config = getattr(model, 'config', None)
    return getattr(config, '_attn_implementation', None) or getattr(config, 'attn_implementation', None)


def best_packed_attention(current: str | None, *, mode: str, cuda: bool, flash: str | None,
                          flex: bool) -> tuple[str | None, str]:
    """The attention implementation packed rows should run with, and why (pure). ``mode``: ``keep`` (the model's),
    ``auto`` (switch from sdpa, the default the user did not choose for packing, to the best the machine has:
    ``flash`` (the installed flash attention implementation, or ``None``), else ``flex_attention`` on CUDA where
    ``flex``; eager, flash and flex chosen by the user are kept)."""
    if mode == 'keep':
        return current, 'integration.packed_attention: keep'
    if current != 'sdpa':
        return current, f'the model runs {current} (only sdpa is switched)'
    if not cuda:
        return current, 'not on CUDA (flex_attention has no backward on CPU; flash-attn needs CUDA)'
    if flash:
        return flash, 'flash-attn is installed: its varlen kernel attends within each row only'
    if flex:
        return 'flex_attention', ('flash-attn is not installed: flex_attention skips the masked blocks between '
                                  'rows (sdpa computes all N^2 pairs)')
    return current, 'neither flash-attn nor flex_attention is available'


def installed_flash_attention() -> str | None:
    """The flash attention implementation transformers can load here (3 before 2), or ``None``."""
    from transformers.utils import import_utils
    for name, check in (('flash_attention_3', 'is_flash_attn_3_available'),
                        ('flash_attention_2', 'is_flash_attn_2_available')):
        if getattr(import_utils, check, lambda: False)():
            return name
    return None


def transformers_model(model: Any) -> Any:
    """The outermost transformers model in ``model`` (itself, or inside PEFT / ms-swift wrappers), or ``None``."""
    from transformers import PreTrainedModel
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    return next((m for m in modules if isinstance(m, PreTrainedModel)), None)


def use_packed_attention(model: Any, mode: str, setting: str = 'length_batching.padding_free', *,
                         probe_backward: bool = True) -> dict[str, Any]:
    """Switch ``model`` (a transformers model, possibly inside PEFT) to :func:`best_packed_attention`'s choice and
    prove it keeps packed rows apart (:func:`check_packed_attention`) and, with ``probe_backward`` (engines whose
    backward holds no collectives), that it runs backward (:func:`check_packed_backward`); a choice that fails to
    load or either proof is undone and the model's own is proven instead. Returns what was decided (``old``,
    ``new``, ``why``)."""
    from transformers.utils import is_torch_flex_attn_available
    old = attention_implementation(model)
    device = next(model.parameters()).device
    new, why = best_packed_attention(old, mode=mode, cuda=device.type == 'cuda', flash=installed_flash_attention(),
                                     flex=is_torch_flex_attn_available())
    base = transformers_model(model) if new != old else None
    if new != old and base is None:
        new, why = old, f'no transformers model inside {type(model).__name__} to switch to {new}; kept {old}'
    if new != old:
        try:
            base.set_attn_implementation(new)
            check_packed_attention(model, setting)
            if probe_backward:
                check_packed_backward(model, new)
        except Exception as error:  # noqa: BLE001 - any failure of the better kernel falls back, said in the record
            base.set_attn_implementation(old)
            why = f'{new} failed ({type(error).__name__}: {str(error)[:200]}); kept {old}'
            new = old
        else:
            return {'old': old, 'new': new, 'why': why}
    check_packed_attention(model, setting)
    return {'old': old, 'new': new, 'why': why}


def probe_rows(model: Any, attention: str, shift: int) -> PackedBatch:
    """Two packed rows of 4 tokens on the model's device, finished for ``attention``: the second is always the same,
    the first is the second's tokens moved by ``shift`` (the train-start proofs' input)."""
    device = next(model.parameters()).device
    vocab = int(getattr(getattr(model, 'config', None), 'vocab_size', 0) or 32)
    second = torch.arange(1, 5, device=device) % vocab
    values = {'input_ids': torch.cat([(second + shift) % vocab, second])[None],
              'position_ids': torch.arange(4, device=device).repeat(2)[None]}
    return finish_packed(PackedBatch(values, (4, 4)), attention)


def check_packed_backward(model: Any, attention: str) -> None:
    """One forward and backward of two packed rows finished for ``attention`` (:func:`probe_rows`), the gradient
    taken to the input embeddings only (the parameters' gradients stay as they are): a kernel that cannot run
    backward here (flex attention on CPU, a compile that fails) fails now, before training, not in the first training
    step."""
    packed = dict(probe_rows(model, attention, 7))
    embeds = model.get_input_embeddings()(packed.pop('input_ids')).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, **packed, use_cache=False).logits
    torch.autograd.grad(logits.float().sum(), embeds)


@torch.no_grad()
def check_packed_attention(model: Any, setting: str = 'length_batching.padding_free') -> None:
    """Refuse padding-free micro-batches where the model would attend across packed rows: an attention
    implementation outside :data:`SUPPORTED_ATTENTION`, or a model whose second row's logits change with the first
    row's tokens (two tiny forwards of :func:`probe_rows` finished for the model's attention, in eval mode, on the
    model's device; causal attention never lets the first row see the second, so the second is the one to watch)."""
    implementation = attention_implementation(model)
    if implementation not in SUPPORTED_ATTENTION:
        raise ConfigError(f'{setting}: true needs attn_impl {" / ".join(SUPPORTED_ATTENTION)} (got '
                          f'{implementation!r}): those keep packed rows apart by position_ids in transformers')

    def logits(shift: int) -> torch.Tensor:
        return model(**probe_rows(model, implementation, shift), use_cache=False).logits[0, 4:8].float()

    was_training = model.training
    model.eval()
    try:
        a, b = logits(7), logits(11)
    finally:
        model.train(was_training)
    if not torch.allclose(a, b, atol=1e-5, rtol=1e-4):
        raise ConfigError(f'{setting}: this model ({type(model).__name__}, attn_impl {implementation}) attends '
                          'across rows packed by position_ids (the second row\'s logits changed with the first '
                          'row\'s tokens), so padding-free micro-batches would mix samples; use padding_free: false')

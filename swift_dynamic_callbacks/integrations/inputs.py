"""A step's batches made ready once, at the step boundary, so that running its passes never waits on the device.

The loader collates on the host. Before the step's first pass, every batch of the step is, in this order:

1. packed into one row when the plan is padding-free (:func:`.padding_free.flatten_rows`, on the host: the rows'
   lengths are read from the host's attention mask, never from the device; flash attention's row boundaries and
   flex_attention's filler are built there too);
2. left without its ``attention_mask`` when every row has the same length (the mask is all ones): the model then
   builds its plain causal mask, and sdpa takes its causal fast path instead of a dense masked one; the loss is the
   same (kept under sequence parallelism and where HF counts input tokens by the mask: :func:`mask_may_go`);
3. copied to the training device from pinned memory without blocking (CUDA only). HF's ``training_step`` would
   otherwise copy each tensor of each micro-batch from pageable memory, and each such copy waits for the device to
   finish its queue: a synchronisation per tensor per micro-batch. Already on the device, HF's own copy does nothing.

Nothing here reads a device tensor (no ``.item()``, ``.tolist()``, ``bool()`` of a device tensor).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..data.slots import EmptyMicroBatch, PassGroup
from .input_kinds import InputKind
from .padding_free import PackedBatch, flatten_rows


def mask_may_go(args: Any) -> bool:
    """Whether an all-ones ``attention_mask`` may be dropped (step 2 of the module docstring): not under sequence
    parallelism (transformers would read the split rows' positions as packed rows), nor where HF counts input tokens by
    the mask (``include_num_input_tokens_seen: non_padding``: without it HF counts the tokens that are not the pad
    token, and a model whose pad token is a real one, as SmolLM2's ``<|im_end|>``, would count fewer than without the
    pack)."""
    from .. import distributed
    return (distributed.sequence_parallel_size() == 1
            and getattr(args, 'include_num_input_tokens_seen', 'no') != 'non_padding')


def prepare_slot(slot: Any, *, padding_free: bool, device: torch.device | None, attention: str = 'sdpa',
                 kind: InputKind | None = None, mask_free: bool = True) -> Any:
    """One of HF's micro-batch slots (an empty one, a batch, or a :class:`PassGroup`) with every batch prepared
    (``mask_free``: an all-ones mask may be dropped; not under sequence parallelism, where transformers would read
    the split rows' positions as packed rows)."""
    if isinstance(slot, EmptyMicroBatch):
        return slot
    options = dict(padding_free=padding_free, device=device, attention=attention, kind=kind, mask_free=mask_free)
    if isinstance(slot, PassGroup):  # its padding passes (empty: engines whose every pass communicates) stay empty
        return PassGroup([b if isinstance(b, EmptyMicroBatch) else prepare_batch(b, **options) for b in slot.passes])
    return prepare_batch(slot, **options)


def prepare_batch(batch: Any, *, padding_free: bool, device: torch.device | None, attention: str = 'sdpa',
                  kind: InputKind | None = None, mask_free: bool = True) -> Any:
    """One collated batch, packed (for ``attention``: :func:`.attention.finish_packed`) or mask-free as the
    module docstring says, with what its input ``kind`` needs to cut it later (:meth:`~.input_kinds.InputKind.prepare`,
    on the host), then on ``device`` (``None``: left where it is)."""
    if not isinstance(batch, Mapping):
        return batch
    if padding_free:
        batch = flatten_rows(batch, attention)
    else:
        if mask_free and same_length_rows(batch):
            batch = type(batch)({k: v for k, v in batch.items() if k != 'attention_mask'})
        if kind is not None:
            batch = kind.prepare(batch)
    return to_device(batch, device)


def same_length_rows(batch: Mapping[str, Any]) -> bool:
    """Whether a padded batch has no padding at all (a host tensor's all-ones ``attention_mask`` of 2-D ids)."""
    mask, ids = batch.get('attention_mask'), batch.get('input_ids')
    return (isinstance(mask, torch.Tensor) and isinstance(ids, torch.Tensor) and mask.dim() == 2
            and mask.shape == ids.shape and mask.device.type == 'cpu' and bool(mask.all()))


def to_device(batch: Mapping[str, Any], device: torch.device | None) -> Any:
    """``batch``'s host tensors copied to a CUDA ``device`` from pinned memory without blocking (else unchanged);
    a :class:`PackedBatch` keeps its rows' lengths."""
    if device is None or torch.device(device).type != 'cuda':
        return batch
    moved = {k: (v.pin_memory().to(device, non_blocking=True) if isinstance(v, torch.Tensor) and v.device.type == 'cpu'
                 else v) for k, v in batch.items()}
    if isinstance(batch, PackedBatch):
        return PackedBatch(moved, batch.row_lengths, batch.attention, batch.fill)
    if hasattr(batch, 'rebuild'):  # a kind's batch with host facts (:class:`.input_kinds.VisionBatch`): kept
        return batch.rebuild(moved)
    return type(batch)(moved) if type(batch) is not dict else moved

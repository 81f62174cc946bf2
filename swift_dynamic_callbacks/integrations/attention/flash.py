"""``flash``: the installed flash attention (3, else 2; ``flash_attention_4`` is run where the model already uses it),
whose varlen kernel attends within each packed row only (``sum L_i^2``). It is given the rows' boundaries
(:data:`VARLEN_KEYS`) from the host: without them transformers finds the rows from the positions on the device, a
synchronisation in every layer. Needs CUDA and flash-attn."""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch

from .base import AttentionBackend, PackedBatch

#: the rows' boundaries handed to flash attention's varlen kernel
VARLEN_KEYS = ('cu_seq_lens_q', 'cu_seq_lens_k', 'max_length_q', 'max_length_k')


def installed_flash_attentions() -> list[str]:
    """The flash attention implementations transformers can load here, 3 before 2."""
    from transformers.utils import import_utils
    return [name for name, check in (('flash_attention_3', 'is_flash_attn_3_available'),
                                     ('flash_attention_2', 'is_flash_attn_2_available'))
            if getattr(import_utils, check, lambda: False)()]


class FlashAttention(AttentionBackend):
    """flash-attn's varlen kernel (module docstring); ``auto``'s first choice."""

    name = 'flash'
    implementations = ('flash_attention_2', 'flash_attention_3', 'flash_attention_4')
    preference = 2
    label = 'flash-attn'
    off_cuda = 'flash-attn needs CUDA'
    auto_why = 'flash-attn is installed: its varlen kernel attends within each row only'
    added_keys = VARLEN_KEYS

    def installed(self) -> tuple[str, ...]:
        return tuple(installed_flash_attentions())

    def missing(self, cuda: bool, installed: Sequence[str]) -> str | None:
        if cuda and installed:
            return None
        return f'needs CUDA and flash-attn installed (got {"no CUDA device" if not cuda else "no flash-attn"})'

    def finish(self, rows: PackedBatch, implementation: str) -> PackedBatch:
        """The rows' boundaries (``cu_seq_lens_*``, int32, copied without blocking from pinned memory on CUDA) and
        the longest row (``max_length_*``)."""
        device = rows['input_ids'].device
        bounds = torch.tensor([0, *accumulate(rows.row_lengths)], dtype=torch.int32)
        bounds = bounds.pin_memory().to(device, non_blocking=True) if device.type == 'cuda' else bounds.to(device)
        longest = max(rows.row_lengths, default=0)
        values = {**rows, 'cu_seq_lens_q': bounds, 'cu_seq_lens_k': bounds, 'max_length_q': longest,
                  'max_length_k': longest}
        return PackedBatch(values, rows.row_lengths, implementation)

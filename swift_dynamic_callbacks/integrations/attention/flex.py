"""``flex``: torch's ``flex_attention`` (CUDA), a block mask from the positions that skips whole masked ``128 x 128``
blocks (about ``sum L_i^2``).

The packed row is filled up to a multiple of :data:`FLEX_BLOCK` tokens with a filler row of its own (labels
ignored, positions restarting), so the compiled kernels see few distinct lengths (and torch 2.13's CPU kernel, wrong
at some lengths that are not multiples of 16, is never asked for them). Compiled once for train and eval
(:func:`keep_flex_compiled`); inside a training pass, running uncompiled (which would materialise the ``N x N``
scores) is an error, so the step falls back instead of running out of memory.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Sequence

import torch

from .base import AttentionBackend, PackedBatch

#: a packed row is filled up to a multiple of this many tokens (flex's block size)
FLEX_BLOCK = 128
#: torch's warning when flex_attention runs without torch.compile (the whole N x N score matrix): made an error
#: inside the training passes while flex is in use, so the step falls back to sdpa instead of running out of memory
FLEX_EAGER_WARNING = r'flex_attention called without torch\.compile'
#: torch's once-per-process id of that warning (cleared before each training pass, so it is raised every time)
FLEX_EAGER_WARNING_ID = 'flex_attention_performance'


def keep_flex_compiled() -> bool:
    """transformers' ``WrappedFlexAttention`` builds a new ``torch.compile`` of flex_attention whenever the model
    flips between train and eval mode (every evaluation), although on torch 2.7+ both modes compile it the same way;
    after the fix the one compiled function serves both, compiled with dynamic shapes from its first call (packed
    lengths change every pass: a static first graph would be compiled again at the second length). Returns whether
    it was applied (idempotent)."""
    try:
        from transformers.integrations import flex_attention as hf_flex
    except ImportError:
        return False
    wrapped = getattr(hf_flex, 'WrappedFlexAttention', None)
    if wrapped is None or getattr(wrapped, '_sdc_compiled_once', False):
        return wrapped is not None
    from packaging import version
    if version.parse(torch.__version__).release < (2, 7):
        return False  # older torch compiles differently in training: leave transformers' rule

    @torch.compiler.disable(recursive=False)
    def compile_once(self, training):
        if not self._is_flex_compiled:  # dynamic shapes from the first call: one graph for every packed length
            from torch.nn.attention.flex_attention import flex_attention
            self._compiled_flex_attention = torch.compile(flex_attention, dynamic=True)
            self._is_flex_compiled = True
        self.training = training

    wrapped.__init__ = compile_once
    wrapped._sdc_compiled_once = True
    return True


class FlexAttention(AttentionBackend):
    """``flex_attention`` (module docstring); its backward proof runs two lengths (one and two blocks), so its
    training kernels are compiled, for dynamic lengths, before the first step."""

    name = 'flex'
    implementations = ('flex_attention', )
    preference = 1
    label = 'flex_attention'
    off_cuda = 'flex_attention has no backward on CPU'
    auto_why = ('flash-attn is not installed: flex_attention skips the masked blocks between rows (sdpa computes all '
                'N^2 pairs)')
    probe_lengths = (4, 68)

    def installed(self) -> tuple[str, ...]:
        from transformers.utils import is_torch_flex_attn_available
        return self.implementations if is_torch_flex_attn_available() else ()

    def missing(self, cuda: bool, installed: Sequence[str]) -> str | None:
        if cuda and installed:
            return None
        got = f'no CUDA device: {self.off_cuda}' if not cuda else 'no flex'
        return f'needs CUDA and torch\'s flex_attention (got {got})'

    def finish(self, rows: PackedBatch, implementation: str) -> PackedBatch:
        """A filler row up to a multiple of :data:`FLEX_BLOCK` (every per-token tensor filled: ids 0, labels
        ignored, positions restarting, the rest 0)."""
        tokens = sum(rows.row_lengths)
        fill = -tokens % FLEX_BLOCK
        if not fill:
            return PackedBatch(rows, rows.row_lengths, implementation)
        values = dict(rows)
        ids = rows['input_ids']
        filler = {'input_ids': torch.zeros(1, fill, dtype=ids.dtype, device=ids.device),
                  'labels': torch.full((1, fill), -100, dtype=ids.dtype, device=ids.device),
                  'position_ids': torch.arange(fill, device=ids.device)[None]}
        for key, value in rows.items():
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[-1] == tokens:
                extra = filler.get(key, torch.zeros(1, fill, dtype=value.dtype, device=value.device))  # loss_scale: 0
                values[key] = torch.cat([value, extra.to(value.dtype)], dim=1)
        return PackedBatch(values, rows.row_lengths, implementation, fill)

    def prepare(self) -> None:
        keep_flex_compiled()

    @contextlib.contextmanager
    def training_pass(self) -> Iterator[None]:
        """torch's warning that flex runs uncompiled is an error here, and here only (evaluation, the proofs and
        other code keep the warning a warning); torch's once-per-process mark is cleared first, so it is raised
        every time."""
        from torch.nn.attention import flex_attention as torch_flex
        getattr(torch_flex, '_WARNINGS_SHOWN', set()).discard(FLEX_EAGER_WARNING_ID)
        with warnings.catch_warnings():
            warnings.filterwarnings('error', message=FLEX_EAGER_WARNING)
            yield

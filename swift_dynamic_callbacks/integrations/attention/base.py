"""The interface every attention backend for packed rows meets, and the packed batch a backend finishes.

A backend is one kernel family (``integration.packed_attention``'s value): whether it can run here, what a packed
row needs added on the host before it runs (:meth:`AttentionBackend.finish`), what it needs before the model is
switched to it and around each training pass, and where ``auto`` ranks it. Which one packed rows run with, the
proofs, the ranks' agreement and the fall-back are :mod:`..packed_attention`'s and the same for every backend.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, ContextManager, Mapping, Sequence


class PackedBatch(dict):
    """A micro-batch flattened by :func:`..padding_free.flatten_rows`: ``input_ids`` ``[1, N]`` and the rest, plus
    ``row_lengths`` (host ints: the real tokens of each packed row, in order), the ``attention`` implementation it was
    finished for (:meth:`AttentionBackend.finish`) and ``fill`` (filler tokens after the rows)."""

    def __init__(self, values: Mapping[str, Any], row_lengths: Sequence[int], attention: str = 'sdpa',
                 fill: int = 0) -> None:
        super().__init__(values)
        self.row_lengths = tuple(int(n) for n in row_lengths)
        self.attention = attention
        self.fill = int(fill)


class AttentionBackend:
    """One attention backend (module docstring); stateless, one instance in the registry. Subclasses set ``name``
    and override what differs. This class itself finishes attention implementations no backend claims (nothing
    added; :func:`..packed_attention.check_packed_attention` refuses them before training)."""

    #: its value of ``integration.packed_attention``
    name: ClassVar[str] = ''
    #: the ``attn_implementation`` names of transformers it runs as
    implementations: ClassVar[tuple[str, ...]] = ()
    #: ``auto``'s rank: a model on sdpa is switched to the highest-ranked backend ready here (``None``: never)
    preference: ClassVar[int | None] = None
    #: how ``auto``'s record names it (``neither flash-attn nor ...``)
    label: ClassVar[str] = ''
    #: why it cannot run off CUDA (``auto``'s record on a CPU); empty where it can
    off_cuda: ClassVar[str] = ''
    #: why ``auto`` chose it (its record)
    auto_why: ClassVar[str] = ''
    #: the keys :meth:`finish` adds (taken off again by :func:`..padding_free.packed_rows_only`)
    added_keys: ClassVar[tuple[str, ...]] = ()
    #: the packed rows' lengths of its backward proof (:func:`..packed_attention.check_packed_backward`)
    probe_lengths: ClassVar[tuple[int, ...]] = (4, )

    def installed(self) -> tuple[str, ...]:
        """Its implementations that load here, best first (may import transformers)."""
        return self.implementations[:1]

    def missing(self, cuda: bool, installed: Sequence[str]) -> str | None:
        """Why it cannot run here, as ``needs ... (got ...)`` (``None``: it can). ``cuda``: the model is on a CUDA
        device; ``installed``: :meth:`installed`."""
        return None

    def finish(self, rows: PackedBatch, implementation: str) -> PackedBatch:
        """``rows`` (packed rows only: no filler, no boundaries) made ready for ``implementation``, built from host
        ints on the batch's device without reading it; here nothing is added."""
        return PackedBatch(rows, rows.row_lengths, implementation)

    def prepare(self) -> None:
        """Before the model is switched to it (and proven)."""

    def training_pass(self) -> ContextManager[None]:
        """Around each training pass while packed rows run on it."""
        return contextlib.nullcontext()

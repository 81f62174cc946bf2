"""The attention backends packed rows can run with, one a module (:mod:`.base` says what each meets).

Adding a backend: a module with an :class:`~.base.AttentionBackend` subclass, its line in :data:`BACKENDS`, and its
name in ``config/integration.py``'s ``ATTENTION_BACKENDS`` (the settings stay torch-free; the two are checked
against each other on import). The choice (``auto``'s ranking, an explicit backend's refusal), the proofs, the ranks'
agreement and the fall-back (:mod:`..packed_attention`) and the packing (:mod:`..padding_free`) then serve it.
"""

from __future__ import annotations

from ...config.integration import ATTENTION_BACKENDS
from .base import AttentionBackend, PackedBatch
from .dense import DenseAttention
from .flash import FlashAttention
from .flex import FlexAttention

#: the backends by their ``integration.packed_attention`` name
BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (FlashAttention(), FlexAttention(), DenseAttention())}
if sorted(BACKENDS) != sorted(ATTENTION_BACKENDS):
    raise ImportError(f'packed attention: backends {sorted(BACKENDS)} differ from the settings\' '
                      f'{sorted(ATTENTION_BACKENDS)}')  # a bug in the package, caught on import

_BY_IMPLEMENTATION = {name: b for b in BACKENDS.values() for name in b.implementations}
_UNCLAIMED = AttentionBackend()
#: the attention implementations that keep packed rows apart by ``position_ids`` (proven by
#: :func:`..packed_attention.check_packed_attention`), the dense ones first, ``auto``'s favourite last
SUPPORTED_ATTENTION = tuple(name for b in sorted(BACKENDS.values(), key=lambda b: b.preference or 0)
                            for name in b.implementations)


def backend_for(implementation: str | None) -> AttentionBackend:
    """The backend that runs ``implementation`` (an ``attn_implementation`` name; one no backend claims: nothing
    added, nothing prepared)."""
    return _BY_IMPLEMENTATION.get(implementation, _UNCLAIMED)


def auto_order() -> list[AttentionBackend]:
    """The backends ``auto`` may switch to, best first."""
    return sorted((b for b in BACKENDS.values() if b.preference is not None), key=lambda b: -b.preference)


def installed_kernels() -> dict[str, tuple[str, ...]]:
    """Every backend's implementations that load here, best first (:meth:`~.base.AttentionBackend.installed`)."""
    return {name: b.installed() for name, b in BACKENDS.items()}


def finish_packed(batch: PackedBatch, attention: str) -> PackedBatch:
    """``batch`` (packed rows only: no filler, no boundaries) made ready for the implementation ``attention`` by its
    backend (:meth:`~.base.AttentionBackend.finish`: flex's filler, flash's boundaries, nothing for the dense ones)."""
    return backend_for(attention).finish(batch, attention)


__all__ = ['BACKENDS', 'SUPPORTED_ATTENTION', 'AttentionBackend', 'PackedBatch', 'auto_order', 'backend_for',
           'finish_packed', 'installed_kernels']

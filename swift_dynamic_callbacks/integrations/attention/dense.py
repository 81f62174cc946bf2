"""``sdpa`` (and ``eager``): a dense ``N x N`` mask from the positions, every masked pair computed (``N^2``); nothing
added to the packed row. Runs anywhere; the attention ``auto`` switches from, never to."""

from __future__ import annotations

from .base import AttentionBackend


class DenseAttention(AttentionBackend):
    """torch's ``scaled_dot_product_attention`` (the ``sdpa`` setting) and transformers' ``eager``."""

    name = 'sdpa'
    implementations = ('sdpa', 'eager')

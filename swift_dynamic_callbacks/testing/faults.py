"""Simulated memory cliff for tests and benchmarks: out-of-memory errors raised in forward or mid-backward.

:class:`OomInjector` patches the decoder layers of the HF Qwen2 / LLaMA implementations (class-level, undone by
:meth:`OomInjector.remove`). A forward pass whose batch holds more than ``token_budget`` tokens raises
``torch.OutOfMemoryError`` before computing anything (a forward OOM). With ``backward_rate``, a pass of more than
one sample is picked at random (seeded) to fail in the middle of its backward (or the passes numbered in
``fail_passes``, counting every training forward from 0; ``forward_passes`` fail in forward the same way, a
one-off: the retry is a new pass): after the upper layers'
gradients were already accumulated and before the first layer's — the case where a careless retry would leak
partial gradients into the step. ``forward_rate`` picks random multi-sample passes to fail in forward.
Single-sample passes only fail by the budget, so a run can always finish unless one sample is over it.
"""

from __future__ import annotations

import random
from typing import Any

import torch


class _FailInBackward(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB (injected in backward)')


def _layer_classes() -> list[type]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    return [Qwen2DecoderLayer, LlamaDecoderLayer]


class OomInjector:
    """Raise OOMs like a device would. ``counts`` holds what was injected (forward / backward)."""

    def __init__(self, token_budget: int | None = None, *, backward_rate: float = 0.0, forward_rate: float = 0.0,
                 seed: int = 0, fail_passes: tuple[int, ...] = (), forward_passes: tuple[int, ...] = ()) -> None:
        self.token_budget = token_budget
        self.fail_passes = set(fail_passes)
        self.forward_passes = set(forward_passes)
        self.backward_rate = backward_rate
        self.forward_rate = forward_rate
        self.random = random.Random(seed)
        self.counts = {'forward': 0, 'backward': 0}
        self.passes: list[tuple[int, int]] = []  # (rows, tokens) of every first-layer forward in training
        self._originals: dict[type, Any] = {}

    def install(self) -> 'OomInjector':
        for cls in _layer_classes():
            original = cls.forward
            self._originals[cls] = original
            cls.forward = self._wrap(original)
        return self

    def remove(self) -> None:
        for cls, original in self._originals.items():
            cls.forward = original
        self._originals.clear()

    def __enter__(self) -> 'OomInjector':
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _wrap(self, original: Any) -> Any:
        injector = self

        def forward(layer, hidden_states, *args, **kwargs):
            first = getattr(getattr(layer, 'self_attn', None), 'layer_idx', None) == 0
            if not (first and torch.is_grad_enabled() and layer.training):
                return original(layer, hidden_states, *args, **kwargs)
            rows = int(hidden_states.shape[0])
            tokens = rows * int(hidden_states.shape[1])
            injector.passes.append((rows, tokens))
            over = injector.token_budget is not None and tokens > injector.token_budget
            chosen = len(injector.passes) - 1 in injector.forward_passes
            if over or chosen or (rows > 1 and injector.random.random() < injector.forward_rate):
                injector.counts['forward'] += 1
                raise torch.OutOfMemoryError(f'CUDA out of memory (injected: a pass of {rows} x '
                                             f'{hidden_states.shape[1]} tokens)')
            out = original(layer, hidden_states, *args, **kwargs)
            chosen = len(injector.passes) - 1 in injector.fail_passes
            if chosen or (rows > 1 and injector.random.random() < injector.backward_rate):
                injector.counts['backward'] += 1
                if isinstance(out, tuple):
                    return (_FailInBackward.apply(out[0]), ) + tuple(out[1:])
                return _FailInBackward.apply(out)
            return out

        return forward

"""Simulated memory cliff for tests and benchmarks: out-of-memory errors raised in forward or mid-backward.

:class:`OomInjector` patches the call of every transformers decoder layer (``GradientCheckpointingLayer``, the
base of every model's layers, class-level, undone by :meth:`OomInjector.remove`) and acts at the first decoder layer
of the language model, whatever the model and whatever that layer's kind (Qwen2, LLaMA, Qwen2-VL, Qwen3.5's
linear-attention first layer, ...: :func:`decoder_layer_index`). A forward pass whose batch holds more than
``token_budget`` tokens raises ``torch.OutOfMemoryError`` before computing anything (a forward OOM). With
``backward_rate``, a pass of more than one sample is picked at random (seeded) to fail in the middle of its backward
(or the passes numbered in ``fail_passes``, counting every training forward from 0; ``forward_passes`` fail in
forward the same way, a one-off: the retry is a new pass; ``eval_passes`` likewise count the forwards outside
training, eval and generation, from 0): after the upper layers' gradients were already
accumulated and before the first layer's — the case where a careless retry would leak partial gradients into the
step. ``forward_rate`` picks random multi-sample passes to fail in forward. Single-sample passes only fail by the
budget, so a run can always finish unless one sample is over it. ``token_budget`` may be a callable, read at every
pass: a device whose memory for a pass's tokens shrinks as the run allocates gradients and optimizer states
(:func:`device_end`).
"""

from __future__ import annotations

import random
from typing import Any, Callable

import torch


class _FailInBackward(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB (injected in backward)')


def _layer_classes() -> list[type]:
    """The class whose call every decoder layer of a transformers model goes through: ``GradientCheckpointingLayer``,
    the base of every model's decoder layers (Qwen2, LLaMA, Qwen2-VL's and Qwen2.5-VL's text and vision blocks, ...);
    the first decoder layer of the language model is told apart at the call (its attention's ``layer_idx`` is 0,
    vision blocks have none). Before transformers 4.52 (no such base): the Qwen2 and LLaMA decoder layers."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
        return [GradientCheckpointingLayer]
    except ImportError:  # pragma: no cover - transformers < 4.52
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
        return [Qwen2DecoderLayer, LlamaDecoderLayer]


#: the submodules of a decoder layer that carry its index (``layer_idx``): full attention, or linear attention
#: (Qwen3.5 / Qwen3-Next Gated DeltaNet layers)
_MIXERS = ('self_attn', 'linear_attn')


def decoder_layer_index(layer: Any) -> int | None:
    """The index of a language model's decoder layer (its attention's or linear attention's ``layer_idx``, else its
    own), ``None`` for a layer that has none (a vision block)."""
    for name in _MIXERS:
        index = getattr(getattr(layer, name, None), 'layer_idx', None)
        if index is not None:
            return int(index)
    index = getattr(layer, 'layer_idx', None)
    return int(index) if isinstance(index, int) else None


class OomInjector:
    """Raise OOMs like a device would. ``counts`` holds what was injected in training (forward / backward),
    ``eval_ooms`` how many in eval forwards."""

    def __init__(self, token_budget: int | Callable[[], int] | None = None, *, backward_rate: float = 0.0,
                 forward_rate: float = 0.0,
                 seed: int = 0, fail_passes: tuple[int, ...] = (), forward_passes: tuple[int, ...] = (),
                 eval_passes: tuple[int, ...] = ()) -> None:
        self.token_budget = token_budget
        self.fail_passes = set(fail_passes)
        self.forward_passes = set(forward_passes)
        self.eval_passes = set(eval_passes)
        self.eval_forwards: list[int] = []  # rows of every first-layer forward outside training (eval, generation)
        self.backward_rate = backward_rate
        self.forward_rate = forward_rate
        self.random = random.Random(seed)
        self.counts = {'forward': 0, 'backward': 0}
        self.eval_ooms = 0  # OOMs injected in eval forwards (``eval_passes``)
        self.passes: list[tuple[int, int]] = []  # (rows, tokens) of every first-layer forward in training
        self._originals: dict[type, Any] = {}
        self._hooks: dict[int, tuple[Any, Any]] = {}  # id(layer) -> its two hook handles
        self._pass: tuple[int, int] | None = None  # (index, rows) of the pass whose forward is running

    def install(self) -> 'OomInjector':
        for cls in _layer_classes():
            if '__call__' in vars(cls):  # the base of every decoder layer: hooks on the model's first one
                original = cls.__call__
                self._originals[cls] = ('__call__', original)
                cls.__call__ = self._attach(original)
            else:  # transformers < 4.52: the two layer classes' forward
                original = cls.forward
                self._originals[cls] = ('forward', original)
                cls.forward = self._wrap(original)
        return self

    def remove(self) -> None:
        for cls, (method, original) in self._originals.items():
            setattr(cls, method, original)
        self._originals.clear()
        for handles in self._hooks.values():
            for handle in handles:
                handle.remove()
        self._hooks.clear()

    def __enter__(self) -> 'OomInjector':
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # ---- the first decoder layer of the language model: a forward pre-hook and a forward hook on it, attached at its
    # first call. Module hooks run on every forward of the layer, gradient checkpointing's recomputation in backward
    # included (which calls the module past GradientCheckpointingLayer.__call__), so passes are counted as before.
    def _attach(self, original: Any) -> Any:
        injector = self

        def call(layer, *args, **kwargs):
            if decoder_layer_index(layer) == 0 and id(layer) not in injector._hooks:
                injector._hooks[id(layer)] = (layer.register_forward_pre_hook(injector._before, with_kwargs=True),
                                              layer.register_forward_hook(injector._after, with_kwargs=True))
            return original(layer, *args, **kwargs)

        return call

    def _before(self, layer: Any, args: tuple, kwargs: dict) -> None:
        self._pass = None
        hidden_states = args[0] if args else kwargs.get('hidden_states')
        if not (isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3):
            return None
        if not (torch.is_grad_enabled() and layer.training):  # an eval (or generation) forward
            self.eval_forwards.append(int(hidden_states.shape[0]))
            if len(self.eval_forwards) - 1 in self.eval_passes:
                self.eval_ooms += 1
                raise torch.OutOfMemoryError(f'CUDA out of memory (injected: an eval pass of '
                                             f'{hidden_states.shape[0]} x {hidden_states.shape[1]} tokens)')
            return None
        rows = int(hidden_states.shape[0])
        self._check_forward(rows, int(hidden_states.shape[1]))
        self._pass = (len(self.passes) - 1, rows)
        return None

    def _after(self, layer: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        if self._pass is None:
            return None
        index, rows = self._pass
        self._pass = None
        return self._fail_backward(out) if self._backward_chosen(index, rows) else None

    def _check_forward(self, rows: int, length: int) -> None:
        """Count a training pass of ``rows`` x ``length`` tokens; raise its forward OOM when one is due."""
        tokens = rows * length
        self.passes.append((rows, tokens))
        budget = self.token_budget() if callable(self.token_budget) else self.token_budget
        over = budget is not None and tokens > budget
        chosen = len(self.passes) - 1 in self.forward_passes
        if over or chosen or (rows > 1 and self.random.random() < self.forward_rate):
            self.counts['forward'] += 1
            raise torch.OutOfMemoryError(f'CUDA out of memory (injected: a pass of {rows} x {length} tokens)')

    def _backward_chosen(self, index: int, rows: int) -> bool:
        return index in self.fail_passes or (rows > 1 and self.random.random() < self.backward_rate)

    def _fail_backward(self, out: Any) -> Any:
        self.counts['backward'] += 1
        if isinstance(out, tuple):
            return (_FailInBackward.apply(out[0]), ) + tuple(out[1:])
        return _FailInBackward.apply(out)

    def _wrap(self, original: Any) -> Any:
        injector = self

        def forward(layer, *args, **kwargs):
            first = decoder_layer_index(layer) == 0
            hidden_states = args[0] if args else kwargs.get('hidden_states')
            if not (first and torch.is_grad_enabled() and layer.training and isinstance(hidden_states, torch.Tensor)
                    and hidden_states.dim() == 3):
                return original(layer, *args, **kwargs)
            rows = int(hidden_states.shape[0])
            injector._check_forward(rows, int(hidden_states.shape[1]))
            index = len(injector.passes) - 1
            out = original(layer, *args, **kwargs)
            return injector._fail_backward(out) if injector._backward_chosen(index, rows) else out

        return forward


def device_end(model: Any, optimizer: Callable[[], Any], total_bytes: int, per_token: int) -> Callable[[], int]:
    """A simulated device of ``total_bytes`` for what a training pass adds to the loaded model: the gradient of every
    trainable weight (allocated in the pass's backward), the optimizer's states that exist now (``optimizer()``:
    the trainer's, once built) and ``per_token`` bytes a token of the pass. Returns the token budget a pass has now
    (``OomInjector(token_budget=...)``)."""

    def tokens() -> int:
        params = [p for p in model.parameters() if p.requires_grad]
        held = sum(p.numel() * p.element_size() for p in params)
        opt = optimizer()
        state = getattr(getattr(opt, 'optimizer', opt), 'state', {}) if opt is not None else {}
        for p in params:
            for value in (state.get(p) or {}).values():
                if isinstance(value, torch.Tensor):
                    held += value.numel() * value.element_size()
        return max(0, (total_bytes - held) // per_token)

    return tokens

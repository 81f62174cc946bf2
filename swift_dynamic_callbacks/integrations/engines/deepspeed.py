"""DeepSpeed ZeRO-2 / ZeRO-3: the engine owns backward, the optimizer step and the gradient-accumulation boundary,
and ZeRO communicates inside every backward (ZeRO-2 reduces gradient partitions, ZeRO-3 also gathers parameters in
forward), so every rank must run the same passes in the same order.

- Passes: accelerate tells the engine whether a backward ends the accumulation (``sync_gradients``, mapped to
  DeepSpeed's ``set_gradient_accumulation_boundary`` by accelerate >= 1.8; set by HF per micro-batch); this adapter
  sets it per pass, so only the step's last pass is the boundary where the engine steps, whatever the number of
  passes (``gradient_accumulation_steps`` 1 with several passes included: the known trap of a boundary at every
  backward, which keeps only the last pass on ZeRO-2). HF's backward passes ``scale_wrt_gas=False``: the loss is not
  divided by the configured accumulation steps (ms-swift's token-sum loss is normalised over the step already).
- ZeRO-2 reduces its buckets on every backward and ZeRO-3 gathers parameters in every forward
  (:attr:`~.base.Engine.collective_passes`): a rank without samples in a micro-batch, or with fewer passes in a step,
  runs zero-weight passes (one row, every label ignored) that enter the same collectives and add a zero gradient
  (skipping them made the ranks' collectives differ: a size mismatch at the last step of an epoch).
- Refused (``config.engines``): OOM recovery and the gradient-noise probe (ZeRO partitions gradients inside
  backward).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, ContextManager, Iterator, Mapping

import torch

from ...config import ConfigError
from .base import Engine


class DeepSpeedEngineAdapter(Engine):
    """DeepSpeed adapter (see the module docstring)."""

    name: ClassVar[str] = 'deepspeed'
    collective_passes: ClassVar[bool] = True
    eval_alone: ClassVar[bool] = False  # ZeRO-3 gathers parameters in every forward; ZeRO-2's eval not checked

    @classmethod
    def matches(cls, kind: str, world: int, accelerator: Any) -> bool:
        return kind == 'DEEPSPEED'

    @classmethod
    def stage(cls, trainer: Any) -> int | None:
        state = getattr(getattr(trainer, 'accelerator', None), 'state', None)
        return getattr(getattr(state, 'deepspeed_plugin', None), 'zero_stage', None)

    #: ZeRO-3's memory a token over :func:`~...policies.pass_cost.bytes_per_token`: measured on an H100 (one
    #: process, Qwen2.5-1.5B shape, bf16, LoRA, ms-swift's ``zero3`` preset): a pass of 8,192 tokens peaked at
    #: 61.4 GiB where the estimate is 45.6 GiB (1.37 x on the activations), and ``auto`` without it chose 9,728
    #: tokens and ran out of memory at a pass of 8,883 (docs/engines.md); 1.5 leaves a margin over 1.37
    ZERO3_ACTIVATION_FACTOR: ClassVar[float] = 1.5

    @classmethod
    def activation_factor(cls, trainer: Any) -> float:
        """ZeRO-3: :data:`ZERO3_ACTIVATION_FACTOR` (measured); ZeRO-1/2 hold a token's activations as without an
        engine."""
        return cls.ZERO3_ACTIVATION_FACTOR if (cls.stage(trainer) or 0) >= 3 else 1.0

    @classmethod
    def held_bytes(cls, trainer: Any, later: dict[str, int]) -> dict[str, int]:
        """ZeRO-1 and up partition the optimizer states, ZeRO-2 and up the gradients too, over the ranks."""
        stage = cls.stage(trainer) or 0
        return cls.sharded(trainer, later, grads=stage >= 2, optimizer=stage >= 1)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), 'zero_stage': self.stage(self.trainer)}

    def check_wrapped(self, model: Any) -> None:
        try:
            from deepspeed import DeepSpeedEngine
        except ImportError:  # pragma: no cover - accelerate runs DeepSpeed only when it is installed
            return
        if not isinstance(model, DeepSpeedEngine):
            raise ConfigError(f'accelerate runs DeepSpeed, but the model is a {type(model).__name__}, not a '
                              'DeepSpeedEngine')

    def pass_context(self, model: Any, *, sync: bool) -> ContextManager[Any]:
        return _boundary(self.trainer.accelerator, sync)

    def placeholder_pass(self, model: Any, run: Callable[[Mapping[str, Any]], torch.Tensor],
                         template: Mapping[str, Any] | None, *, sync: bool) -> torch.Tensor | None:
        return self.zero_weight_pass(model, run, template, sync=sync)


@contextlib.contextmanager
def _boundary(accelerator: Any, sync: bool) -> Iterator[None]:
    state = accelerator.gradient_state
    previous = state.sync_gradients
    state._set_sync_gradients(sync)
    try:
        yield
    finally:
        state._set_sync_gradients(previous)

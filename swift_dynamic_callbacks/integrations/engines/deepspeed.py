"""DeepSpeed ZeRO-2 / ZeRO-3: the engine owns backward, the optimizer step and the gradient-accumulation boundary,
and ZeRO communicates inside every backward (ZeRO-2 reduces gradient partitions, ZeRO-3 also gathers parameters in
forward), so every rank must run the same passes in the same order.

- Passes: accelerate tells the engine whether a backward ends the accumulation (``sync_gradients``, set by HF per
  micro-batch); this adapter sets it per pass, so only the step's last pass is the boundary where the engine steps.
- A rank without samples in a micro-batch runs a zero-weight pass (one row, every label ignored): its backward enters
  the same ZeRO collectives as the other ranks' and adds a zero gradient (skipping it made the ranks' collectives
  differ: a size mismatch at the last step of an epoch).
- Refused (``config.engines``): OOM recovery, passes whose number depends on each rank (pieces, pass caps) and the
  gradient-noise probe (ZeRO partitions gradients inside backward).
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

    def describe(self) -> dict[str, Any]:
        config = getattr(getattr(self.trainer, 'accelerator', None), 'state', None)
        plugin = getattr(config, 'deepspeed_plugin', None)
        stage = getattr(plugin, 'zero_stage', None)
        return {**super().describe(), 'zero_stage': stage}

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

"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the engine all-gathers parameters inside every forward and
reduce-scatters gradients inside the backward of a synchronised pass, so every rank must run the same passes in the
same order (:attr:`~.base.Engine.collective_passes`: the pack pads a rank's short step with zero-weight passes).

- Passes: every pass reduce-scatters its gradients into the sharded ones (``set_requires_gradient_sync(True)``, as
  torchtitan runs micro-batches): no full-size unsharded gradient is held across passes, whatever their number (a
  step of many passes cut by ``pass_tokens`` would otherwise hold a full copy of the trainable gradients on every
  rank). The sum of the reduce-scattered passes is the reduce-scatter of their sum: the same gradient. The cost is
  one reduce-scatter a pass instead of one a step (LoRA: the adapters' gradients only). accelerate's ``no_sync``,
  which HF wraps around every micro-batch but the last, is overridden per pass.
- A rank without samples in a micro-batch, or with fewer passes in a step, runs zero-weight passes (one row, every
  label ignored): they enter the same all-gathers and reduce-scatters as the other ranks' and add a zero gradient.
- Refused (``config.engines``): OOM recovery (a rank retrying a pass would leave the others inside a collective) and
  the gradient-noise probe.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, ContextManager, Iterator, Mapping

import torch

from ...config import ConfigError
from ...config.engines import FSDP1_REFUSED
from .base import Engine


class FSDP2Engine(Engine):
    """FSDP2 adapter (see the module docstring)."""

    name: ClassVar[str] = 'fsdp2'
    collective_passes: ClassVar[bool] = True
    eval_alone: ClassVar[bool] = False  # every forward gathers the parameters of each sharded unit

    @classmethod
    def matches(cls, kind: str, world: int, accelerator: Any) -> bool:
        if kind != 'FSDP':
            return False
        plugin = getattr(getattr(accelerator, 'state', None), 'fsdp_plugin', None)
        if getattr(plugin, 'fsdp_version', 2) != 2:
            raise ConfigError(f'fsdp_version: {plugin.fsdp_version}: {FSDP1_REFUSED}')
        return True

    @classmethod
    def held_bytes(cls, trainer: Any, later: dict[str, int]) -> dict[str, int]:
        """Gradients and optimizer states are sharded evenly over the ranks."""
        return cls.sharded(trainer, later, grads=True, optimizer=True)

    def check_wrapped(self, model: Any) -> None:
        from torch.distributed.fsdp import FSDPModule
        if not isinstance(model, FSDPModule):
            raise ConfigError(f'accelerate runs FSDP, but the model is a {type(model).__name__}, not an FSDP2 module '
                              f'(fully_shard): {FSDP1_REFUSED}')

    def pass_context(self, model: Any, *, sync: bool) -> ContextManager[Any]:
        return _gradient_sync(model, True)  # every pass reduce-scatters (module docstring)

    def placeholder_pass(self, model: Any, run: Callable[[Mapping[str, Any]], torch.Tensor],
                         template: Mapping[str, Any] | None, *, sync: bool) -> torch.Tensor | None:
        return self.zero_weight_pass(model, run, template, sync=sync)


@contextlib.contextmanager
def _gradient_sync(model: Any, sync: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(sync)
    yield

"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the engine all-gathers parameters inside every forward and
reduce-scatters gradients inside the backward of a synchronised pass, so every rank must run the same passes in the
same order.

- Passes: the step's last pass reduce-scatters (``set_requires_gradient_sync(True)``), every other pass accumulates
  unsharded gradients (``False``); each pass sets it for itself. (accelerate's ``no_sync``, which HF wraps around
  every micro-batch but the last, sets it back to ``True`` on exit, so nesting it per pass turned synchronisation on
  again inside a micro-batch: one reduce-scatter per pass instead of one per step.)
- A rank without samples in a micro-batch runs a zero-weight pass (one row, every label ignored): it enters the same
  all-gathers and reduce-scatter as the other ranks and adds a zero gradient.
- Refused (``config.engines``): OOM recovery (a rank retrying a pass would leave the others inside a collective),
  passes whose number depends on each rank (pieces, pass caps) and the gradient-noise probe.
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

    def check_wrapped(self, model: Any) -> None:
        from torch.distributed.fsdp import FSDPModule
        if not isinstance(model, FSDPModule):
            raise ConfigError(f'accelerate runs FSDP, but the model is a {type(model).__name__}, not an FSDP2 module '
                              f'(fully_shard): {FSDP1_REFUSED}')

    def pass_context(self, model: Any, *, sync: bool) -> ContextManager[Any]:
        return _gradient_sync(model, sync)

    def placeholder_pass(self, model: Any, run: Callable[[Mapping[str, Any]], torch.Tensor],
                         template: Mapping[str, Any] | None, *, sync: bool) -> torch.Tensor | None:
        return self.zero_weight_pass(model, run, template, sync=sync)


@contextlib.contextmanager
def _gradient_sync(model: Any, sync: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(sync)
    yield

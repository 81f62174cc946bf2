"""DDP (``torch.nn.parallel.DistributedDataParallel``): two ways to reduce a step's gradients.

- ``deferred`` (with OOM recovery, the default): every pass runs without DDP's in-backward all-reduce and the step's
  gradients are all-reduced here after the step's last pass, in buckets. A rank that runs out of memory in any pass
  (forward or mid-backward) can drop its gradients and run its passes again without leaving another rank inside a
  half-done all-reduce; a rank whose micro-batch has no sample simply runs nothing. The cost is that the
  reduction is not overlapped with backward (``scripts/bench_engines.py`` measures it).
- ``native`` (OOM recovery off): the step's last pass runs with DDP's bucketed all-reduce overlapped with backward
  (what plain DDP training does); the other passes run in ``no_sync``. A rank whose step has no sample at all runs a
  zero-weight pass so that it joins the all-reduce.

DDP's forward broadcasts the module buffers before the first synchronised forward (``broadcast_buffers``). A forward
that fails after that broadcast leaves DDP expecting to broadcast again, while the other ranks have moved on
(``after_oom`` repairs this, see there).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, ContextManager, Mapping

import torch

from ...config import ConfigError
from .base import Engine

#: bytes of gradients reduced in one all-reduce (DDP's own default bucket size)
BUCKET_BYTES = 25 * 1024 * 1024


class DDPEngine(Engine):
    """DDP adapter (see the module docstring). ``sync``: ``deferred`` or ``native`` (chosen at start by the
    integration from ``oom_recovery``)."""

    name: ClassVar[str] = 'ddp'

    def __init__(self, trainer: Any, sync: str = 'deferred') -> None:
        super().__init__(trainer)
        if sync not in ('deferred', 'native'):
            raise ValueError(f'sync: must be deferred or native, got {sync!r}')
        self.sync = sync
        self._forward_started = False
        self._hooked: Any = None

    @classmethod
    def matches(cls, kind: str, world: int, accelerator: Any) -> bool:
        return world > 1 and kind.startswith('MULTI_')

    @classmethod
    def create(cls, trainer: Any, recovery: bool) -> 'DDPEngine':
        """With OOM recovery the step's gradients are reduced after its last pass (``deferred``), else in DDP's own
        overlapped all-reduce (``native``)."""
        return cls(trainer, sync='deferred' if recovery else 'native')

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), 'gradient_sync': self.sync}

    def check_wrapped(self, model: Any) -> None:
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ConfigError(
                f'several processes train, but the model is a {type(model).__name__}, not DistributedDataParallel: '
                'each rank would train its own copy on its own shard and the gradients would never be averaged. '
                'On CPU, accelerate only wraps the model with use_cpu: true (ddp_backend: gloo alone gives '
                'DistributedType.NO); on GPUs check the launcher (torchrun / NPROC_PER_NODE)')
        self._hook(model)

    def _hook(self, model: Any) -> None:
        """Note when DDP's own forward (past its buffer broadcast) reached the wrapped module."""
        if self._hooked is model:
            return
        self._hooked = model

        def started(module, args):
            self._forward_started = True

        model.module.register_forward_pre_hook(started)

    # ---- passes -------------------------------------------------------------------------------------------
    def pass_context(self, model: Any, *, sync: bool) -> ContextManager[Any]:
        self._forward_started = False
        if self.sync == 'native' and sync:
            return contextlib.nullcontext()
        return model.no_sync()

    def finish_step(self, model: Any) -> None:
        if self.sync == 'deferred':
            all_reduce_gradients([p for p in model.parameters() if p.requires_grad])

    def placeholder_pass(self, model: Any, run: Callable[[Mapping[str, Any]], torch.Tensor],
                         template: Mapping[str, Any] | None, *, sync: bool) -> torch.Tensor | None:
        if self.sync == 'deferred' or not sync:
            return None  # no collective inside a pass: nothing to join (deferred: finish_step reduces)
        return self.zero_weight_pass(model, run, template, sync=True)

    def after_oom(self, model: Any) -> None:
        """A forward that failed inside the wrapped module had already broadcast the buffers (DDP does that before
        calling it) but never reached DDP's post-forward, which would have cleared the request to broadcast: clear
        it here, so the retried pass does not broadcast a second time while the other ranks wait in the next
        collective (the first-forward deadlock)."""
        if self._forward_started and getattr(model, 'require_forward_param_sync', False):
            model.require_forward_param_sync = False
        self._forward_started = False


def all_reduce_gradients(params: list[torch.nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Average the gradients of ``params`` over ranks (what DDP's hooks do), in buckets of ``bucket_bytes``, at most
    two in flight: the extra memory is two buckets, not a copy of every gradient. A missing gradient counts as 0."""
    import torch.distributed as dist
    world = dist.get_world_size()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        grad = p.grad
        nbytes = grad.numel() * grad.element_size()
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][0].dtype != grad.dtype \
                or buckets[-1][0].device != grad.device:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []

    def complete(entry: tuple[Any, torch.Tensor, list[torch.Tensor]]) -> None:
        work, flat, grads = entry
        work.wait()
        flat.div_(world)
        offset = 0
        for grad in grads:
            n = grad.numel()
            grad.copy_(flat[offset:offset + n].view_as(grad))
            offset += n

    for grads in buckets:
        flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()
        pending.append((dist.all_reduce(flat, async_op=True), flat, grads))
        if len(pending) > 1:
            complete(pending.pop(0))
    for entry in pending:
        complete(entry)

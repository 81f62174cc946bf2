"""The engine interface: the few questions the step runner asks, answered for one process.

An engine adapter knows how the training engine (one process, DDP, FSDP2, DeepSpeed) runs a forward/backward pass
and reduces gradients; the shared code (:mod:`..steps`, :mod:`..trainer`) never branches on the engine. Each
adapter answers:

- :attr:`Engine.collective_passes`: whether every pass enters the engine's collectives (FSDP2, DeepSpeed), so every
  rank must run the same number of passes in a step (the pack pads a rank's short step with zero-weight passes);
- :attr:`Engine.eval_alone`: whether one rank may run an eval batch again in halves while the others go on (no
  collective inside an eval forward: one process, DDP, whose eval runs the unwrapped model);
- :meth:`Engine.matches` / :meth:`Engine.create`: whether accelerate runs this engine, and its adapter for a run;
- :meth:`Engine.pass_context`: run this pass with or without the engine's gradient synchronisation;
- :meth:`Engine.finish_step`: after the step's last pass, reduce the step's gradients (when the engine does not);
- :meth:`Engine.placeholder_pass`: what a rank without samples in a micro-batch runs so that it still joins the
  collectives the other ranks enter (nothing, or a zero-weight pass);
- :meth:`Engine.oom_recovery`: whether OOM recovery may run here, and :meth:`Engine.after_oom` to repair the
  engine's state before a pass is run again;
- :meth:`Engine.unsupported`: which features are refused, with what message (``config.engines``);
- :meth:`Engine.check_wrapped`: the model really is wrapped the way the engine claims (a run that silently fell back
  to another engine fails instead of training the wrong thing).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, ContextManager, Mapping

import torch

from ...config import ConfigError
from ...config.engines import unsupported as _unsupported


class Engine:
    """One process: no collectives, nothing to synchronise. The base of the other adapters.

    Args:
        trainer: the HF / ms-swift trainer (read: ``accelerator``, ``args``).
    """

    name: ClassVar[str] = 'single'
    #: every pass enters the engine's collectives: every rank runs the same number of passes a step
    collective_passes: ClassVar[bool] = False
    #: an eval forward enters no collective: a rank may run an eval batch again in halves alone
    eval_alone: ClassVar[bool] = True

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    @classmethod
    def matches(cls, kind: str, world: int, accelerator: Any) -> bool:
        """Whether accelerate's distributed type ``kind`` (its name: ``NO``, ``MULTI_GPU``, ``FSDP``, ...) with
        ``world`` processes is this engine (one process: ``NO`` or any type on one process)."""
        return world <= 1 and (kind == 'NO' or kind.startswith('MULTI_'))

    @classmethod
    def create(cls, trainer: Any, recovery: bool) -> 'Engine':
        """The adapter for a run whose OOM recovery is ``recovery``."""
        return cls(trainer)

    @classmethod
    def held_bytes(cls, trainer: Any, later: dict[str, int]) -> dict[str, int]:
        """What this rank holds of the gradients and optimizer states :func:`..auto_budget.held_later` counted for
        the whole model (``pass_tokens: auto``): all of it here; sharded engines hold their part."""
        return later

    @classmethod
    def activation_factor(cls, trainer: Any) -> float:
        """How many times the activation memory a token costs here what
        :func:`~...policies.pass_cost.bytes_per_token` counts (measured without an engine) (``pass_tokens: auto``)."""
        return 1.0

    @staticmethod
    def sharded(trainer: Any, later: dict[str, int], *, grads: bool, optimizer: bool) -> dict[str, int]:
        """``later`` with the gradients (``grads``) and optimizer states (``optimizer``) split over the ranks."""
        world = max(1, int(getattr(trainer.args, 'world_size', 1) or 1))
        return {**later, 'grad_bytes': later['grad_bytes'] // (world if grads else 1),
                'optimizer_bytes': later['optimizer_bytes'] // (world if optimizer else 1)}

    # ---- what the engine is ------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Facts for the start record: engine, accelerate's distributed type, world size."""
        accelerator = getattr(self.trainer, 'accelerator', None)
        distributed_type = getattr(accelerator, 'distributed_type', None)
        return {'engine': self.name, 'distributed_type': str(distributed_type).split('.')[-1],
                'world_size': int(getattr(self.trainer.args, 'world_size', 1) or 1)}

    def check_wrapped(self, model: Any) -> None:
        """Called with the model HF passes to the first ``training_step``; raises when it is not what this engine
        trains (e.g. several processes but no DDP wrapper: every rank would train its own copy)."""

    @classmethod
    def unsupported(cls, feature: str) -> str | None:
        """Why this engine cannot run ``feature`` (see ``config.engines``), or ``None``."""
        return _unsupported(cls.name, feature)

    def refuse(self, feature: str, setting: str) -> None:
        """Raise a :class:`ConfigError` naming ``setting`` when ``feature`` is not supported here."""
        reason = self.unsupported(feature)
        if reason is not None:
            raise ConfigError(f'{setting}: {feature} is not supported under {self.name}: {reason}')

    @classmethod
    def resolve_oom_recovery(cls, setting: bool | str) -> tuple[bool, str | None]:
        """``(enabled, why it is off)`` for the ``oom_recovery`` setting (``auto``, ``True``, ``False``).

        Raises:
            ConfigError: ``True`` on an engine that cannot recover.
        """
        reason = cls.unsupported('oom_recovery')
        if setting is True and reason is not None:
            raise ConfigError(f'dynamic_callbacks.integration.oom_recovery: true is not supported under {cls.name}: '
                              f'{reason}; use auto or false')
        if setting is False:
            return False, 'off by setting'
        if reason is not None:
            return False, reason
        return True, None

    # ---- passes -------------------------------------------------------------------------------------------
    def pass_context(self, model: Any, *, sync: bool) -> ContextManager[Any]:
        """The context one forward/backward pass runs in. ``sync``: this is the step's last pass, whose backward
        completes the step's gradient (engines that reduce inside backward do so only then)."""
        return contextlib.nullcontext()

    def padding_pass(self, model: Any, run: Callable[[Mapping[str, Any]], torch.Tensor],
                     template: Mapping[str, Any] | None, *, sync: bool) -> torch.Tensor | None:
        """A pass that exists only so that this rank runs as many passes as the others in a step
        (:attr:`collective_passes`): a zero-weight pass there, nothing elsewhere."""
        if not self.collective_passes:
            return None
        return self.zero_weight_pass(model, run, template, sync=sync)

    def finish_step(self, model: Any) -> None:
        """After the step's last pass on this rank: make the gradients the ones the optimizer step uses (reduced
        across ranks) when the engine did not already."""

    def placeholder_pass(self, model: Any, run: Callable[[Mapping[str, Any]], torch.Tensor],
                         template: Mapping[str, Any] | None, *, sync: bool) -> torch.Tensor | None:
        """A micro-batch without samples on this rank (the short last step of an epoch). Returns the loss of what
        was run, or ``None`` when nothing needs to run (no collectives to join)."""
        return None

    def zero_weight_pass(self, model: Any, run: Callable[[Mapping[str, Any]], torch.Tensor],
                         template: Mapping[str, Any] | None, *, sync: bool) -> torch.Tensor:
        """Run :func:`zero_weight_batch` of ``template`` (this rank's last real micro-batch) as one pass: what an
        engine whose passes communicate runs for a micro-batch without samples."""
        if template is None:
            raise RuntimeError('a placeholder micro-batch before any real one on this rank: no template to run a '
                               'zero-weight pass with (a rank with no sample at all in its shard?)')
        with self.pass_context(model, sync=sync):
            return run(zero_weight_batch(template))

    def after_oom(self, model: Any) -> None:
        """Repair the engine's state after an out-of-memory error, before passes are run again."""


def zero_weight_batch(template: Mapping[str, Any]) -> dict[str, Any]:
    """One row of ``template`` with every label ignored: a pass over it costs one sample's compute, contributes a
    zero loss and a zero gradient, and enters every collective a real pass enters (sharded engines). A packed pass
    (padding-free) gives its first packed row, finished for its attention, not the whole packed row."""
    from ..padding_free import PackedBatch, split_packed
    if isinstance(template, PackedBatch) and len(template.row_lengths) > 1:
        template = split_packed(template, len(template.row_lengths))[0]
    reference = template.get('input_ids', template.get('labels'))
    if not isinstance(reference, torch.Tensor) or reference.dim() == 0:
        raise RuntimeError('a zero-weight placeholder pass needs an input_ids or labels tensor in the template batch')
    rows = int(reference.shape[0])
    out: dict[str, Any] = {}
    for key, value in template.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            value = value[:1].clone()
        elif isinstance(value, (list, tuple)) and len(value) == rows:
            value = value[:1]
        out[key] = value
    if not isinstance(out.get('labels'), torch.Tensor):
        raise RuntimeError('a zero-weight placeholder pass needs a labels tensor (its labels are all set to -100)')
    out['labels'] = torch.full_like(out['labels'], -100)
    return out

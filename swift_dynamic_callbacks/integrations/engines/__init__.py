"""One adapter per training engine, chosen once when training starts (:func:`select_engine`).

Like Lightning's ``strategies/``: the shared code (the elastic loader, requests, LR control, state, logs, and the
step runner in :mod:`..steps`) asks the adapter the few engine-specific questions (:class:`.base.Engine`) and never
branches on the engine. Adding an engine is a new module here and a line in :func:`select_engine`.

- one process, :class:`.base.Engine`: nothing to synchronise; OOM recovery on;
- DDP, :class:`.ddp.DDPEngine`: the step's gradients all-reduced after its last pass (DDP's own overlapped
  all-reduce when OOM recovery is off); a rank without samples runs nothing; OOM recovery on;
- FSDP2, :class:`.fsdp2.FSDP2Engine`: reduce-scatter in the last pass's backward; a rank without samples runs a
  zero-weight pass; OOM recovery refused;
- DeepSpeed ZeRO-2/3, :class:`.deepspeed.DeepSpeedEngineAdapter`: the engine's reduction at the step's last pass; a
  rank without samples runs a zero-weight pass; OOM recovery refused.
"""

from __future__ import annotations

from typing import Any

from ...config import ConfigError
from ...config.engines import FSDP1_REFUSED
from .base import Engine, zero_weight_batch
from .ddp import DDPEngine
from .deepspeed import DeepSpeedEngineAdapter
from .fsdp2 import FSDP2Engine


def engine_name(trainer: Any) -> str:
    """The engine the trainer's accelerator runs: ``single``, ``ddp``, ``fsdp2`` or ``deepspeed``.

    Raises:
        ConfigError: FSDP1 (``fsdp_version: 1``), or an accelerator type the pack does not know.
    """
    from accelerate.utils import DistributedType
    accelerator = getattr(trainer, 'accelerator', None)
    kind = getattr(accelerator, 'distributed_type', DistributedType.NO)
    world = int(getattr(trainer.args, 'world_size', 1) or 1)
    if kind == DistributedType.DEEPSPEED:
        return 'deepspeed'
    if kind == DistributedType.FSDP:
        plugin = getattr(accelerator.state, 'fsdp_plugin', None)
        if getattr(plugin, 'fsdp_version', 2) != 2:
            raise ConfigError(f'fsdp_version: {plugin.fsdp_version}: {FSDP1_REFUSED}')
        return 'fsdp2'
    if kind == DistributedType.NO:
        if world > 1:
            raise ConfigError(
                f'{world} processes train, but accelerate runs DistributedType.NO: the model is not wrapped in '
                'DistributedDataParallel and the gradients are never averaged, so each rank would train its own copy '
                'on its own shard. On CPU set use_cpu: true (ddp_backend: gloo alone does not start DDP)')
        return 'single'
    if str(kind).split('.')[-1].startswith('MULTI_'):
        return 'ddp' if world > 1 else 'single'
    raise ConfigError(f'swift-dynamic-callbacks does not support accelerate\'s {kind} (supported: one process, DDP, '
                      'FSDP2, DeepSpeed ZeRO-2/3)')


def select_engine(trainer: Any, oom_recovery: bool | str = 'auto') -> tuple[Engine, bool, str | None]:
    """The adapter for the trainer's engine, whether OOM recovery runs, and why not.

    ``oom_recovery`` is the integration setting (``auto``, ``True``, ``False``); with recovery on, DDP defers its
    gradient reduction to after the step's last pass (see :mod:`.ddp`).

    Raises:
        ConfigError: the engine is not supported, or ``oom_recovery: true`` where it cannot run.
    """
    name = engine_name(trainer)
    cls = {'single': Engine, 'ddp': DDPEngine, 'fsdp2': FSDP2Engine, 'deepspeed': DeepSpeedEngineAdapter}[name]
    recovery, why_off = cls.resolve_oom_recovery(oom_recovery)
    engine = DDPEngine(trainer, sync='deferred' if recovery else 'native') if cls is DDPEngine else cls(trainer)
    return engine, recovery, why_off


__all__ = ['DDPEngine', 'DeepSpeedEngineAdapter', 'Engine', 'FSDP2Engine', 'engine_name', 'select_engine',
           'zero_weight_batch']

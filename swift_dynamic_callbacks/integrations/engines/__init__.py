"""One adapter per training engine, chosen once when training starts (:func:`select_engine`).

Like Lightning's ``strategies/``: the shared code (the elastic loader, requests, LR control, state, logs, and the
step runner in :mod:`..steps`) asks the adapter the few engine-specific questions (:class:`.base.Engine`) and never
branches on the engine. Adding an engine is a new module here (an :class:`.base.Engine` subclass answering
``matches``) and its line in :data:`ENGINES`.

- one process, :class:`.base.Engine`: nothing to synchronise; OOM recovery on;
- DDP, :class:`.ddp.DDPEngine`: the step's gradients all-reduced after its last pass (DDP's own overlapped
  all-reduce when OOM recovery is off); a rank without samples runs nothing; OOM recovery on;
- FSDP2, :class:`.fsdp2.FSDP2Engine`: a reduce-scatter in every pass's backward; the same number of passes on every
  rank (zero-weight passes pad a short step); OOM recovery refused;
- DeepSpeed ZeRO-2/3, :class:`.deepspeed.DeepSpeedEngineAdapter`: the engine's boundary at the step's last pass; the
  same number of passes on every rank; OOM recovery refused.
"""

from __future__ import annotations

from typing import Any

from ...config import ConfigError
from .base import Engine, zero_weight_batch
from .ddp import DDPEngine
from .deepspeed import DeepSpeedEngineAdapter
from .fsdp2 import FSDP2Engine


#: the engines, in the order they are asked whether they are the run's (:meth:`.base.Engine.matches`)
ENGINES: tuple[type[Engine], ...] = (DeepSpeedEngineAdapter, FSDP2Engine, DDPEngine, Engine)


def engine_class(trainer: Any) -> type[Engine]:
    """The adapter class of the engine the trainer's accelerator runs.

    Raises:
        ConfigError: FSDP1 (``fsdp_version: 1``), several processes without a distributed engine, or an accelerator
            type the pack does not know.
    """
    from accelerate.utils import DistributedType
    accelerator = getattr(trainer, 'accelerator', None)
    kind = str(getattr(accelerator, 'distributed_type', DistributedType.NO)).split('.')[-1]
    world = int(getattr(trainer.args, 'world_size', 1) or 1)
    for cls in ENGINES:
        if cls.matches(kind, world, accelerator):
            return cls
    if kind == 'NO':
        raise ConfigError(
            f'{world} processes train, but accelerate runs DistributedType.NO: the model is not wrapped in '
            'DistributedDataParallel and the gradients are never averaged, so each rank would train its own copy '
            'on its own shard. On CPU set use_cpu: true (ddp_backend: gloo alone does not start DDP)')
    raise ConfigError(f'swift-dynamic-callbacks does not support accelerate\'s {kind} (supported: one process, DDP, '
                      'FSDP2, DeepSpeed ZeRO-2/3)')


def engine_name(trainer: Any) -> str:
    """The name of the engine the trainer's accelerator runs (``single``, ``ddp``, ``fsdp2``, ``deepspeed``)."""
    return engine_class(trainer).name


def select_engine(trainer: Any, oom_recovery: bool | str = 'auto') -> tuple[Engine, bool, str | None]:
    """The adapter for the trainer's engine, whether OOM recovery runs, and why not.

    Raises:
        ConfigError: the engine is not supported, or ``oom_recovery: true`` where it cannot run.
    """
    cls = engine_class(trainer)
    recovery, why_off = cls.resolve_oom_recovery(oom_recovery)
    return cls.create(trainer, recovery), recovery, why_off


__all__ = ['DDPEngine', 'DeepSpeedEngineAdapter', 'ENGINES', 'Engine', 'FSDP2Engine', 'engine_class', 'engine_name',
           'select_engine', 'zero_weight_batch']

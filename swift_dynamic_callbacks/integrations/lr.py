"""The LR the optimizer uses: HF's own ``LambdaLR``, scaled (``new_lr_scale``), stretched (epoch budgets whose step
count changes with the batch size) and reshaped (``new_lr_schedule``) through :class:`~.scheduler.ScaledLambda`.

The scale, time axis and schedule live in the lambdas, so they are saved in ``scheduler.pt`` and come back with it on
resume; the LR logged, the LR used and the LR after resume are the same number.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..config import ConfigError
from .scheduler import ScaledLambda


class LRControl:
    """Takes over the trainer's LR scheduler when it is created (:meth:`wrap`).

    State: none of its own (``scheduler.pt`` holds the lambdas'); ``horizon`` is derived from the arguments again.
    """

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.horizon: int | None = None  # the LR schedule's length in optimizer steps (before any stretch)

    def wrap(self, scheduler: Any) -> Any:
        """Make ``new_lr_scale`` possible: every ``LambdaLR`` lambda (all HF warmup/decay schedules) is multiplied
        by the current scale. Other schedulers are left alone and a scale request then fails with a clear error."""
        self.scheduler = scheduler
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            scheduler.lr_lambdas = [
                fn if isinstance(fn, ScaledLambda) else ScaledLambda(fn) for fn in scheduler.lr_lambdas
            ]
        return scheduler

    @property
    def scale(self) -> float:
        scaled = [fn for fn in self._lambdas() if isinstance(fn, ScaledLambda)]
        return scaled[0].scale if scaled else 1.0

    def current(self) -> float | None:
        """The LR of the first param group as the scheduler last set it."""
        return float(self.scheduler.get_last_lr()[0]) if self.scheduler is not None else None

    def set_scale(self, scale: float) -> None:
        """Scale the schedule and the optimizer's current LR now, so this step already runs at the new LR."""
        for fn in self._scaled('LR scaling', 'set the batch callback\'s lr_scaling to none'):
            fn.scale = scale
        self._refresh()

    def set_schedule(self, schedule: Mapping[str, Any]) -> None:
        """Make ``schedule`` (:mod:`~swift_dynamic_callbacks.policies.lr`) the shape every param group follows.

        Its steps are the trainer's optimizer steps; they are put on each lambda's (possibly stretched) time axis:
        restarts already placed keep their place, a new one is placed at the current point of the axis.
        """
        lambdas = self._scaled('An LR schedule (lr_schedule callback)', 'remove the lr_schedule callback')
        if self.horizon is None:
            raise RuntimeError('swift-dynamic-callbacks: an LR schedule request before the scheduler was created')
        for fn in lambdas:
            placed = {int(real): virtual for real, virtual in
                      zip((fn.schedule or {}).get('restarts_real', ()), ((fn.schedule or {}).get('restarts', ())))}
            restarts, real_steps = [], []
            for step, peak, rewarmup in schedule.get('restarts', ()):
                start = placed[step][0] if step in placed else fn.virtual_step(step)
                restarts.append([start, float(peak), int(rewarmup)])
                real_steps.append(int(step))
            fn.schedule = {**schedule, 'total': int(self.horizon), 'restarts': restarts, 'restarts_real': real_steps}
        self._refresh()

    def stretch(self, step: int, total: int, horizon: int) -> None:
        """From ``step`` on, make the schedule reach ``horizon`` exactly at step ``total`` (no jump now)."""
        for fn in self._lambdas():
            if isinstance(fn, ScaledLambda):
                fn.stretch(step, total, horizon)

    def _lambdas(self) -> list[Any]:
        return getattr(self.scheduler, 'lr_lambdas', None) or []

    def _scaled(self, what: str, remedy: str) -> list[ScaledLambda]:
        lambdas = self._lambdas()
        if not lambdas or not all(isinstance(fn, ScaledLambda) for fn in lambdas):
            raise ConfigError(f'{what} was requested but the LR scheduler ({type(self.scheduler).__name__}) is not a '
                              'LambdaLR the pack can take over; use one of HF\'s lr_scheduler_type schedules '
                              f'(linear, cosine, constant, constant_with_warmup, warmup_stable_decay, ...) or {remedy}')
        return lambdas

    def _refresh(self) -> None:
        scheduler = self.scheduler
        lrs = [group['initial_lr'] * fn(scheduler.last_epoch)
               for group, fn in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas)]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group['lr'] = lr
        scheduler._last_lr = lrs

"""The LR scheduler wrapper that makes batch-size LR scaling, stretched epoch budgets and the pack's LR schedule run
inside HF's own ``LambdaLR``."""

from __future__ import annotations

from typing import Any, Callable

from ..policies.lr import schedule_factor

class ScaledLambda:
    """An ``LambdaLR`` lambda times ``scale``, on a time axis that can be stretched.

    ``lr(step) = scale * fn(v(step))`` with ``v(step) = v0 + (step - t0) * rate`` from step ``t0`` on (identity
    before the first stretch). :meth:`stretch` makes the rest of the schedule end at a new total number of steps
    without a jump, so an epoch-budget run whose step count changes with the batch size still runs its whole
    warmup/decay. With a ``schedule`` mapping (``new_lr_schedule``), ``fn`` is replaced by
    :func:`~swift_dynamic_callbacks.policies.lr.schedule_factor` of it on the same time axis.

    ``LambdaLR.state_dict`` saves a callable object's ``__dict__`` into ``scheduler.pt`` (loaded back with
    ``weights_only=True``), so the wrapped function lives in a slot and ``__dict__`` holds only floats: scale and
    time axis are checkpointed with the scheduler and restored with it on resume.
    """

    __slots__ = ('_fn', '__dict__')

    def __init__(self, fn: Callable[[int], float], scale: float = 1.0) -> None:
        self._fn = fn
        self.scale = scale
        self.t0, self.v0, self.rate = 0.0, 0.0, 1.0
        self.schedule: dict[str, Any] | None = None

    def virtual_step(self, step: float) -> float:
        return self.v0 + (step - self.t0) * self.rate if step >= self.t0 else float(step)

    def stretch(self, step: int, total: int, horizon: int) -> None:
        """From ``step`` on, reach the schedule's ``horizon`` exactly at real step ``total``."""
        v0 = self.virtual_step(step)
        if total > step:
            self.t0, self.v0, self.rate = float(step), v0, max(horizon - v0, 0.0) / (total - step)

    def __call__(self, step: int) -> float:
        v = self.virtual_step(step)
        if self.schedule is not None:
            return schedule_factor(self.schedule, v) * self.scale
        return self._fn(int(v) if float(v).is_integer() else v) * self.scale

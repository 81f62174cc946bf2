"""One step timer for the benchmarks and the tests (and for a user who wants step times of their own run).

:class:`StepTimer` is a plain Hugging Face ``TrainerCallback``: list it in ``trainer.add_callback`` or, through
ms-swift's ``callbacks:`` list, give :meth:`StepTimer.factory` a name (``run.sft(extra={'step_timer': factory})``).
"""
from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

Mark = tuple[float, float]  # (wall seconds, CPU seconds of this process, all threads)


def _now() -> Mark:
    return time.perf_counter(), time.process_time()


def _sync(device: str | None) -> None:
    if device and device.startswith('cuda'):
        import torch
        torch.cuda.synchronize()


class StepTimer(TrainerCallback):
    """The wall and process-CPU time of training: at train begin, every optimizer step's begin and end, train end.

    Hooks: ``on_train_begin``, ``on_step_begin``, ``on_step_end``, ``on_train_end`` (the device is synchronised
    before the begin, each step's end and the train end when ``device`` is a CUDA device). Flags: sets
    ``control.should_training_stop`` at the end of step ``stop_after`` when given (a start-up benchmark), nothing
    else. State: the marks (not saved with a checkpoint: a timer measures one process's run).
    """

    def __init__(self, *, device: str | None = None, stop_after: int | None = None) -> None:
        self.device = device
        self.stop_after = stop_after
        self.train_begin: Mark | None = None
        self.train_end: Mark | None = None
        self.step_begins: list[Mark] = []
        self.step_ends: list[Mark] = []

    def on_train_begin(self, args, state, control, **kwargs):
        _sync(self.device)
        self.train_begin = _now()

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_begins.append(_now())

    def on_step_end(self, args, state, control, **kwargs):
        _sync(self.device)
        self.step_ends.append(_now())
        if self.stop_after is not None and len(self.step_ends) >= self.stop_after:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        _sync(self.device)
        self.train_end = _now()

    def step_seconds(self) -> list[float]:
        """Wall seconds of each optimizer step, from its begin to its end (what the step's own work costs)."""
        return [end[0] - begin[0] for begin, end in zip(self.step_begins, self.step_ends)]

    def intervals(self, which: int = 0) -> list[float]:
        """Seconds per optimizer step counted end to end (``which``: 0 wall, 1 process CPU): step 1 from train
        begin, then between consecutive step ends (what a step costs with the hooks and logging between steps)."""
        marks = ([self.train_begin] if self.train_begin is not None else []) + self.step_ends
        return [b[which] - a[which] for a, b in zip(marks, marks[1:])]

    @property
    def total(self) -> float | None:
        """Wall seconds from train begin to train end (None before the end)."""
        if self.train_begin is None or self.train_end is None:
            return None
        return self.train_end[0] - self.train_begin[0]

    @classmethod
    def factory(cls, **kwargs: Any) -> TimerFactory:
        """An ms-swift callback factory building timers with ``kwargs`` (give it to ``run.sft(extra=...)`` or put
        it in ``swift.callbacks.callbacks_map`` under a name, and list that name in ``callbacks:``)."""
        return TimerFactory(cls, kwargs)


class TimerFactory:
    """ms-swift's ``(args, trainer) -> callback`` factory for :class:`StepTimer`; keeps every timer it built
    (one a training run) in ``timers``."""

    def __init__(self, cls: type[StepTimer], kwargs: dict[str, Any]) -> None:
        self.cls, self.kwargs = cls, kwargs
        self.timers: list[StepTimer] = []

    def __call__(self, args: Any = None, trainer: Any = None) -> StepTimer:
        timer = self.cls(**self.kwargs)
        self.timers.append(timer)
        return timer

    @property
    def last(self) -> StepTimer:
        """The timer of the latest run (ValueError when no run built one: the name was not in ``callbacks:``)."""
        if not self.timers:
            raise ValueError('no step timer was built: list its name in the run\'s callbacks')
        return self.timers[-1]

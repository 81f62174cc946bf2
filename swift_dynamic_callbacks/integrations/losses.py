"""Non-finite training losses, as ``training_step`` returned them (before HF's ``logging_nan_inf_filter``).

HF logs a step whose loss is NaN / inf as a finite substitute when ``logging_nan_inf_filter`` is on (its default), so
the callbacks cannot see it in ``logs['loss']``. The integration notes every micro-batch loss it returns
(:meth:`LossWatch.note`, no device synchronisation: the flags stay tensors) and, when the next training log line is
written, publishes how many optimizer steps since the previous line had a non-finite loss
(``control.dynamic_loss_nonfinite``, ``dynamic/nonfinite_steps``; see ``protocol``).
"""

from __future__ import annotations

import math
from typing import Any

import torch


class LossWatch:
    """Per optimizer step (``state.global_step`` while it runs): whether any micro-batch loss was not finite.

    State: ``{step: flag}`` since the last :meth:`take` (at most ``logging_steps`` entries); not checkpointed (a
    resumed run starts a new log line).
    """

    def __init__(self) -> None:
        self._bad: dict[int, Any] = {}

    def note(self, step: int, loss: Any) -> Any:
        """Record ``loss`` (a tensor or a number) of a micro-batch of step ``step``; returns ``loss`` unchanged."""
        if isinstance(loss, torch.Tensor):
            bad = ~torch.isfinite(loss.detach()).all()
        elif isinstance(loss, (int, float)):
            bad = not math.isfinite(loss)
        else:
            return loss
        previous = self._bad.get(step)
        self._bad[step] = bad if previous is None else (previous | bad)
        return loss

    def take(self) -> int:
        """Steps with a non-finite loss since the last call (reads the flags: one synchronisation per log line)."""
        count = sum(int(bool(flag)) for flag in self._bad.values())
        self._bad.clear()
        return count


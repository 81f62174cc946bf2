"""Settings of the ``early_stopping`` callback (YAML key ``dynamic_callbacks.early_stopping``); no torch imported."""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import Choice, ConfigError, Flag, Int, Number, Settings, Text, setting

MODES = ('min', 'max')
RESUME_STOPPED = ('stop', 'continue')


@dataclass(frozen=True)
class EarlyStoppingConfig(Settings):
    """Settings of :class:`EarlyStoppingCallback` (YAML key ``dynamic_callbacks.early_stopping``).

    Attributes:
        monitor: the value to watch, exactly as logged. Names starting with ``eval_`` (``eval_loss``,
            ``eval_token_acc``) are checked after every evaluation; other names (``loss``, ``grad_norm``) on every
            training log line (``logging_steps``).
        mode: ``min`` (lower is better) or ``max``.
        patience: checks in a row without improvement before stopping (evaluations, or log lines for a training
            value).
        min_delta: how much better than the best a value must be to count as an improvement (>= 0).
        threshold: stop as soon as the value reaches it (``<=`` in mode min, ``>=`` in max); ``None``: off.
        divergence: stop as soon as the value is past it the wrong way (``>`` in mode min, ``<`` in max);
            ``None``: off.
        stop_on_non_finite: a non-finite value (NaN, inf; for ``loss`` also a log line whose steps had a non-finite
            loss that HF's ``logging_nan_inf_filter`` replaced by a finite substitute, flagged by the integration in
            ``control.dynamic_loss_nonfinite``) stops at once with reason ``non_finite`` (default ``true``);
            ``false``: it counts as a check without improvement (patience still runs out). Never an improvement.
        resume_stopped: what a resumed run that had already stopped does: ``stop`` again at once (default), or
            ``continue`` (patience starts over; both are recorded in the decision log).
    """

    monitor: str = setting(Text('eval_loss'), 'eval_loss')
    mode: str = setting(Choice(MODES), 'min')
    patience: int = setting(Int(1), 3)
    min_delta: float = setting(Number(0, math.inf, high_open=True), 0.0)
    threshold: float | None = setting(Number(optional=True), None)
    divergence: float | None = setting(Number(optional=True), None)
    stop_on_non_finite: bool = setting(Flag(), True)
    resume_stopped: str = setting(Choice(RESUME_STOPPED), 'stop')

    controls = ()  # should_training_stop is HF's own OR-ed flag: several stopping callbacks compose

    def cross_checks(self) -> None:
        if self.threshold is not None and self.divergence is not None:
            sign = 1 if self.mode == 'min' else -1
            if sign * self.divergence <= sign * self.threshold:
                raise ConfigError(f'divergence: must be {"above" if self.mode == "min" else "below"} threshold '
                                  f'({self.threshold}) in mode {self.mode}, got {self.divergence}')

    @property
    def on_eval(self) -> bool:
        """True when the monitored value is an evaluation metric (checked in ``on_evaluate``)."""
        return self.monitor.startswith('eval_')

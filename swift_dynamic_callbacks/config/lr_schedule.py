"""Settings of the ``lr_schedule`` callback (YAML key ``dynamic_callbacks.lr_schedule``); no torch imported."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from . import Choice, ConfigError, Flag, Int, Number, Reads, Settings, StageTable, StepsOrFraction, Text, setting

GUARD_SETTINGS = ('guard_high', 'guard_low', 'guard_patience', 'guard_down', 'guard_up', 'guard_min_scale')


@dataclass(frozen=True)
class LRScheduleConfig(Settings):
    """Settings of :class:`LRScheduleCallback` (YAML key ``dynamic_callbacks.lr_schedule``).

    Attributes:
        warmup: linear warmup from 0 to the configured ``learning_rate``: optimizer steps (int) or a fraction of
            training (float < 1). Default 0.03.
        hold: steps (or fraction) at the full LR after warmup. Default 0.
        min_ratio: the cosine decays to ``learning_rate * min_ratio`` at the end of training. Default 0.01.
        decay: ``cosine`` (default: hold, then a cosine to ``min_ratio``) or ``steps``: after warmup the LR is
            ``learning_rate`` times the factor of the last stage of ``steps`` that has begun (a step schedule: the
            fixed-batch twin of a Seesaw run, or Seesaw itself with ``batch_growth`` ``policy: seesaw``). Reads
            ``steps``; needs ``max_restarts: 0`` (a restart has no meaning on a step schedule).
        steps: ``{start: factor}`` (``decay: steps``): starts in optimizer steps (ints) or fractions of training
            (floats < 1), factors in (0, 1], e.g. ``{0.25: 0.5, 0.5: 0.25}``. Under batch growth the schedule's
            axis is stretched at every growth, so a fraction of training is a fraction of the epoch's samples.
        monitor: the metric watched for plateaus: a logged training value (``loss``, the default) or an eval
            metric (``eval_loss``, ``eval_token_acc``, ...; names starting with ``eval_``).
        mode: ``min`` (lower is better) or ``max``.
        min_delta: an improvement must beat the best value by more than this. Default 0.
        patience: values without improvement before a plateau is declared: logged values for a training metric,
            evaluations for an eval metric. Default 10.
        cooldown: values ignored after a plateau (the restarted run settles). Default 5.
        smooth: the value judged is the *median* of the last ``smooth`` finite values, and plateaus are judged
            once ``smooth`` values are there. A non-finite value (a NaN step: HF's ``logging_nan_inf_filter`` logs
            a substitute, the integration flags it in ``control.dynamic_loss_nonfinite``) is left out entirely; a
            single outlier such as a 50x spike moves the median by one rank at most, so with ``smooth >= 3`` and
            ``patience >= 2`` one noisy batch among falling losses never restarts. Default 5 (1: no smoothing).
        max_restarts: restarts at most (0: a plain warmup-hold-cosine; a plateau is then only recorded). Default 3.
        restart_factor: each restart's peak is the previous peak times this, in (0, 1]. Default 0.5.
        rewarmup: steps of linear re-warmup from the current LR to the new peak (0: jump). Default 0.
        guard: enable the grad-norm guard.
        guard_high, guard_low: the guard lowers the LR when ``guard_patience`` logged grad norms in a row are above
            ``guard_high`` (or not finite), and raises it back when that many are below ``guard_low``.
        guard_patience: logged grad norms in a row. Default 3.
        guard_down, guard_up: factors applied to the guard's scale (default 0.5 and 1.25).
        guard_min_scale: lowest guard scale (default 0.1); the highest is 1 (the guard never exceeds the schedule).

    The ``guard_*`` settings are read only with ``guard: true``, ``restart_factor`` and ``rewarmup`` only with
    ``max_restarts >= 1`` (the ``reads`` table); setting them otherwise is refused.
    """

    warmup: int | float = setting(StepsOrFraction(), 0.03)
    hold: int | float = setting(StepsOrFraction(), 0)
    min_ratio: float = setting(Number(0, 1), 0.01)
    decay: str = setting(Choice(('cosine', 'steps')), 'cosine')
    steps: Mapping[int | float, float] = setting(StageTable(), default_factory=dict)
    monitor: str = setting(Text('loss'), 'loss')
    mode: str = setting(Choice(('min', 'max')), 'min')
    min_delta: float = setting(Number(0, math.inf, high_open=True), 0.0)
    patience: int = setting(Int(1), 10)
    cooldown: int = setting(Int(0), 5)
    smooth: int = setting(Int(1), 5)
    max_restarts: int = setting(Int(0), 3)
    restart_factor: float = setting(Number(0, 1, low_open=True), 0.5)
    rewarmup: int = setting(Int(0), 0)
    guard: bool = setting(Flag(), False)
    guard_high: float = setting(Number(0, math.inf, low_open=True, high_open=True), 10.0)
    guard_low: float = setting(Number(0, math.inf, high_open=True), 0.1)
    guard_patience: int = setting(Int(1), 3)
    guard_down: float = setting(Number(0, 1, low_open=True, high_open=True), 0.5)
    guard_up: float = setting(Number(1, 10, low_open=True), 1.25)
    guard_min_scale: float = setting(Number(0, 1, low_open=True), 0.1)

    reads = (
        Reads('decay', {'cosine': ('hold', 'min_ratio'), 'steps': ('steps', )}),
        Reads('guard', {True: GUARD_SETTINGS, False: ()}),
        Reads('max_restarts', {'>= 1': ('restart_factor', 'rewarmup'), '0': ()},
              classify=lambda n: '>= 1' if n >= 1 else '0'),
    )
    controls = ('lr_schedule', )

    def cross_checks(self) -> None:
        if self.decay == 'steps' and not self.steps:
            raise ConfigError('steps: decay steps needs at least one {start: factor} stage, e.g. {0.5: 0.1}, got none')
        if self.decay == 'steps' and self.max_restarts:
            raise ConfigError(f'max_restarts: decay steps has no cosine to restart; set max_restarts: 0, got '
                              f'{self.max_restarts}')
        if self.guard_low >= self.guard_high:
            raise ConfigError(f'guard_low: must be below guard_high ({self.guard_high}), got {self.guard_low}')

    @property
    def watches_eval(self) -> bool:
        return self.monitor.startswith('eval_')

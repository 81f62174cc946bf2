"""Warmup-hold-cosine learning rate with loss-plateau restarts and an optional grad-norm guard."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from .. import distributed, protocol
from ..config import ConfigError, check_bool, check_choice, check_int, check_number
from ..policies.lr import GuardState, PlateauState, guard_step, plateau_step, resolve_steps, smoothed
from ..records import DecisionRecord
from .base import DynamicCallback

logger = logging.getLogger('swift_dynamic_callbacks')


def _check_steps_or_fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (isinstance(value, float)
                                                                                      and value >= 1):
        raise ConfigError(f'{name}: expected optimizer steps (an int >= 0) or a fraction of training (a float in '
                          f'[0, 1)), got {value!r}')


@dataclass(frozen=True)
class LRScheduleConfig:
    """Settings of :class:`LRScheduleCallback` (YAML key ``dynamic_callbacks.lr_schedule``).

    Attributes:
        warmup: linear warmup from 0 to the configured ``learning_rate``: optimizer steps (int) or a fraction of
            training (float < 1). Default 0.03.
        hold: steps (or fraction) at the full LR after warmup. Default 0.
        min_ratio: the cosine decays to ``learning_rate * min_ratio`` at the end of training. Default 0.01.
        monitor: the metric watched for plateaus: a logged training value (``loss``, the default) or an eval
            metric (``eval_loss``, ``eval_token_acc``, ...; names starting with ``eval_``).
        mode: ``min`` (lower is better) or ``max``.
        min_delta: an improvement must beat the best value by more than this. Default 0.
        patience: values without improvement before a plateau is declared: logged values for a training metric,
            evaluations for an eval metric. Default 10.
        cooldown: values ignored after a restart (the restarted run settles). Default 5.
        smooth: the monitored value is the mean of the last ``smooth`` values, so one noisy batch does not
            trigger a restart. Default 5 (1 for no smoothing).
        max_restarts: restarts at most (0: a plain warmup-hold-cosine). Default 3.
        restart_factor: each restart's peak is the previous peak times this, in (0, 1]. Default 0.5.
        rewarmup: steps of linear re-warmup from the current LR to the new peak (0: jump). Default 0.
        guard: enable the grad-norm guard.
        guard_high, guard_low: the guard lowers the LR when ``guard_patience`` logged grad norms in a row are above
            ``guard_high`` (or not finite), and raises it back when that many are below ``guard_low``.
        guard_patience: logged grad norms in a row. Default 3.
        guard_down, guard_up: factors applied to the guard's scale (default 0.5 and 1.25).
        guard_min_scale: lowest guard scale (default 0.1); the highest is 1 (the guard never exceeds the schedule).
    """

    warmup: int | float = 0.03
    hold: int | float = 0
    min_ratio: float = 0.01
    monitor: str = 'loss'
    mode: str = 'min'
    min_delta: float = 0.0
    patience: int = 10
    cooldown: int = 5
    smooth: int = 5
    max_restarts: int = 3
    restart_factor: float = 0.5
    rewarmup: int = 0
    guard: bool = False
    guard_high: float = 10.0
    guard_low: float = 0.1
    guard_patience: int = 3
    guard_down: float = 0.5
    guard_up: float = 1.25
    guard_min_scale: float = 0.1

    def __post_init__(self) -> None:
        _check_steps_or_fraction('warmup', self.warmup)
        _check_steps_or_fraction('hold', self.hold)
        check_number('min_ratio', self.min_ratio, 0, 1)
        if not isinstance(self.monitor, str) or not self.monitor:
            raise ConfigError(f'monitor: expected a metric name such as "loss" or "eval_loss", got {self.monitor!r}')
        check_choice('mode', self.mode, ('min', 'max'))
        check_number('min_delta', self.min_delta, 0, math.inf, high_open=True)
        check_int('patience', self.patience, minimum=1)
        check_int('cooldown', self.cooldown, minimum=0)
        check_int('smooth', self.smooth, minimum=1)
        check_int('max_restarts', self.max_restarts, minimum=0)
        check_number('restart_factor', self.restart_factor, 0, 1, low_open=True)
        check_int('rewarmup', self.rewarmup, minimum=0)
        check_bool('guard', self.guard)
        check_number('guard_high', self.guard_high, 0, math.inf, low_open=True, high_open=True)
        check_number('guard_low', self.guard_low, 0, math.inf, high_open=True)
        if self.guard_low >= self.guard_high:
            raise ConfigError(f'guard_low: must be below guard_high ({self.guard_high}), got {self.guard_low}')
        check_int('guard_patience', self.guard_patience, minimum=1)
        check_number('guard_down', self.guard_down, 0, 1, low_open=True, high_open=True)
        check_number('guard_up', self.guard_up, 1, 10, low_open=True)
        check_number('guard_min_scale', self.guard_min_scale, 0, 1, low_open=True)

    @property
    def watches_eval(self) -> bool:
        return self.monitor.startswith('eval_')


class LRScheduleCallback(DynamicCallback):
    """Warmup -> hold -> cosine LR, restarted at a lower peak when the monitored metric plateaus.

    The schedule runs inside the trainer's LR scheduler (``control.new_lr_schedule``): the integration replaces
    the shape of HF's ``lr_scheduler_type`` schedule by :func:`~swift_dynamic_callbacks.policies.lr.schedule_factor`
    of this callback's schedule, so HF's per-step scheduler update *is* this schedule; the LR the optimizer uses,
    the logged LR and the LR after resume agree, and batch-growth LR scaling (``new_lr_scale``) multiplies it.

    Hooks: ``on_train_begin`` (the schedule, once per run), ``on_log`` (training metric, grad-norm guard),
    ``on_evaluate`` (eval metric). Plateaus are watched from the end of warmup + hold on.
    Flags set: ``new_lr_schedule``, ``dynamic_decisions``, ``dynamic_metrics`` (``dynamic/lr_restarts``,
    ``dynamic/lr_plateau_wait``, ``dynamic/lr_guard_scale``).
    State: ``started``, ``restarts`` (``[step, peak, rewarmup]``), ``peak``, the recent values, the plateau
    state (best, wait, cooldown), the guard state and scale. Decisions are taken from rank 0's view and broadcast.
    """

    name = 'lr_schedule'
    config_class = LRScheduleConfig

    def __init__(self, config: LRScheduleConfig | None = None) -> None:
        super().__init__(config)
        self.started = False
        self.restarts: list[list[float]] = []
        self.peak = 1.0
        self.values: list[float] = []
        self.plateau = PlateauState()
        self.guard_state = GuardState()
        self.guard_scale = 1.0
        self._seen_monitor = False

    def schedule(self) -> dict[str, Any]:
        """The schedule mapping requested through ``new_lr_schedule``."""
        c = self.config
        return {
            'warmup': c.warmup,
            'hold': c.hold,
            'min_ratio': c.min_ratio,
            'restarts': [list(r) for r in self.restarts],
            'guard': self.guard_scale
        }

    # ---- hooks -----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if self.started:  # resumed: the schedule is in scheduler.pt
            return
        self.started = True
        protocol.request_lr_schedule(control, self.schedule())
        scheduler_type = getattr(args, 'lr_scheduler_type', '')
        replaced = {'lr_scheduler_type': str(getattr(scheduler_type, 'value', scheduler_type)),
                    'warmup_steps': getattr(args, 'warmup_steps', 0), 'warmup_ratio': getattr(args, 'warmup_ratio', 0)}
        message = (f'warmup {self.config.warmup}, hold {self.config.hold}, cosine to x{self.config.min_ratio}; '
                   f'replaces the shape of lr_scheduler_type={replaced["lr_scheduler_type"]}')
        if replaced['warmup_steps'] or replaced['warmup_ratio']:
            message += f' and its warmup (warmup_steps={replaced["warmup_steps"]}, warmup_ratio={replaced["warmup_ratio"]})'
            logger.warning('lr_schedule: %s', message)
        protocol.record_decision(
            control, DecisionRecord(self.name, 'lr_schedule', 'start', {**self.schedule(), 'replaced': replaced},
                                    message, step=state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if 'loss' not in logs:  # not a training log line (eval metrics, the final summary)
            return
        if self.config.guard and 'grad_norm' in logs:
            self._guard(state, control, logs['grad_norm'])
        if not self.config.watches_eval:
            self._observe(args, state, control, logs, 'training log')
        self._publish(control)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.config.watches_eval:
            self._observe(args, state, control, metrics or {}, 'evaluation')
            self._publish(control)

    # ---- decisions -------------------------------------------------------------------------------------
    def _observe(self, args: Any, state: Any, control: Any, values: Mapping[str, Any], where: str) -> None:
        c = self.config
        if c.monitor not in values:
            if not self._seen_monitor:
                raise ConfigError(f'dynamic_callbacks.lr_schedule.monitor: {c.monitor!r} is not in the {where} '
                                  f'(metrics seen: {", ".join(sorted(values)) or "none"})')
            return
        self._seen_monitor = True
        value = float(values[c.monitor])
        self.values = (self.values + [value])[-c.smooth:]
        total = max(int(state.max_steps), 1)
        if state.global_step < resolve_steps(c.warmup, total) + resolve_steps(c.hold, total):
            return
        self.plateau, plateau = plateau_step(self.plateau, smoothed(self.values, c.smooth), mode=c.mode,
                                             min_delta=c.min_delta, patience=c.patience, cooldown=c.cooldown)
        # the plateau is judged on this rank's values: rank 0's verdict (plateau, restart) holds on every rank
        plateau, restart = distributed.broadcast_from_main((plateau, plateau and len(self.restarts) < c.max_restarts))
        if plateau and not restart and len(self.restarts) >= c.max_restarts:
            protocol.record_decision(
                control, DecisionRecord(self.name, 'lr_plateau', 'max_restarts', {'best': self.plateau.best},
                                        f'{c.monitor} plateaued; {c.max_restarts} restarts used, decay continues',
                                        step=state.global_step))
        if restart:
            self.peak *= c.restart_factor
            self.restarts.append([state.global_step, self.peak, c.rewarmup])
            self.values = []
            protocol.request_lr_schedule(control, self.schedule())
            protocol.record_decision(
                control,
                DecisionRecord(self.name, 'lr_restart', 'plateau', {
                    'restart': len(self.restarts),
                    'peak': self.peak,
                    'monitor': c.monitor,
                    'best': self.plateau.best,
                    'rewarmup': c.rewarmup
                }, f'{c.monitor} plateaued for {c.patience} values: restart {len(self.restarts)} at peak '
                   f'x{self.peak:.4g}', step=state.global_step))

    def _guard(self, state: Any, control: Any, grad_norm: Any) -> None:
        c = self.config
        self.guard_state, scale = guard_step(self.guard_state, float(grad_norm), self.guard_scale, high=c.guard_high,
                                             low=c.guard_low, patience=c.guard_patience, down=c.guard_down,
                                             up=c.guard_up, min_scale=c.guard_min_scale, max_scale=1.0)
        scale = distributed.broadcast_from_main(scale)
        if scale != self.guard_scale:
            reason = 'grad_norm_high' if scale < self.guard_scale else 'grad_norm_low'
            old, self.guard_scale = self.guard_scale, scale
            protocol.request_lr_schedule(control, self.schedule())
            protocol.record_decision(
                control,
                DecisionRecord(self.name, 'lr_guard', reason, {
                    'old': old,
                    'new': scale,
                    'grad_norm': float(grad_norm)
                }, f'grad norm {float(grad_norm):.4g} for {c.guard_patience} logged steps: guard x{old:.4g} -> '
                   f'x{scale:.4g}', step=state.global_step))

    def _publish(self, control: Any) -> None:
        values = {'dynamic/lr_restarts': len(self.restarts), 'dynamic/lr_plateau_wait': self.plateau.wait}
        if self.config.guard:
            values['dynamic/lr_guard_scale'] = self.guard_scale
        protocol.publish_metrics(control, values)

    # ---- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            'started': self.started,
            'restarts': [list(r) for r in self.restarts],
            'peak': self.peak,
            'values': list(self.values),
            'plateau': asdict(self.plateau),
            'guard_state': asdict(self.guard_state),
            'guard_scale': self.guard_scale,
            'seen_monitor': self._seen_monitor,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.started = bool(state.get('started', False))
        self.restarts = [list(r) for r in state.get('restarts', [])]
        self.peak = float(state.get('peak', 1.0))
        self.values = [float(v) for v in state.get('values', [])]
        self.plateau = PlateauState(**state.get('plateau', {}))
        self.guard_state = GuardState(**state.get('guard_state', {}))
        self.guard_scale = float(state.get('guard_scale', 1.0))
        self._seen_monitor = bool(state.get('seen_monitor', False))

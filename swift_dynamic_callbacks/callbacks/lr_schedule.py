"""Warmup-hold-cosine learning rate with loss-plateau restarts and an optional grad-norm guard."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from typing import Any, Mapping

from .. import distributed, protocol
from ..config import ConfigError
from ..config.lr_schedule import LRScheduleConfig
from ..policies.lr import GuardState, PlateauState, guard_step, plateau_step, resolve_steps, smoothed
from ..records import DecisionRecord
from .base import DynamicCallback

logger = logging.getLogger('swift_dynamic_callbacks')


class LRScheduleCallback(DynamicCallback):
    """Warmup -> hold -> cosine LR, restarted at a lower peak when the monitored metric plateaus.

    The schedule runs inside the trainer's LR scheduler (``control.new_lr_schedule``): the integration replaces
    the shape of HF's ``lr_scheduler_type`` schedule by :func:`~swift_dynamic_callbacks.policies.lr.schedule_factor`
    of this callback's schedule, so HF's per-step scheduler update *is* this schedule; the LR the optimizer uses,
    the logged LR and the LR after resume agree, and batch-growth LR scaling (``new_lr_scale``) multiplies it.

    Hooks: ``on_train_begin`` (the schedule, once per run), ``on_log`` (training metric, grad-norm guard),
    ``on_evaluate`` (eval metric). Plateaus are watched from the end of warmup + hold on, on the median of the
    last ``smooth`` finite values once there are ``smooth`` of them; a non-finite value (also a logged ``loss``
    whose steps had a non-finite loss: ``control.dynamic_loss_nonfinite``) is skipped and counted
    (``dynamic/lr_nonfinite_skipped``), never judged. Reads ``dynamic_loss_nonfinite``.
    Flags set: ``new_lr_schedule``, ``dynamic_decisions``, ``dynamic_metrics`` (``dynamic/lr_restarts``,
    ``dynamic/lr_plateau_wait``, ``dynamic/lr_guard_scale``, ``dynamic/lr_nonfinite_skipped``).
    State: ``started``, ``restarts`` (``[step, peak, rewarmup]``), ``peak``, the recent values, the plateau
    state (best, wait, cooldown), the guard state and scale, the non-finite values skipped. Decisions are taken
    from rank 0's view and broadcast.
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
        self.nonfinite_skipped = 0
        self._seen_monitor = False

    def schedule(self) -> dict[str, Any]:
        """The schedule mapping requested through ``new_lr_schedule``."""
        c = self.config
        if c.decay == 'steps':
            return {'decay': 'steps', 'warmup': c.warmup, 'steps': [[at, factor] for at, factor in c.steps.items()],
                    'guard': self.guard_scale}
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
        c = self.config
        shape = (f'steps {", ".join(f"x{f:g} from {at}" for at, f in c.steps.items())}' if c.decay == 'steps' else
                 f'hold {c.hold}, cosine to x{c.min_ratio}')
        message = (f'warmup {c.warmup}, {shape}; '
                   f'replaces the shape of lr_scheduler_type={replaced["lr_scheduler_type"]}')
        if replaced['warmup_steps'] or replaced['warmup_ratio']:
            message += (f' and its warmup (warmup_steps={replaced["warmup_steps"]}, '
                        f'warmup_ratio={replaced["warmup_ratio"]})')
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
        # a training log line whose steps had a non-finite loss: HF logged a finite substitute; never judged
        value = float(protocol.true_training_value(control, values, c.monitor))
        if math.isfinite(value):
            self.values = (self.values + [value])[-c.smooth:]
        else:
            self.nonfinite_skipped += 1
        total = max(int(state.max_steps), 1)
        if state.global_step < resolve_steps(c.warmup, total) + resolve_steps(c.hold, total):
            return
        plateau = False
        if math.isfinite(value) and len(self.values) >= c.smooth:  # judged on a full window of finite values
            self.plateau, plateau = plateau_step(self.plateau, smoothed(self.values, c.smooth), mode=c.mode,
                                                 min_delta=c.min_delta, patience=c.patience, cooldown=c.cooldown)
        # the plateau is judged on this rank's values: rank 0's verdict (plateau, restart) holds on every rank (every
        # rank gets here at the same steps: the early returns above depend on the step and the logged names only)
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
        values = {'dynamic/lr_restarts': len(self.restarts), 'dynamic/lr_plateau_wait': self.plateau.wait,
                  'dynamic/lr_nonfinite_skipped': self.nonfinite_skipped}
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
            'nonfinite_skipped': self.nonfinite_skipped,
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
        self.nonfinite_skipped = int(state.get('nonfinite_skipped', 0))
        self._seen_monitor = bool(state.get('seen_monitor', False))

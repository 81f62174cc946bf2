"""Progressive batch growth with LR scaling."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Mapping

from .. import distributed, protocol
from ..config import ConfigError
from ..config.batch_growth import (POLICIES, RANK_LOCAL_POLICIES, BatchGrowthConfig, checked_size,  # noqa: F401
                                   import_callable)
from ..policies.growth import (critical_batch, ema, interval_size, late_switch_size, loss_variability_size, lr_scale,
                               noise_scale_size, noise_scale_terms, optimizer_scale, pieces_for_cap, seesaw_cuts,
                               seesaw_size)
from ..policies.lr import PlateauState, plateau_step, smoothed
from ..policies.schedule import scheduled_value
from ..records import DecisionRecord
from .base import DynamicCallback

class BatchGrowthCallback(DynamicCallback):
    """Grows the per-device batch size by a policy and scales the LR with it, through the control flags.

    Hooks: ``on_train_begin`` (first request, unless resumed), ``on_step_end`` (policy; requests a change for the
    next step, or holds it for the epoch end with ``apply_at: epoch``), ``on_epoch_end`` (held change).
    Flags set: ``new_batch_size``, ``new_num_pieces`` (micro-batch cap), ``new_lr_scale``, ``dynamic_decisions``;
    ``new_optimizer_scale`` with ``weight_decay_scaling`` / ``beta2_scaling``.
    Hooks also: ``on_log`` (collects training losses for the loss_variability policy).
    Flags also: ``measure_grad_noise`` (noise_scale policy); reads ``grad_noise_sample`` in ``on_step_end`` and
    publishes ``dynamic/grad_noise_scale`` (critical global batch, samples) in ``dynamic_metrics``.
    Seesaw: ``on_step_end`` reads the next step's LR from ``lr_scheduler.get_last_lr()`` (the schedule's factor is
    that LR over ``learning_rate`` and the LR scale this callback has in effect) and grows once per cut by
    ``factor`` since the schedule's peak. Late switch: ``on_step_end`` reads ``global_step / max_steps``; with
    ``switch_patience``, ``on_log`` also judges the smoothed training loss for a plateau (rank 0's verdict) and
    ``on_step_end`` publishes ``dynamic/late_switch_wait`` (logged losses without improvement so far).
    State: ``batch_size`` (last requested), ``pending`` (held for the epoch end), ``losses`` (loss_variability
    window), ``noise`` (noise_scale EMAs and sample count), ``seesaw`` (schedule peak, cuts so far, LR scale in
    effect), ``switch`` (late_switch plateau trigger: recent losses, plateau state, whether it fired); the loader's
    position and the LR scale are restored by the integration.
    """

    name = 'batch_growth'
    config_class = BatchGrowthConfig

    def __init__(self, config: BatchGrowthConfig | None = None) -> None:
        super().__init__(config)
        self.batch_size: int | None = None
        self.pending: int | None = None
        self.losses: list[float] = []
        self.noise: dict[str, Any] = {'g2': None, 'trace': None, 'tokens_per_sample': None, 'count': 0}
        self.critical_per_device: float | None = None
        self.seesaw: dict[str, Any] = {'peak': 0.0, 'cuts': 0, 'scale': 1.0, 'factor': None}
        self.done = 0.0  # late_switch: the fraction of the run's optimizer steps behind (derived from the state)
        self.switch: dict[str, Any] = {'losses': [], 'plateau': asdict(PlateauState()), 'plateaued': False}
        self._fn = self.config.resolved_function() if self.config.policy == 'callable' else None

    # ---- policy ----------------------------------------------------------------------------------------
    def target(self, step: int, current: int) -> int:
        """Per-device batch size the policy wants from 0-based optimizer step ``step`` on."""
        c = self.config
        if c.policy == 'interval':
            size = interval_size(step, initial=c.initial, factor=c.factor, interval=c.interval, maximum=c.maximum,
                                 delay=c.delay)
        elif c.policy == 'table':
            size = scheduled_value(c.table, step) or c.initial
        elif c.policy == 'loss_variability':
            due = step >= c.delay + c.interval and (step - c.delay) % c.interval == 0
            size = loss_variability_size(self.losses, current, window=c.window, threshold=c.threshold,
                                         factor=c.factor, maximum=c.maximum) if due else current
        elif c.policy == 'noise_scale':
            due = step >= c.delay + c.interval and (step - c.delay) % c.interval == 0
            warm = self.noise['count'] >= c.window
            size = noise_scale_size(self.critical_per_device, current, factor=c.factor,
                                    maximum=c.maximum) if due and warm else current
        elif c.policy == 'seesaw':
            size = seesaw_size(self.seesaw['cuts'], initial=c.initial, factor=c.factor, maximum=c.maximum)
        elif c.policy == 'late_switch':
            size = late_switch_size(self.done, initial=c.initial, maximum=c.maximum, switch_at=c.switch_at,
                                    plateaued=self.switch['plateaued'])
        else:
            size = checked_size(self._fn(step, current), f'for (step={step}, batch_size={current})')
        return min(size, c.maximum)

    def observe_lr(self, lr: float, base_lr: float) -> None:
        """Seesaw: fold the next step's LR in (its schedule factor, the peak so far, the cuts since; never fewer)."""
        s = self.seesaw
        if not (base_lr > 0 and s['scale'] > 0 and math.isfinite(lr)):
            return
        factor = lr / (base_lr * s['scale'])
        s['factor'] = factor
        s['peak'] = max(s['peak'], factor)
        s['cuts'] = max(s['cuts'], seesaw_cuts(factor, s['peak'], self.config.factor))

    def observe_loss(self, loss: float) -> bool:
        """Late switch with ``switch_patience``: fold one logged training loss into the plateau judgement (the
        median of the last ``switch_smooth``, :func:`~.policies.lr.plateau_step`); returns whether the loss has
        plateaued (sticky: once true, it stays)."""
        c, sw = self.config, self.switch
        if sw['plateaued'] or not math.isfinite(loss):
            return sw['plateaued']
        sw['losses'] = (sw['losses'] + [float(loss)])[-c.switch_smooth:]
        if len(sw['losses']) >= c.switch_smooth:
            plateau, fired = plateau_step(PlateauState(**sw['plateau']), smoothed(sw['losses'], c.switch_smooth),
                                          mode='min', min_delta=c.switch_min_delta, patience=c.switch_patience,
                                          cooldown=0)
            sw['plateau'] = asdict(plateau)
            sw['plateaued'] = fired
        return sw['plateaued']

    def observe_noise(self, sample: protocol.GradNoiseSample, passes_per_step: int) -> float | None:
        """Fold one step's gradient norms into the EMAs; returns the critical global batch in samples."""
        c, n = self.config, self.noise
        if sample.small_tokens <= 0 or sample.big_tokens <= sample.small_tokens or sample.samples <= 0:
            return self._critical_samples(passes_per_step)
        g2, trace = noise_scale_terms(sample.small_sqnorm, sample.small_tokens, sample.big_sqnorm, sample.big_tokens)
        n['g2'] = ema(n['g2'], g2, c.noise_decay)
        n['trace'] = ema(n['trace'], trace, c.noise_decay)
        n['tokens_per_sample'] = ema(n['tokens_per_sample'], sample.big_tokens / sample.samples, c.noise_decay)
        n['count'] += 1
        return self._critical_samples(passes_per_step)

    def _critical_samples(self, passes_per_step: int) -> float | None:
        n = self.noise
        tokens = critical_batch(n['g2'], n['trace']) if n['g2'] is not None else None
        if tokens is None or not n['tokens_per_sample']:
            self.critical_per_device = None
            return None
        samples = tokens / n['tokens_per_sample']
        self.critical_per_device = samples / passes_per_step
        return samples

    # ---- hooks -----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if self.config.policy == 'noise_scale':
            cap = self.config.micro_batch_cap
            if args.gradient_accumulation_steps < 2 and not (cap is not None and cap < self.config.maximum):
                raise ConfigError(
                    'dynamic_callbacks.batch_growth.policy: noise_scale needs at least two forward/backward passes '
                    f'per optimizer step to compare gradients, but gradient_accumulation_steps is '
                    f'{args.gradient_accumulation_steps} and micro_batch_cap is {cap}; set '
                    'gradient_accumulation_steps >= 2 (or a micro_batch_cap below maximum)')
            protocol.request_grad_noise(control)
        if self.batch_size is None:  # fresh start (a resume restores batch_size from the checkpoint)
            self._request(args, control, self.target(state.global_step, self.config.initial), state.global_step,
                          reason='start')

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        if self.config.policy == 'seesaw' and lr_scheduler is not None:
            self.observe_lr(float(lr_scheduler.get_last_lr()[0]), float(args.learning_rate))
        self.done = state.global_step / state.max_steps if state.max_steps else 0.0
        sample = protocol.grad_noise_sample(control) if self.config.policy == 'noise_scale' else None
        if sample is not None:
            passes = args.gradient_accumulation_steps * max(getattr(args, 'world_size', 1), 1)
            critical = self.observe_noise(sample, passes)
            if critical is not None:
                protocol.publish_metrics(control, {'dynamic/grad_noise_scale': round(critical, 3)})
        size = self.target(state.global_step, self.batch_size or self.config.initial)
        if self.config.switch_patience is not None:
            protocol.publish_metrics(control, {'dynamic/late_switch_wait': self.switch['plateau']['wait']})
        rank_local = self.config.policy in RANK_LOCAL_POLICIES or self.config.switch_patience is not None
        if rank_local:  # judged on this rank's losses / gradients: rank 0's size
            size = distributed.broadcast_from_main(size)
        if size == self.batch_size:
            self.pending = None
        elif self.config.apply_at == 'epoch':
            self.pending = size
        else:
            self._request(args, control, size, state.global_step, reason=self.config.policy)

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = protocol.true_training_value(control, logs or {}, 'loss')  # NaN for HF's substitute of a NaN step
        if self.config.policy == 'loss_variability' and isinstance(loss, (int, float)) and math.isfinite(loss):
            self.losses = (self.losses + [float(loss)])[-self.config.window:]
        if self.config.policy == 'late_switch' and self.config.switch_patience is not None:
            if isinstance(loss, (int, float)):
                self.observe_loss(float(loss))

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.pending is not None and self.pending != self.batch_size:
            self._request(args, control, self.pending, state.global_step, reason=f'{self.config.policy}_at_epoch')
        self.pending = None

    def _request(self, args: Any, control: Any, size: int, step: int, *, reason: str) -> None:
        c = self.config
        old = self.batch_size
        pieces = pieces_for_cap(size, c.micro_batch_cap)
        scale = lr_scale(size, c.reference_batch or c.initial, c.lr_scaling)
        optimizer = optimizer_scale(size / (c.reference_batch or c.initial), scale,
                                    weight_decay=c.weight_decay_scaling, beta2=c.beta2_scaling)
        protocol.request_batch_size(control, size)
        protocol.request_num_pieces(control, pieces)
        protocol.request_lr_scale(control, scale)
        if optimizer:
            protocol.request_optimizer_scale(control, optimizer)
        per_step = args.gradient_accumulation_steps * max(getattr(args, 'world_size', 1), 1)
        extra = {}
        if c.policy == 'noise_scale' and self.critical_per_device is not None:
            extra = {'critical_global_batch': round(self.critical_per_device * per_step, 3)}
        if c.policy == 'seesaw':
            factor = self.seesaw['factor']
            extra = {'lr_cuts': self.seesaw['cuts'],
                     'schedule_factor': None if factor is None else round(factor / (self.seesaw['peak'] or 1.0), 6)}
        if c.policy == 'late_switch' and reason == 'late_switch':
            early = self.switch['plateaued'] and self.done < c.switch_at
            extra = {'trigger': 'loss_plateau' if early else 'switch_at', 'done': round(self.done, 6)}
            if early:
                extra['smoothed_loss'] = self.switch['plateau']['best']
        if optimizer:
            extra['optimizer_scale'] = optimizer
        self.seesaw['scale'] = scale  # the LR scale in effect from the next step on (Seesaw divides it out)
        protocol.record_decision(
            control,
            DecisionRecord(
                self.name, 'batch_size', reason, {
                    'old': old,
                    'new': size,
                    'num_pieces': pieces,
                    'global_batch_size': size * per_step,
                    'lr_scale': scale,
                    **extra
                },
                message=f'global batch {old * per_step if old else "-"} -> {size * per_step}, lr x{scale:.4g}',
                step=step))
        if old is not None and size != old:
            self.losses = []  # the loss noise changes with the batch: judge the new size on its own losses
        self.batch_size = size
        self.pending = None

    # ---- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            'batch_size': self.batch_size,
            'pending': self.pending,
            'losses': list(self.losses),
            'noise': dict(self.noise),
            'critical_per_device': self.critical_per_device,
            'seesaw': dict(self.seesaw),
            'switch': {**self.switch, 'losses': list(self.switch['losses']), 'plateau': dict(self.switch['plateau'])},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batch_size = state.get('batch_size')
        self.pending = state.get('pending')
        self.losses = [float(x) for x in state.get('losses', [])]
        self.noise = {**self.noise, **state.get('noise', {})}
        self.critical_per_device = state.get('critical_per_device')
        self.seesaw = {**self.seesaw, **state.get('seesaw', {})}
        switch = state.get('switch', {})
        self.switch = {'losses': [float(x) for x in switch.get('losses', [])],
                       'plateau': {**asdict(PlateauState()), **switch.get('plateau', {})},
                       'plateaued': bool(switch.get('plateaued', False))}

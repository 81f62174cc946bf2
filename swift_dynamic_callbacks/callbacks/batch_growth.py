"""Progressive batch growth with LR scaling: one callback, the policy a strategy (:mod:`.growth`)."""

from __future__ import annotations

from typing import Any, Mapping

from .. import distributed, protocol
from ..config.batch_growth import BatchGrowthConfig
from ..policies.growth import lr_scale, optimizer_scale, pieces_for_cap, rewarm_scale
from ..records import DecisionRecord
from .base import DynamicCallback
from .growth import GrowthStrategy, StepView, strategy_for


class BatchGrowthCallback(DynamicCallback):
    """Grows the per-device batch size by a policy and scales the LR with it, through the control flags.

    The policy is a strategy (:mod:`.growth`: interval, table, callable, loss variability, gradient noise scale,
    Seesaw, late switch), chosen by ``policy``; this callback feeds it and requests what it decides.

    Hooks: ``on_train_begin`` (the strategy's start checks; the first request, unless resumed), ``on_log`` (logged
    training losses to the strategy), ``on_step_end`` (the step to the strategy, then its size: requested for the
    next step, or held for the epoch end with ``apply_at: epoch``; a rank-local strategy's size is rank 0's),
    ``on_epoch_end`` (the held change).
    Flags set: ``new_batch_size``, ``new_num_pieces`` (micro-batch cap), ``new_lr_scale``, ``dynamic_decisions``;
    ``new_optimizer_scale`` with ``weight_decay_scaling`` / ``beta2_scaling``; ``measure_grad_noise`` when the
    strategy measures the gradient noise; ``dynamic_metrics`` (what the strategy publishes, e.g.
    ``dynamic/grad_noise_scale``, ``dynamic/late_switch_wait``).
    With ``rewarm: N`` a growth's LR scale is reached in N steps (``policies.growth.rewarm_scale``): the growth
    requests the first of them, each next step the next one (an ``lr_scale`` record, reason ``rewarm``).
    State: ``batch_size`` (last requested), ``pending`` (held for the epoch end), ``rewarm`` (a re-warm under way:
    ``before``, ``after``, ``done`` steps; else None), ``samples`` (consumed by the steps done, all ranks: the sizes
    in effect x ``GA x processes``; what a ``table_unit: samples`` table reads) and the strategy's own keys; the
    loader's position and the LR scale in effect are restored by the integration.
    """

    name = 'batch_growth'
    config_class = BatchGrowthConfig

    def __init__(self, config: BatchGrowthConfig | None = None) -> None:
        super().__init__(config)
        self.batch_size: int | None = None
        self.pending: int | None = None
        self.rewarm: dict[str, float] | None = None
        self.lr_scale: float | None = None  # last requested
        self.samples = 0  # consumed by the steps done, all ranks (the sizes in effect x passes a step)
        self.strategy: GrowthStrategy = strategy_for(self.config)

    def target(self, step: int, current: int) -> int:
        """Per-device batch size the policy wants from 0-based optimizer step ``step`` on (at most ``maximum``)."""
        return min(self.strategy.target(step, current), self.config.maximum)

    # ---- hooks -----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self.strategy.begin(args.gradient_accumulation_steps)
        if self.strategy.measures_grad_noise:
            protocol.request_grad_noise(control)
        if self.batch_size is None:  # fresh start (a resume restores batch_size from the checkpoint)
            self._request(args, control, self.target(state.global_step, self.config.initial), state.global_step,
                          reason='start')

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self.samples += (self.batch_size or self.config.initial) * _passes_per_step(args)
        view = StepView(step=state.global_step, max_steps=state.max_steps or 0,
                        lr=float(lr_scheduler.get_last_lr()[0]) if lr_scheduler is not None else None,
                        base_lr=float(args.learning_rate),
                        noise=protocol.grad_noise_sample(control) if self.strategy.measures_grad_noise else None,
                        passes_per_step=_passes_per_step(args), samples=self.samples)
        metrics = self.strategy.observe_step(view)
        if metrics:
            protocol.publish_metrics(control, metrics)
        size = self.target(state.global_step, self.batch_size or self.config.initial)
        if self.strategy.rank_local:  # judged on this rank's losses / gradients: rank 0's size
            size = distributed.broadcast_from_main(size)
        if size == self.batch_size:
            self.pending = None
        elif self.config.apply_at == 'epoch':
            self.pending = size
        else:
            self._request(args, control, size, state.global_step, reason=self.config.policy)
            return
        if self.rewarm is not None:
            self._rewarm_step(control, state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = protocol.true_training_value(control, logs or {}, 'loss')  # NaN for HF's substitute of a NaN step
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            self.strategy.observe_log(float(loss))

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.pending is not None and self.pending != self.batch_size:
            self._request(args, control, self.pending, state.global_step, reason=f'{self.config.policy}_at_epoch')
        self.pending = None

    def _request(self, args: Any, control: Any, size: int, step: int, *, reason: str) -> None:
        c = self.config
        old = self.batch_size
        pieces = pieces_for_cap(size, c.micro_batch_cap)
        scale = self._scale_for(size)
        optimizer = optimizer_scale(size / (c.reference_batch or c.initial), scale,
                                    weight_decay=c.weight_decay_scaling, beta2=c.beta2_scaling)
        requested, self.rewarm = scale, None
        if c.rewarm > 1 and old is not None and self.lr_scale not in (None, scale):  # rewarm 1: at once
            self.rewarm = {'before': self.lr_scale, 'after': scale, 'done': 1}
            requested = rewarm_scale(self.lr_scale, scale, 1, c.rewarm)
        protocol.request_batch_size(control, size)
        protocol.request_num_pieces(control, pieces)
        protocol.request_lr_scale(control, requested)
        if optimizer:
            protocol.request_optimizer_scale(control, optimizer)
        per_step = _passes_per_step(args)
        extra = dict(self.strategy.record_values(reason, per_step))
        if optimizer:
            extra['optimizer_scale'] = optimizer
        if self.rewarm is not None:
            extra.update(lr_scale_target=scale, rewarm=c.rewarm)
        protocol.record_decision(
            control,
            DecisionRecord(
                self.name, 'batch_size', reason, {
                    'old': old,
                    'new': size,
                    'num_pieces': pieces,
                    'global_batch_size': size * per_step,
                    'lr_scale': requested,
                    **extra
                },
                message=f'global batch {old * per_step if old else "-"} -> {size * per_step}, lr x{requested:.4g}'
                + (f' (re-warming to x{scale:.4g} in {c.rewarm} steps)' if self.rewarm is not None else ''),
                step=step))
        self.strategy.resized(old, size, scale)
        self.batch_size = size
        self.lr_scale = requested
        self.pending = None

    def _rewarm_step(self, control: Any, step: int) -> None:
        """The next LR scale of the re-warm under way, requested for the next step."""
        ramp, steps = self.rewarm, self.config.rewarm
        done = int(ramp['done']) + 1
        scale = rewarm_scale(ramp['before'], ramp['after'], done, steps)
        protocol.request_lr_scale(control, scale)
        protocol.record_decision(control, DecisionRecord(
            self.name, 'lr_scale', 'rewarm', {'old': self.lr_scale, 'new': scale, 'step_of_rewarm': done,
                                              'rewarm': steps, 'target': ramp['after']},
            message=f'lr x{self.lr_scale:.4g} -> x{scale:.4g} (re-warm {done}/{steps})', step=step))
        self.lr_scale = scale
        self.rewarm = None if done >= steps else {**ramp, 'done': done}

    def _scale_for(self, size: int) -> float:
        """The LR scale of a per-device batch of ``size`` (``lr_scaling`` relative to ``reference_batch``)."""
        c = self.config
        return lr_scale(size, c.reference_batch or c.initial, c.lr_scaling)

    # ---- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {'batch_size': self.batch_size, 'pending': self.pending, 'rewarm': self.rewarm,
                'lr_scale': self.lr_scale, 'samples': self.samples, **self.strategy.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batch_size = state.get('batch_size')
        self.pending = state.get('pending')
        self.rewarm = dict(state['rewarm']) if state.get('rewarm') else None
        self.lr_scale = state.get('lr_scale')
        self.samples = int(state.get('samples', 0))
        if self.lr_scale is None and self.batch_size is not None:  # a checkpoint before re-warming: the batch's scale
            self.lr_scale = self._scale_for(self.batch_size)
        self.strategy.load_state_dict(state)


def _passes_per_step(args: Any) -> int:
    """Forward/backward passes of a step over all ranks (``gradient_accumulation_steps x processes``)."""
    return args.gradient_accumulation_steps * max(getattr(args, 'world_size', 1), 1)

"""Early stopping on an evaluation metric or a logged training value, with patience that survives resume."""

from __future__ import annotations

import math
from typing import Any, Mapping

from .. import distributed, protocol
from ..config import ConfigError
from ..config.early_stopping import RESUME_STOPPED, EarlyStoppingConfig  # noqa: F401
from ..policies.stopping import StopReason, stop_decision
from ..records import DecisionRecord
from .base import DynamicCallback

def _merge_votes(votes: list[tuple[bool, str | None, float, int]]) -> tuple[bool, str | None, float, int]:
    """All ranks stop when one does; reason, value and rank are the first stopping rank's (else rank 0's)."""
    for vote in votes:
        if vote[0]:
            return vote
    return votes[0]


class EarlyStoppingCallback(DynamicCallback):
    """Ends training softly when the monitored value stops improving, reaches a goal, diverges or is not finite.

    A non-finite value (NaN / inf; for ``loss`` also a log line whose steps had a non-finite loss, which HF logs as a
    finite substitute: ``control.dynamic_loss_nonfinite`` > 0) stops with reason ``non_finite`` (setting
    ``stop_on_non_finite``, default true; false: a check without improvement), and is never an improvement.

    Hooks: ``on_evaluate`` (eval metrics) or ``on_log`` (training values): check, agree across ranks
    (``distributed.agree``), and on a stop set ``control.should_training_stop`` and ``control.should_save`` (the
    step completes and HF saves a final checkpoint before the loop ends). ``on_save`` writes the stop record once
    that checkpoint exists (``on_train_end`` if no save followed). ``on_train_begin`` publishes the restored
    remaining patience and stops a resumed run that had already stopped; ``on_step_end`` keeps it stopped and
    clears ``should_save`` / ``should_evaluate`` for the one step HF runs before it checks the flag. The first
    check fails with a :class:`ConfigError` listing the names seen when the monitored value is not among them
    (``on_train_begin`` already fails when an ``eval_`` metric is monitored and the run never evaluates).
    Flags set: ``should_training_stop``, ``should_save``, ``should_evaluate`` (cleared), ``dynamic_decisions``,
    ``dynamic_metrics`` (``dynamic/early_stopping_patience_left``, ``dynamic/early_stopping_best``). Reads
    ``dynamic_loss_nonfinite``.
    State: ``best``, ``wait``, ``checks``, ``stopped``, ``reason``, ``stop_step``.
    """

    name = 'early_stopping'
    config_class = EarlyStoppingConfig

    def __init__(self, config: EarlyStoppingConfig | None = None) -> None:
        super().__init__(config)
        self.best: float | None = None
        self.wait = 0
        self.checks = 0
        self.stopped = False
        self.reason: StopReason | None = None
        self.stop_step: int | None = None
        self._record_pending: DecisionRecord | None = None
        self._resumed_stopped = False  # this run was resumed from a checkpoint written after the stop

    # ---- hooks -----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        strategy = getattr(args, 'eval_strategy', None)
        if self.config.on_eval and getattr(strategy, 'value', strategy) == 'no':
            raise ConfigError(f'dynamic_callbacks.early_stopping.monitor: {self.config.monitor!r} is an evaluation '
                              'metric but this run never evaluates (eval_strategy no); give it evaluation data '
                              '(split_dataset_ratio or val_dataset, eval_steps) or monitor a training value such as '
                              'loss')
        if self.checks:  # resumed: the remaining patience is in the logs from the first step on
            protocol.publish_metrics(control, self._metrics())
        if not self.stopped:
            return
        reason = self.reason.value if self.reason else None
        if self.config.resume_stopped == 'continue':
            protocol.record_decision(
                control,
                DecisionRecord(
                    self.name, 'resume', 'continue_after_stop', {
                        'stopped_at': self.stop_step,
                        'original_reason': reason
                    },
                    f'this run had stopped at step {self.stop_step} ({reason}); resume_stopped: continue, patience '
                    'starts over',
                    step=state.global_step))
            self.stopped, self.reason, self.stop_step, self.wait = False, None, None, 0
            protocol.publish_metrics(control, self._metrics())
            return
        control.should_training_stop = True
        self._resumed_stopped = True
        protocol.record_decision(
            control,
            DecisionRecord(
                self.name, 'stop', 'already_stopped', {
                    'stopped_at': self.stop_step,
                    'original_reason': reason,
                    'best': self.best
                },
                f'resumed a run that early stopping had ended at step {self.stop_step} ({reason}); stopping again '
                '(set resume_stopped: continue to train on)',
                step=state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        if self._resumed_stopped:  # HF runs one step before it looks at the flag: stop, and keep that step unsaved
            control.should_training_stop = True
            control.should_save = False
            control.should_evaluate = False

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.config.on_eval:
            self._check(state, control, metrics or {}, 'evaluation')

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self.config.on_eval or any(k.startswith('eval_') for k in logs) or 'train_runtime' in logs:
            return  # evaluation lines and the end-of-training summary are not training log lines
        self._check(state, control, logs, 'training log line')

    def on_save(self, args, state, control, **kwargs):
        self._flush_record(control, saved=f'checkpoint-{state.global_step}')

    def on_train_end(self, args, state, control, **kwargs):
        self._flush_record(control, saved=None)

    # ---- the check -------------------------------------------------------------------------------------
    def _check(self, state: Any, control: Any, values: Mapping[str, Any], where: str) -> None:
        if self.stopped:
            return
        c = self.config
        value = values.get(c.monitor)
        logged = value
        if not c.on_eval:  # a loss HF logged as a finite substitute for non-finite steps is not finite
            value = protocol.true_training_value(control, values, c.monitor)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            if value is None:
                numeric = sorted(k for k, v in values.items()
                                 if isinstance(v, (int, float)) and not isinstance(v, bool))
                raise ConfigError(f'dynamic_callbacks.early_stopping.monitor: {c.monitor!r} is not in the {where} '
                                  f'at step {state.global_step}; names seen: {", ".join(numeric) or "none"}')
            raise ConfigError(f'dynamic_callbacks.early_stopping.monitor: {c.monitor!r} is not a number in the {where} '
                              f'at step {state.global_step} (got {value!r})')
        decision = stop_decision(float(value), self.best, self.wait, mode=c.mode, patience=c.patience,
                                 min_delta=c.min_delta, threshold=c.threshold, divergence=c.divergence,
                                 stop_on_non_finite=c.stop_on_non_finite)
        stop, reason, value, stop_rank = distributed.agree(  # the stopping rank's reason and value go in the record
            (decision.stop, decision.reason.value if decision.reason else None, float(value), distributed.rank()),
            _merge_votes)
        self.best, self.wait = decision.best, decision.wait
        self.checks += 1
        protocol.publish_metrics(control, self._metrics())
        if not stop:
            return
        self.stopped, self.reason, self.stop_step = True, StopReason(reason), state.global_step
        control.should_training_stop = True
        control.should_save = True
        nonfinite = {}
        if (not math.isfinite(float(value)) and isinstance(logged, (int, float)) and not isinstance(logged, bool)
                and math.isfinite(logged)):  # HF's substitute for non-finite steps
            nonfinite = {'logged': logged, 'nonfinite_steps': protocol.loss_nonfinite(control)}
        self._record_pending = DecisionRecord(
            self.name, 'stop', self.reason.value, {
                'monitor': c.monitor,
                'value': float(value),
                **nonfinite,
                'rank': stop_rank,
                'best': self.best,
                'wait': self.wait,
                'patience': c.patience,
                'min_delta': c.min_delta,
                'threshold': c.threshold,
                'divergence': c.divergence,
            },
            self._message(float(value), nonfinite),
            step=state.global_step)

    def _message(self, value: float, nonfinite: Mapping[str, Any] | None = None) -> str:
        c = self.config
        if self.reason is StopReason.NON_FINITE and nonfinite:
            return (f'{c.monitor} is not finite: {nonfinite["nonfinite_steps"]} step(s) since the previous log line '
                    f'had a non-finite loss (logged as {nonfinite["logged"]!r} by HF\'s logging_nan_inf_filter)')
        if self.reason is StopReason.PATIENCE:
            return f'{c.monitor}={value:.6g}: no improvement over best {self.best:.6g} (min_delta {c.min_delta}) ' \
                   f'in {self.wait} checks'
        if self.reason is StopReason.THRESHOLD:
            return f'{c.monitor}={value:.6g} reached threshold {c.threshold}'
        if self.reason is StopReason.DIVERGENCE:
            return f'{c.monitor}={value:.6g} is past divergence bound {c.divergence}'
        return f'{c.monitor}={value} is not finite'

    def _metrics(self) -> dict[str, float]:
        values = {'dynamic/early_stopping_patience_left': float(max(self.config.patience - self.wait, 0))}
        if self.best is not None:
            values['dynamic/early_stopping_best'] = self.best
        return values

    def _flush_record(self, control: Any, saved: str | None) -> None:
        record, self._record_pending = self._record_pending, None
        if record is None:
            return
        if saved is not None:
            record = DecisionRecord(record.source, record.kind, record.reason, {**record.values, 'checkpoint': saved},
                                    f'{record.message}; final checkpoint {saved}', step=record.step)
        protocol.record_decision(control, record)

    # ---- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            'best': self.best,
            'wait': self.wait,
            'checks': self.checks,
            'stopped': self.stopped,
            'reason': self.reason.value if self.reason else None,
            'stop_step': self.stop_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        best = state.get('best')
        self.best = None if best is None else float(best)
        self.wait = int(state.get('wait', 0))
        self.checks = int(state.get('checks', 0))
        self.stopped = bool(state.get('stopped', False))
        reason = state.get('reason')
        self.reason = None if reason is None else StopReason(reason)
        self.stop_step = state.get('stop_step')

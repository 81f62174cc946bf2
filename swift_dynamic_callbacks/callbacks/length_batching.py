"""Length-aware batching: bucketed epochs and micro-batch sizes decided from sample lengths."""

from __future__ import annotations

from typing import Any, Mapping

from .. import protocol
from ..config.length_batching import LengthBatchingConfig
from ..records import DecisionRecord
from .base import DynamicCallback


class LengthBatchingCallback(DynamicCallback):
    """Asks the integration for length-aware micro-batches (token budget or length rules) and bucketed epochs, or
    balanced global steps (``mode: balanced``), optionally padding-free.

    The integration decides every micro-batch's size from its samples' lengths before collating it, keeps the
    position in samples (exactly-once epochs, exact resume), makes every rank run the same number of optimizer
    steps per epoch, and logs ``dynamic/tokens_per_batch`` (padded tokens per micro-batch) and
    ``dynamic/padding_fraction``. Lengths come from the dataset's ``lengths`` column (ms-swift's encoded
    datasets) or are measured once and cached with the dataset.

    With ``split: passes`` the micro-batches are left as they are (the samples per optimizer step stay what was
    configured) and a pass limit is requested instead: the integration runs each micro-batch as as many passes as
    the budget needs (same ``num_items_in_batch``, same gradient).

    Hooks: ``on_train_begin`` (requests the plan or the pass limit, unless a resumed run already has it).
    Flags set: ``new_batch_plan`` (split: micro_batches) or ``new_pass_limit`` (split: passes),
    ``dynamic_decisions`` (one ``batch_plan`` / ``pass_limit`` record per change).
    State: ``plan`` (the plan or pass limit last requested, as a mapping).
    """

    name = 'length_batching'
    config_class = LengthBatchingConfig

    def __init__(self, config: LengthBatchingConfig | None = None) -> None:
        super().__init__(config)
        self.plan: dict[str, Any] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.config.splits_passes:
            self._request_pass_limit(state, control)
            return
        seed = getattr(args, 'data_seed', None)
        seed = seed if seed is not None else getattr(args, 'seed', 0)
        batch_plan = self.config.plan(int(seed or 0))
        plan = batch_plan.to_json()
        if plan == self.plan:
            return  # resumed with the same settings: the loader's state already holds the plan
        reason = 'start' if self.plan is None else 'settings_changed'
        protocol.request_batch_plan(control, plan)
        message = batch_plan.length_mode.describe(batch_plan)
        if plan['padding_free']:
            message += '; padding-free (one packed row a micro-batch)'
        protocol.record_decision(
            control,
            DecisionRecord(self.name, 'batch_plan', reason, {'old': self.plan, 'new': plan}, message=message,
                           step=state.global_step))
        self.plan = plan

    def _request_pass_limit(self, state: Any, control: Any) -> None:
        # the pass limit is also memory_backoff's control: refuse the pair at start rather than let one win
        protocol.claim_controls(self, self.name, ('pass_limit', ), state)
        limit = {'split': 'passes', **self.config.pass_limit()}
        if limit == self.plan:
            return  # resumed with the same settings: the integration's state already holds the limit
        reason = 'start' if self.plan is None else 'settings_changed'
        protocol.request_pass_limit(control, {k: v for k, v in limit.items() if k != 'split'})
        what = (f'at most {limit["tokens"]} padded tokens a pass' if limit['tokens'] is not None else
                f'at most {limit["samples"]} samples a pass, ' + ', '.join(f'>{t}: {n}' for t, n in limit['rules']))
        protocol.record_decision(
            control,
            DecisionRecord(self.name, 'pass_limit', reason, {'old': self.plan, 'new': limit},
                           message=f'split passes: {what}; micro-batches (samples a step) unchanged',
                           step=state.global_step))
        self.plan = limit

    def state_dict(self) -> dict[str, Any]:
        return {'plan': self.plan}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        plan = state.get('plan')
        self.plan = dict(plan) if plan is not None else None

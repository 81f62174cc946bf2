"""Length-aware batching: bucketed epochs and micro-batch sizes decided from sample lengths."""

from __future__ import annotations

from typing import Any, Mapping

from .. import protocol
from ..config.length_batching import LengthBatchingConfig
from ..records import DecisionRecord
from .base import DynamicCallback


class LengthBatchingCallback(DynamicCallback):
    """Asks the integration for length-aware micro-batches (token budget or length rules) and bucketed epochs.

    The integration decides every micro-batch's size from its samples' lengths before collating it, keeps the
    position in samples (exactly-once epochs, exact resume), makes every rank run the same number of optimizer
    steps per epoch, and logs ``dynamic/tokens_per_batch`` (padded tokens per micro-batch) and
    ``dynamic/padding_fraction``. Lengths come from the dataset's ``lengths`` column (ms-swift's encoded
    datasets) or are measured once and cached with the dataset.

    Hooks: ``on_train_begin`` (requests the plan, unless a resumed run already has it).
    Flags set: ``new_batch_plan``, ``dynamic_decisions`` (one ``batch_plan`` record per plan change).
    State: ``plan`` (the plan last requested, as a mapping).
    """

    name = 'length_batching'
    config_class = LengthBatchingConfig

    def __init__(self, config: LengthBatchingConfig | None = None) -> None:
        super().__init__(config)
        self.plan: dict[str, Any] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        seed = getattr(args, 'data_seed', None)
        seed = seed if seed is not None else getattr(args, 'seed', 0)
        plan = self.config.plan(int(seed or 0)).to_json()
        if plan == self.plan:
            return  # resumed with the same settings: the loader's state already holds the plan
        reason = 'start' if self.plan is None else 'settings_changed'
        protocol.request_batch_plan(control, plan)
        what = (f'max {plan["max_tokens"]} padded tokens' if plan['mode'] == 'token_budget' else
                'sizes by ' + ', '.join(f'>{t}: {s}' for t, s in plan['rules']))
        protocol.record_decision(
            control,
            DecisionRecord(self.name, 'batch_plan', reason, {'old': self.plan, 'new': plan},
                           message=f'{plan["mode"]}: {what} per micro-batch, bucketing '
                           f'{"on (width " + str(plan["bucket_width"]) + ")" if plan["bucketing"] else "off"}',
                           step=state.global_step))
        self.plan = plan

    def state_dict(self) -> dict[str, Any]:
        return {'plan': self.plan}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        plan = state.get('plan')
        self.plan = dict(plan) if plan is not None else None

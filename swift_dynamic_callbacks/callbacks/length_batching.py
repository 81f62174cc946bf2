"""Length-aware batching: bucketed epochs and micro-batch sizes decided from sample lengths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .. import protocol
from ..config import ConfigError, check_bool, check_choice, check_int, check_number
from ..policies.length import DEFAULT_RULES, MODES, BatchPlan, check_rules
from ..records import DecisionRecord
from .base import DynamicCallback


@dataclass(frozen=True)
class LengthBatchingConfig:
    """Settings of :class:`LengthBatchingCallback` (YAML key ``dynamic_callbacks.length_batching``).

    Attributes:
        mode: ``token_budget`` (a micro-batch holds as many samples as fit in ``max_tokens`` padded tokens,
            ``samples x longest``) or ``rules`` (the longest sample picks the size from ``rules``).
        max_tokens: padded-token budget of one micro-batch (token_budget). A sample longer than this runs alone
            (a warning record lists such samples).
        rules: ``{longer_than: samples}``: a micro-batch whose longest sample is longer than ``longer_than`` tokens
            holds at most ``samples`` (the largest matching threshold wins); needs a ``0`` entry. The seed's rule:
            ``{0: 8, 1024: 2}`` (longest > 1024 tokens -> 2, else 8).
        bucketing: lay every epoch out as shuffled chunks of samples of similar length (far less padding); off:
            the host's random order, cut by length.
        bucket_width: relative length spread inside a bucket, in [0, 10] (0.03: within 3 % of the bucket's
            shortest sample). Smaller: less padding, more (smaller) partial batches.
        bucket_fill: in [0, 1], how much of one full micro-batch a bucket holds before the next bucket may open
            (0.5: half; where lengths are sparse a bucket grows past ``bucket_width`` until then, so it can still
            form reasonably large micro-batches). Larger: fewer micro-batches, a little more padding.
        seed: seed of the bucketed order (with the epoch number); ``None``: ``data_seed``, else ``seed`` of the
            training arguments.

    In both modes the trainer's per-device batch size (``per_device_train_batch_size``, or what a batch callback
    set) is the most samples a micro-batch holds: set it to the largest count you allow for short samples.
    """

    mode: str = 'token_budget'
    max_tokens: int = 16384
    rules: Mapping[int, int] = field(default_factory=lambda: dict(DEFAULT_RULES))
    bucketing: bool = True
    bucket_width: float = 0.03
    bucket_fill: float = 0.5
    seed: int | None = None

    def __post_init__(self) -> None:
        check_choice('mode', self.mode, MODES)
        check_int('max_tokens', self.max_tokens, minimum=1)
        try:
            rules = check_rules(self.rules)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        object.__setattr__(self, 'rules', dict(rules))
        check_bool('bucketing', self.bucketing)
        check_number('bucket_width', self.bucket_width, 0, 10)
        check_number('bucket_fill', self.bucket_fill, 0, 1)
        if self.seed is not None:
            check_int('seed', self.seed)

    def plan(self, default_seed: int) -> BatchPlan:
        """The :class:`BatchPlan` these settings ask for (``default_seed`` when ``seed`` is ``None``)."""
        return BatchPlan(mode=self.mode, max_tokens=self.max_tokens, rules=tuple(self.rules.items()),
                         bucketing=self.bucketing, bucket_width=float(self.bucket_width),
                         bucket_fill=float(self.bucket_fill),
                         seed=self.seed if self.seed is not None else default_seed)


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

"""Settings of the ``length_batching`` callback (YAML key ``dynamic_callbacks.length_batching``); no torch imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..policies.length import BatchPlan
from ..policies.length_modes import LENGTH_MODES, LengthMode
from ..policies.length_modes.rules import DEFAULT_RULES, check_rules
from . import Check, Choice, ConfigError, Flag, Int, Number, Reads, Settings, TokensOrAuto, setting

#: How a length budget is enforced: by cutting micro-batches (fewer samples a step for long rows) or passes.
SPLITS = ('micro_batches', 'passes')


@dataclass(frozen=True)
class LengthRules(Check):
    """``{longer_than: samples}`` (or ``[[longer_than, samples], ...]``) with a ``0`` entry."""

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, (str, bytes)) or not isinstance(value, (Mapping, list, tuple)):
            raise ConfigError(f'{name}: expected a mapping {{longer_than: samples}} with a 0 entry, got {value!r} '
                              f'({type(value).__name__})')
        try:
            rules = check_rules(value)
        except (TypeError, ValueError) as e:
            message = str(e)
            raise ConfigError(message.replace('rules:', f'{name}:', 1) if message.startswith('rules:') else
                              f'{name}: {message}') from None
        return dict(rules)


@dataclass(frozen=True)
class LengthBatchingConfig(Settings):
    """Settings of :class:`LengthBatchingCallback` (YAML key ``dynamic_callbacks.length_batching``).

    Attributes:
        split: ``micro_batches`` (default: the budget cuts the micro-batches themselves, so a step with long rows
            takes fewer samples and an epoch more optimizer steps; bucketing makes the batches dense) or ``passes``
            (the micro-batches keep the configured size, so every optimizer step takes the samples you configured,
            and each micro-batch runs as as many forward/backward passes as the budget needs, with the same
            loss normalisation: the same gradient, verl's dynamic batch size). ``passes`` asks for a pass limit,
            refused under FSDP2 and DeepSpeed like every pass limit, and cannot be combined with
            ``memory_backoff`` (both set the pass limit).
        mode: ``token_budget`` (a micro-batch holds as many samples as fit in ``micro_batch_tokens`` padded tokens,
            ``samples x longest``), ``rules`` (the longest sample picks the size from ``rules``) or ``balanced``
            (every optimizer step takes exactly the global batch, ``per_device x gradient_accumulation_steps x
            processes`` samples, of similar length, dealt so that every rank's work ``a x L + L^2`` is even;
            micro-batches of the per-device size; ``bucket_width`` is the relative length jitter of the layout:
            :mod:`~..policies.balance`).
        micro_batch_tokens: padded-token budget of one micro-batch (token_budget; with ``split: passes`` of one
            pass of a micro-batch). A sample longer than this runs alone (a warning record lists such samples).
            Called ``max_tokens`` before (still read, with a note).
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
        padding_free: run every micro-batch as one packed row (``position_ids`` restarting per row, no padding; the
            token budget then counts real tokens). Needs ``attn_impl`` sdpa or eager (proved on the model at train
            start: no attention across rows); not with ``split: passes`` or ``swift rlhf``.
        pass_tokens: ``mode: balanced`` only. Each step keeps exactly its global batch, but every rank runs its share
            of the step in as few forward/backward passes as fit this many tokens (padded: rows x longest; real
            tokens with ``padding_free``) instead of ``gradient_accumulation_steps`` micro-batches of the per-device
            size: short rows make a few large passes, long rows more small ones, and a larger batch (growth) makes
            larger passes, not more of them. The loss is normalised over the step's items as before, so the
            gradient is the same; ``micro_batch_cap`` / ``memory_backoff`` / OOM recovery still cap the rows of a
            pass. Refused where passes cannot be split (FSDP2, DeepSpeed, ``swift rlhf``, ms-swift's packing).
            ``auto``: the budget is chosen at train start from the device's free memory and the model's shape
            (:func:`~..integrations.pass_budget.auto_pass_tokens`; a ``pass_tokens`` record with its figures), and an
            OOM lowers it like any budget. ``null``: micro-batches of the per-device size.

    In both modes the trainer's per-device batch size (``per_device_train_batch_size``, or what a batch callback
    set) is the most samples a micro-batch holds: set it to the largest count you allow for short samples.
    ``micro_batch_tokens`` is read only by ``mode: token_budget``, ``rules`` only by ``mode: rules``, the ``bucket_*``
    settings and ``seed`` only with ``bucketing: true`` (the ``reads`` table).
    """

    split: str = setting(Choice(SPLITS), 'micro_batches')
    mode: str = setting(Choice(tuple(LENGTH_MODES)), 'token_budget')
    micro_batch_tokens: int = setting(Int(1), 16384)
    rules: Mapping[int, int] = setting(LengthRules(), default_factory=lambda: dict(DEFAULT_RULES))
    bucketing: bool = setting(Flag(), True)
    bucket_width: float = setting(Number(0, 10), 0.03)
    bucket_fill: float = setting(Number(0, 1), 0.5)
    seed: int | None = setting(Int(optional=True), None)
    padding_free: bool = setting(Flag(), False)
    pass_tokens: int | str | None = setting(TokensOrAuto(1, optional=True), None)

    renamed = {'max_tokens': 'micro_batch_tokens'}
    reads = (
        Reads('mode', {name: mode.reads for name, mode in LENGTH_MODES.items()}),
        Reads('bucketing', {True: ('bucket_width', 'bucket_fill', 'seed'), False: ()}),
    )

    @property
    def length_mode(self) -> LengthMode:
        """The mode's strategy (``policies/length_modes/``)."""
        return LENGTH_MODES[self.mode]

    @property
    def splits_passes(self) -> bool:
        """Whether the budget is kept by running micro-batches as several passes (``split: passes``)."""
        return self.split == 'passes'

    def cross_checks(self) -> None:
        if self.length_mode.balances_steps and (self.splits_passes or not self.bucketing):
            raise ConfigError(f'mode: {self.mode} lays every epoch out in balanced steps of micro-batches of the '
                              f'per-device size, so it needs split: micro_batches and bucketing: true (got split: '
                              f'{self.split}, bucketing: {str(self.bucketing).lower()}); for a pass limit add '
                              'memory_backoff')
        if self.padding_free and self.splits_passes:
            raise ConfigError('padding_free: true needs split: micro_batches (a padding-free plan cuts the '
                              'micro-batches by their real tokens); got split: passes')
        if self.splits_passes and self.bucketing:
            raise ConfigError('bucketing: split: passes keeps the micro-batches as the host draws them (only the '
                              'passes are cut), so bucketing does not apply; set bucketing: false, or split: '
                              'micro_batches')

    def pass_limit(self) -> dict[str, Any]:
        """The pass limit ``split: passes`` requests, the mode's (``LengthMode.pass_limit``):
        ``{'tokens': micro_batch_tokens}`` (token_budget) or, for rules, ``{'samples': rules[0], 'rules':
        [[longer_than, samples], ...]}`` (a pass of rows longer than ``longer_than`` tokens holds at most
        ``samples``)."""
        return self.length_mode.pass_limit(self.plan(0))
    controls = ('batch_plan', )  # composes with batch_size: the plan cuts micro-batches at most the current size

    def plan(self, default_seed: int) -> BatchPlan:
        """The :class:`BatchPlan` these settings ask for (``default_seed`` when ``seed`` is ``None``)."""
        return BatchPlan(mode=self.mode, max_tokens=self.micro_batch_tokens, rules=tuple(self.rules.items()),
                         bucketing=self.bucketing, bucket_width=float(self.bucket_width),
                         bucket_fill=float(self.bucket_fill),
                         seed=self.seed if self.seed is not None else default_seed, padding_free=self.padding_free,
                         pass_tokens=self.pass_tokens)

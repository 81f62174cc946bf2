"""Length-aware batching as pure functions: bucketed epoch orders and micro-batch sizes decided from lengths.

Terms (a collator that pads every micro-batch to its longest member, as ms-swift's does):

- *padded tokens* of a micro-batch = ``samples x longest``; *real tokens* = the sum of its lengths;
- *padding fraction* = ``1 - real / padded`` (over a set of micro-batches: sums of both).

A :class:`BatchPlan` says how many samples a micro-batch may hold, given its longest sample: its mode's
(:mod:`.length_modes`, one module a mode: ``token_budget``, ``rules``, ``balanced``). A mode sized by a token budget
has the samples longer than ``max_tokens`` go alone (:func:`over_budget` lists them for a warning).

With ``padding_free`` a micro-batch runs as one concatenated row, so it costs its real tokens: the token budget
bounds ``sum of lengths`` instead of ``samples x longest``.

The trainer's current per-device batch size (``cap``) stays an upper bound on the samples of a micro-batch.

An epoch is laid out by :func:`epoch_layout` and cut by :func:`plan_sizes`:

1. bucketing on: sort this rank's samples by length (ties in a seeded random order), open a new bucket whenever a
   length exceeds the bucket's first length by more than ``bucket_width`` (relative) and the bucket holds at least
   ``bucket_fill`` of one micro-batch the plan allows for its longest sample (so sparse length ranges do not leave
   tiny buckets that could only make tiny batches), shuffle inside every bucket,
   cut each bucket greedily into *chunks* the plan allows, and shuffle the chunks (seed ``(seed, epoch)``), so
   consecutive micro-batches come from unrelated buckets and every epoch differs;
   bucketing off: the order given (the host sampler's random order) is one segment;
2. :func:`plan_sizes` walks the order from a position: inside each chunk (segment) it cuts greedily by the plan,
   then splits every piece evenly into ``ceil(n / cap)`` micro-batches of at most ``cap`` samples. A subset of a
   piece never has more padded tokens than the piece, so splitting never breaks the budget.

Under data parallelism every rank must run the same number of optimizer steps per epoch (the gradient all-reduce
waits for all ranks). :func:`equalize_steps` splits a rank's largest micro-batches in halves until its count needs
the agreed number of steps; :func:`agreed_steps` is the agreement rule.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .length_modes import LENGTH_MODES, LengthMode
from .length_modes.rules import DEFAULT_RULES, check_rules


@dataclass(frozen=True)
class BatchPlan:
    """How micro-batches are formed from sample lengths (the value of ``control.new_batch_plan``).

    Attributes:
        mode: a name of :data:`~.length_modes.LENGTH_MODES` (:attr:`length_mode`).
        max_tokens: most padded tokens (``samples x longest``) of a micro-batch (``token_budget``).
        rules: ``((longer_than, samples), ...)``, ascending, the first ``longer_than`` is 0 (``rules``).
        bucketing: lay each epoch out in shuffled chunks of similar length (else keep the given order).
        bucket_width: relative length spread of a bucket (0.03: lengths within 3 % of the bucket's shortest),
            exceeded only where a bucket needs more samples to reach ``bucket_fill``.
        bucket_fill: fraction of a full micro-batch (the plan's limit for the bucket's longest sample) a bucket
            holds before the next one may open (0: width alone; 1: at least one full micro-batch a bucket).
        seed: seed of the bucketed order (with the epoch number).
        padding_free: micro-batches run as one concatenated row each (``position_ids`` restarting per row); the
            token budget counts real tokens.
        pass_tokens: ``balanced`` only: each rank's share of a step runs in as few forward/backward passes as fit
            this many tokens (padded, or real when padding-free) instead of ``gradient_accumulation_steps``
            micro-batches of the per-device size (:func:`~.balance.step_passes`); ``None``: micro-batches of the
            per-device size; ``'auto'`` in a request only: the integration chooses the budget at train start and
            plans with that number (:func:`~.pass_cost.auto_pass_tokens`).
    """

    mode: str = 'token_budget'
    max_tokens: int = 16384
    rules: tuple[tuple[int, int], ...] = DEFAULT_RULES
    bucketing: bool = True
    bucket_width: float = 0.03
    bucket_fill: float = 0.5
    seed: int = 0
    padding_free: bool = False
    pass_tokens: int | str | None = None

    def __post_init__(self) -> None:
        if self.mode not in LENGTH_MODES:
            raise ValueError(f'mode: must be one of {", ".join(LENGTH_MODES)}, got {self.mode!r}')
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f'max_tokens: must be an int >= 1, got {self.max_tokens!r}')
        object.__setattr__(self, 'rules', check_rules(self.rules))
        if not isinstance(self.bucketing, bool):
            raise ValueError(f'bucketing: expected true or false, got {self.bucketing!r}')
        width = self.bucket_width
        if isinstance(width, bool) or not isinstance(width, (int, float)) or not 0 <= width <= 10:
            raise ValueError(f'bucket_width: must be a number in [0, 10], got {width!r}')
        object.__setattr__(self, 'bucket_width', float(width))
        fill = self.bucket_fill
        if isinstance(fill, bool) or not isinstance(fill, (int, float)) or not 0 <= fill <= 1:
            raise ValueError(f'bucket_fill: must be a number in [0, 1], got {fill!r}')
        object.__setattr__(self, 'bucket_fill', float(fill))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f'seed: expected an integer, got {self.seed!r}')
        if not isinstance(self.padding_free, bool):
            raise ValueError(f'padding_free: expected true or false, got {self.padding_free!r}')
        tokens = self.pass_tokens
        if tokens is not None and tokens != 'auto' and (isinstance(tokens, bool) or not isinstance(tokens, int)
                                                        or tokens < 1):
            raise ValueError(f'pass_tokens: must be an int >= 1, auto or null, got {tokens!r}')
        if tokens is not None and not self.length_mode.balances_steps:
            raise ValueError(f'pass_tokens: only mode balanced cuts a step into passes by tokens, got mode {self.mode}')

    @property
    def length_mode(self) -> LengthMode:
        """The mode's strategy (:mod:`.length_modes`)."""
        return LENGTH_MODES[self.mode]

    @property
    def balanced(self) -> bool:
        """Whether epochs are laid out in balanced global steps (``mode: balanced``)."""
        return self.length_mode.balances_steps

    @property
    def lays_out(self) -> bool:
        """Whether the plan lays each epoch out itself (bucketing, or balanced steps)."""
        return self.bucketing or self.balanced

    @property
    def cuts_passes(self) -> bool:
        """Whether each step's share is cut into passes by a token budget (``balanced`` with ``pass_tokens``)."""
        return self.pass_tokens is not None

    def limit(self, longest: int) -> int:
        """Most samples of a micro-batch whose longest sample has ``longest`` tokens (at least 1)."""
        return self.length_mode.limit(self, longest)

    def to_json(self) -> dict[str, Any]:
        return {'mode': self.mode, 'max_tokens': self.max_tokens, 'rules': [list(r) for r in self.rules],
                'bucketing': self.bucketing, 'bucket_width': self.bucket_width, 'bucket_fill': self.bucket_fill,
                'seed': self.seed, 'padding_free': self.padding_free,
                **({'pass_tokens': self.pass_tokens} if self.pass_tokens is not None else {})}

    @classmethod
    def from_json(cls, mapping: Mapping[str, Any]) -> 'BatchPlan':
        if not isinstance(mapping, Mapping):
            raise ValueError(f'a batch plan is a mapping, got {mapping!r}')
        unknown = sorted(set(mapping) - {'mode', 'max_tokens', 'rules', 'bucketing', 'bucket_width', 'bucket_fill',
                                  'seed', 'padding_free', 'pass_tokens'})
        if unknown:
            raise ValueError(f'unknown batch plan key(s) {", ".join(unknown)}')
        return cls(**dict(mapping))


def greedy_pieces(lengths: Sequence[int], plan: BatchPlan, cap: int | None = None) -> list[int]:
    """Cut consecutive samples into pieces: add a sample while the piece (with it) stays within the plan's limit
    for its longest sample (and ``cap``); padding-free under a token budget, while its real tokens stay within
    ``max_tokens``. A sample that the limit does not allow next to anything goes alone."""
    sizes: list[int] = []
    count, longest, total = 0, 0, 0
    by_sum = plan.padding_free and plan.length_mode.sizes_by_tokens
    for length in lengths:
        new_longest = max(longest, length)
        limit = plan.limit(new_longest) if not by_sum else (count + 1 if total + length <= plan.max_tokens else count)
        if cap is not None:
            limit = min(limit, cap)
        if count and count + 1 > limit:
            sizes.append(count)
            count, longest, total = 1, length, length
        else:
            count, longest, total = count + 1, new_longest, total + length
    if count:
        sizes.append(count)
    return sizes


def even_split(size: int, cap: int) -> list[int]:
    """``size`` samples as ``ceil(size / cap)`` micro-batches of at most ``cap``, sizes differing by at most one
    (larger first)."""
    if size < 1 or cap < 1:
        raise ValueError(f'even_split: need size >= 1 and cap >= 1, got {size}, {cap}')
    parts = -(-size // cap)
    base, extra = divmod(size, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def epoch_layout(indices: Sequence[int], lengths: Sequence[int], plan: BatchPlan,
                 epoch: int) -> tuple[list[int], list[int] | None]:
    """This rank's order for ``epoch`` and its chunk sizes (``None``: one segment, bucketing off).

    Args:
        indices: the rank's dataset indices of the epoch (the host's order; kept as is without bucketing).
        lengths: tokens of every dataset index (``lengths[i]``).
        plan: the batch plan (its ``seed`` and ``bucket_width``).
        epoch: data epoch (part of the seed: every epoch is laid out differently).
    """
    if not plan.bucketing:
        return list(indices), None
    rng = random.Random(f'{plan.seed}:{epoch}')
    shuffled = list(indices)
    rng.shuffle(shuffled)
    shuffled.sort(key=lambda i: lengths[i])  # stable: equal lengths stay in random order
    buckets: list[list[int]] = []
    start = longest = 0
    for i in shuffled:
        length = lengths[i]
        # a new bucket once the length leaves the width and the bucket holds bucket_fill of a micro-batch
        full = len(buckets[-1]) >= plan.bucket_fill * plan.limit(longest) if buckets else True
        if not buckets or (length > start * (1 + plan.bucket_width) and full):
            buckets.append([])
            start = length
        buckets[-1].append(i)
        longest = length
    chunks: list[list[int]] = []
    for bucket in buckets:
        rng.shuffle(bucket)
        at = 0
        for size in greedy_pieces([lengths[i] for i in bucket], plan):
            chunks.append(bucket[at:at + size])
            at += size
    rng.shuffle(chunks)
    return [i for chunk in chunks for i in chunk], [len(c) for c in chunks]


def segments(start: int, total: int, chunk_sizes: Sequence[int] | None) -> list[tuple[int, int]]:
    """``(begin, end)`` ranges of the order from ``start`` on: the rest of the current chunk, then whole chunks."""
    if chunk_sizes is None:
        return [(start, total)] if start < total else []
    out, end = [], 0
    for size in chunk_sizes:
        begin, end = end, end + size
        if end > start:
            out.append((max(begin, start), end))
    if end != total:
        raise ValueError(f'chunk sizes add up to {end}, but the epoch has {total} samples')
    return out


def plan_sizes(ordered_lengths: Sequence[int], start: int, chunk_sizes: Sequence[int] | None, plan: BatchPlan,
               cap: int) -> list[int]:
    """Micro-batch sizes for the order from ``start`` to its end (their sum is ``len(ordered_lengths) - start``).

    Inside every segment (:func:`segments`): :func:`greedy_pieces` by the plan, then :func:`even_split` by ``cap``.
    """
    sizes: list[int] = []
    for begin, end in segments(start, len(ordered_lengths), chunk_sizes):
        for piece in greedy_pieces(ordered_lengths[begin:end], plan):
            sizes.extend(even_split(piece, cap))
    return sizes


def over_budget(lengths: Iterable[int], plan: BatchPlan) -> list[int]:
    """Positions of samples longer than ``max_tokens`` (a mode sized by tokens; they run alone, over the budget)."""
    if not plan.length_mode.sizes_by_tokens:
        return []
    return [k for k, length in enumerate(lengths) if length > plan.max_tokens]


def steps_for(micro_batches: int, entries: int) -> int:
    """Optimizer steps that ``micro_batches`` take at ``entries`` micro-batches a step."""
    return -(-micro_batches // entries)


def agreed_steps(counts: Sequence[tuple[int, int]], entries: int) -> int:
    """The steps every rank runs for the rest of the epoch: the most any rank needs.

    Args:
        counts: per rank ``(micro_batches, samples)`` left in the epoch.

    Raises:
        ValueError: a rank has fewer samples than the micro-batches it would need (the same on every rank).
    """
    steps = max((steps_for(m, entries) for m, _ in counts), default=0)
    need = (steps - 1) * entries + 1 if steps else 0
    short = [r for r, (_, samples) in enumerate(counts) if samples < need]
    if short:
        raise ValueError(f'rank(s) {short} have fewer samples left ({[counts[r][1] for r in short]}) than the '
                         f'{need} micro-batches needed to run {steps} optimizer steps like the other ranks; use a '
                         'larger max_tokens / rule sizes or fewer ranks')
    return steps


def equalize_steps(sizes: Sequence[int], entries: int, steps: int) -> list[int]:
    """Split the largest micro-batches (most samples, earliest first) in halves until ``sizes`` need ``steps``
    optimizer steps at ``entries`` micro-batches a step (at least ``(steps - 1) * entries + 1`` micro-batches).

    Halves of a micro-batch are within its budget. Order and samples are unchanged.

    Raises:
        ValueError: more micro-batches than ``steps`` allow, or no micro-batch left to split.
    """
    out = list(sizes)
    if len(out) > steps * entries:
        raise ValueError(f'{len(out)} micro-batches need more than {steps} steps of {entries}')
    need = (steps - 1) * entries + 1 if steps else 0
    while len(out) < need:
        k = max(range(len(out)), key=lambda j: (out[j], -j), default=None)
        if k is None or out[k] < 2:
            raise ValueError(f'cannot split {sum(out)} samples into {need} micro-batches')
        out[k:k + 1] = [out[k] - out[k] // 2, out[k] // 2]
    return out


def padding(batches: Iterable[Sequence[int]]) -> tuple[int, int]:
    """``(real, padded)`` tokens of micro-batches given as their samples' lengths."""
    real = padded = 0
    for lengths in batches:
        if lengths:
            real += sum(lengths)
            padded += len(lengths) * max(lengths)
    return real, padded


def padding_fraction(real: int, padded: int) -> float:
    return 1.0 - real / padded if padded else 0.0


def run_length(sizes: Sequence[int]) -> list[list[int]]:
    """``[5, 5, 5, 2]`` -> ``[[5, 3], [2, 1]]`` (compact checkpoint form)."""
    out: list[list[int]] = []
    for size in sizes:
        if out and out[-1][0] == size:
            out[-1][1] += 1
        else:
            out.append([size, 1])
    return out


def from_run_length(pairs: Sequence[Sequence[int]]) -> list[int]:
    return [int(size) for size, count in pairs for _ in range(int(count))]


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0

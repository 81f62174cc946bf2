"""Balanced global steps (``length_batching`` ``mode: balanced``) as pure functions.

Every optimizer step takes exactly the configured global batch, ``G = world x batch x entries`` samples. An epoch's
samples (the host's order, all ranks') are laid out by :func:`balanced_layout`:

1. sorted by a jittered length ``L x (1 + jitter x u)``, ``u`` uniform in ``[-1, 1]`` (seed ``(seed, epoch)``), so
   samples of similar length meet and every epoch groups them a little differently;
2. cut into steps of ``G`` consecutive samples; the full steps are shuffled, the short rest (``n mod G`` samples,
   the longest ones) runs last;
3. each step's samples are dealt to the ranks, ``batch x entries`` each (the rest: as evenly as possible, lower ranks
   first), longest first to the rank with the least work so far (greedy LPT with a count limit), and each rank's
   share is ordered longest first, so consecutive ``batch`` samples form its micro-batches.

A row's *work* is ``a x L + L^2`` (matmuls, linear in its tokens, plus attention, quadratic), with ``a`` from the
model's shape (:func:`work_coefficient`); a micro-batch padded to its longest row costs ``n x work(longest)``, a
padding-free one ``work(sum of its lengths)`` (sdpa / eager attention over the concatenated row). A step's *rank
work spread* is ``max / mean - 1`` of the ranks' work (0: even).

Nothing is dropped or repeated: every rank's share is a partition of the epoch (:func:`balanced_layout` checks it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from .pass_cost import fits

#: ``a`` when the model's shape is unknown: a 7B dense decoder's (verl's ``24576 x L + L^2``)
DEFAULT_WORK_COEF = 24576.0


def work_coefficient(hidden_size: int | None, intermediate_size: int | None) -> float:
    """``a`` of ``a x L + L^2``: per-token matmul FLOPs over per-token-per-context attention FLOPs of one layer.

    A layer's projections cost ``2 x (4 h^2 + 3 h i)`` FLOPs a token (q, k, v, o; gate, up, down) and its attention
    ``4 h`` a token per context token, so ``a = 2 h + 1.5 i`` (7B, h 4096, i 11008: 24,704, verl's 24,576).
    """
    if not hidden_size or not intermediate_size:
        return DEFAULT_WORK_COEF
    return 2.0 * hidden_size + 1.5 * intermediate_size


def row_work(length: int, coef: float) -> float:
    """Work of one row of ``length`` tokens: ``coef x L + L^2``."""
    return coef * length + float(length) * length


def batch_work(lengths: Sequence[int], coef: float, *, padding_free: bool = False) -> float:
    """Work of one micro-batch given its rows' lengths: ``n x work(longest)`` padded, ``work(sum)`` padding-free."""
    if not lengths:
        return 0.0
    if padding_free:
        return row_work(sum(lengths), coef)
    return len(lengths) * row_work(max(lengths), coef)


def rank_work(lengths: Sequence[int], batch: int, coef: float, *, padding_free: bool = False) -> float:
    """Work of one rank's share of a step: its lengths (in order) cut into micro-batches of ``batch``."""
    return sum(batch_work(lengths[k:k + batch], coef, padding_free=padding_free) for k in range(0, len(lengths), batch))


def work_spread(works: Sequence[float]) -> float:
    """``max / mean - 1`` of the ranks' work (0 for one rank or no work)."""
    if len(works) < 2:
        return 0.0
    mean = sum(works) / len(works)
    return max(works) / mean - 1.0 if mean > 0 else 0.0


def share_counts(samples: int, world: int) -> list[int]:
    """Samples of each rank in a step of ``samples``: as even as possible, the extra ones to the lower ranks."""
    base, extra = divmod(samples, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def deal(step: Sequence[int], lengths: Sequence[int], counts: Sequence[int], coef: float, *,
         padding_free: bool = False) -> list[list[int]]:
    """Deal one step's samples to the ranks: longest first, each to the rank with the least load that has room
    (``counts[r]`` samples); the load is the rows' work, or, padding-free, their tokens (a packed row costs
    ``work(sum of its lengths)``, so even sums are even work). Every share is returned longest first (ties: smaller
    dataset index first)."""
    if sum(counts) != len(step):
        raise ValueError(f'deal: counts {list(counts)} do not add up to the step\'s {len(step)} samples')
    shares: list[list[int]] = [[] for _ in counts]
    load = [0.0] * len(counts)
    for i in sorted(step, key=lambda i: (-lengths[i], i)):
        r = min((r for r in range(len(counts)) if len(shares[r]) < counts[r]), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i] if padding_free else row_work(lengths[i], coef)
    return shares


@dataclass(frozen=True)
class BalancedLayout:
    """An epoch laid out in balanced global steps.

    Attributes:
        shares: per rank, its dataset indices in training order (a step's share after another's).
        steps: per step, how many samples each rank takes.
        spread: per step, the rank work spread of the balanced deal.
        unbalanced: per step, the spread the same samples would have had dealt in the host's order (each rank its
            consecutive share, micro-batches in that order).
    """

    shares: list[list[int]]
    steps: list[list[int]]
    spread: list[float]
    unbalanced: list[float]


def balanced_layout(order: Sequence[int], lengths: Sequence[int], *, world: int, batch: int, entries: int, seed: int,
                    epoch: int, jitter: float, coef: float, padding_free: bool = False) -> BalancedLayout:
    """Lay out an epoch (``order``: all ranks' samples in the host's order) in balanced global steps (module
    docstring). ``jitter`` in ``[0, 10]``: the relative length noise of the sort (0: a pure sort)."""
    if world < 1 or batch < 1 or entries < 1:
        raise ValueError(f'balanced_layout: need world, batch, entries >= 1; got {world}, {batch}, {entries}')
    rng = random.Random(f'{seed}:{epoch}:balanced')
    place = {i: k for k, i in enumerate(order)}
    keys = {i: lengths[i] * (1.0 + jitter * (2.0 * rng.random() - 1.0)) for i in order}
    ranked = sorted(order, key=lambda i: (keys[i], place[i]))
    size = world * batch * entries
    full = len(ranked) // size
    blocks = [ranked[k * size:(k + 1) * size] for k in range(full)]
    rng.shuffle(blocks)
    if len(ranked) > full * size:
        blocks.append(ranked[full * size:])
    shares: list[list[int]] = [[] for _ in range(world)]
    steps, spread, unbalanced = [], [], []
    for block in blocks:
        counts = share_counts(len(block), world)
        dealt = deal(block, lengths, counts, coef, padding_free=padding_free)
        for r in range(world):
            shares[r].extend(dealt[r])
        steps.append(counts)
        spread.append(work_spread([rank_work([lengths[i] for i in s], batch, coef, padding_free=padding_free)
                                   for s in dealt]))
        hosted = sorted(block, key=lambda i: place[i])
        bounds = [sum(counts[:r]) for r in range(world + 1)]
        unbalanced.append(work_spread([
            rank_work([lengths[i] for i in hosted[bounds[r]:bounds[r + 1]]], batch, coef, padding_free=padding_free)
            for r in range(world)]))
    if sorted(i for s in shares for i in s) != sorted(order):
        raise AssertionError('balanced_layout lost or repeated a sample')  # a bug, never a user error
    return BalancedLayout(shares, steps, spread, unbalanced)


def rank_sizes(remaining: int, batch: int, entries: int) -> list[int]:
    """Micro-batch sizes of a rank's share from a step boundary: full steps of ``entries x batch``, then its share
    of the short last step, split as :func:`~.data_plan.step_sizes` splits a short step (empty ones left out)."""
    from .data_plan import step_sizes
    per_step = batch * entries
    full, rest = divmod(remaining, per_step)
    sizes = [batch] * (full * entries)
    if rest:
        sizes.extend(s for s in step_sizes(rest, batch, entries) if s)
    return sizes


def step_passes(lengths: Sequence[int], per_step: int, budget: int, *, padding_free: bool = False,
                max_rows: int | None = None, vision: Sequence[int] | None = None) -> list[list[int]]:
    """A rank's share from a step boundary (``lengths`` in training order) as steps of ``per_step`` samples (the
    last one may be short), each cut into as few forward/backward passes as fit ``budget`` tokens (``pass_tokens``).

    A pass takes consecutive rows while it :func:`~.pass_cost.fits` ``budget`` (the one cost model) and it holds at most
    ``max_rows`` rows (``None``: no row cap); a row longer than ``budget`` runs alone. ``vision``: each row's
    vision-tower work in tokens (:func:`~.pass_cost.pass_cost`), beside ``lengths``. Returns, per step, the rows
    of each pass. In a balanced layout a step's share is longest first, so a pass's first row is its longest.
    """
    if per_step < 1 or budget < 1 or (max_rows is not None and max_rows < 1):
        raise ValueError(f'step_passes: need per_step, budget, max_rows >= 1; got {per_step}, {budget}, {max_rows}')
    steps: list[list[int]] = []
    work = list(vision) if vision else [0] * len(lengths)
    for start in range(0, len(lengths), per_step):
        passes: list[int] = []
        rows: list[int] = []
        extra: list[int] = []
        for length, own in zip(lengths[start:start + per_step], work[start:start + per_step]):
            full = max_rows is not None and len(rows) >= max_rows
            if rows and (full or not fits(rows + [length], budget, packed=padding_free, vision=extra + [own])):
                passes.append(len(rows))
                rows, extra = [], []
            rows.append(length)
            extra.append(own)
        passes.append(len(rows))
        steps.append(passes)
    return steps


def pass_slots(passes: int, entries: int) -> tuple[int, ...]:
    """How a step's ``passes`` fill the trainer's ``entries`` micro-batch slots (HF runs ``gradient_accumulation_steps``
    micro-batches a step whatever they hold): as evenly as possible, ascending, so empty slots (no pass, nothing
    runs) come first and the last slot, the one whose backward synchronises gradients, always holds a pass."""
    from .data_plan import step_sizes
    return step_sizes(passes, max(1, -(-passes // entries)), entries)


def pad_passes(steps: list[list[int]], counts: Sequence[Sequence[int]]) -> tuple[list[list[int]], int]:
    """Every step of ``steps`` (this rank's passes, their rows) with empty passes (0 rows) added at its end up to the
    most passes any rank runs in it (``counts``: every rank's passes a step, as planned), for engines whose every pass
    enters collectives (FSDP2, DeepSpeed: every rank must run the same number of passes). Returns the padded steps and
    the padding passes added."""
    padded, added = [], 0
    for k, step in enumerate(steps):
        most = max((len(c) > k and c[k]) or 0 for c in counts)
        extra = max(0, most - len(step))
        padded.append(list(step) + [0] * extra)
        added += extra
    return padded, added

"""What one forward/backward pass costs, whether it fits a token budget, and the token budget after OOMs (pure).

The one cost model of a pass. The planner (:func:`~.balance.step_passes`: passes cut by ``pass_tokens``), the step
runner (how many pieces a drawn micro-batch or pass must run as), OOM recovery and ``memory_backoff`` under
``pass_tokens`` all ask :func:`pass_cost` / :func:`pieces_within`, so a pass the planner cut within a budget is never
cut again by the runner at the same budget, and an OOM or a memory cap lowers the budget the planner plans at.

A pass's *cost* is its tokens: ``rows x longest`` when its rows are padded to the longest (the activations and the
``tokens x vocabulary`` logits follow the padded shape), the sum of its rows' lengths when they run packed into one row
(padding-free). Memory follows tokens, not rows: a pass of two 4,000-token rows and one of sixty-four 125-token rows
cost the same.

:class:`TokenBudget` is the token budget OOM recovery keeps under ``pass_tokens`` (the integration's, saved with its
state): an OOM at a pass of cost ``c`` lowers it below ``c``; clean steps raise it again toward the plan's budget,
bisecting between the largest budget that ran clean and the smallest pass that failed, so a one-off OOM costs a few
steps and a real memory end settles just below it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .data_plan import piece_bounds


def pass_cost(lengths: Sequence[int], *, packed: bool) -> int:
    """Tokens one pass over rows of ``lengths`` costs: ``rows x longest`` padded, their sum packed (padding-free)."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def fits(lengths: Sequence[int], budget: int | None, *, packed: bool) -> bool:
    """Whether a pass over ``lengths`` keeps within ``budget`` tokens (``None``: no budget). A single row always
    fits: it cannot be cut further (a row that does not fit in memory is the step runner's to report)."""
    return budget is None or len(lengths) <= 1 or pass_cost(lengths, packed=packed) <= budget


def pieces_within(lengths: Sequence[int], *, packed: bool, tokens: int | None, samples: int | None = None,
                  requested: int = 1) -> int:
    """The fewest pieces (at least ``requested``; contiguous, as even as :func:`~.data_plan.piece_bounds` cuts) a
    pass over rows of ``lengths`` runs as so that every piece holds at most ``samples`` rows and :func:`fits`
    ``tokens``. A padded batch's ``lengths`` are its padded length per row (a piece keeps the batch's padding)."""
    rows = len(lengths)
    if rows <= 1:
        return 1
    k = max(1, min(rows, requested, ), -(-rows // samples) if samples else 1)
    while k < rows:
        if all(fits(lengths[a:b], tokens, packed=packed) for a, b in piece_bounds(rows, k)):
            return k
        k += 1
    return rows


@dataclass(frozen=True)
class TokenBudget:
    """The token budget a pass may cost after OOMs (``budget`` ``None``: the plan's own, nothing lowered).

    Attributes:
        budget: the budget passes are planned and cut at now (``None``: the plan's ``pass_tokens``).
        good: the largest budget that ran ``grow_after`` clean steps since the last OOM (``None``: none yet).
        bad: the cost of the smallest pass that ran out of memory (``None``: none, or forgotten after ``forget_after``
            clean steps at a settled budget, so a one-off OOM does not cap the run for good).
        clean: clean steps (no OOM on any rank) since the budget last changed.
        settled: clean steps since the budget stopped growing (it is within ``1/16`` of ``bad``).
    """

    budget: int | None = None
    good: int | None = None
    bad: int | None = None
    clean: int = 0
    settled: int = 0


def budget_after_oom(state: TokenBudget, failed_cost: int, ceiling: int) -> TokenBudget:
    """After an OOM in a pass that cost ``failed_cost`` tokens (the smallest such pass of the step, over all ranks):
    the largest budget that ran clean if it is below the failure, else half the failing pass (at least 1)."""
    bad = failed_cost if state.bad is None else min(state.bad, failed_cost)
    if state.good is not None and state.good < failed_cost:
        budget, good = state.good, state.good
    else:
        budget, good = max(1, failed_cost // 2), None
    return TokenBudget(budget=min(budget, ceiling), good=good, bad=bad)


def budget_after_step(state: TokenBudget, ceiling: int, *, grow_after: int, forget_after: int) -> TokenBudget:
    """After a clean step: count it; every ``grow_after`` clean steps the budget that ran them is *good* and the
    budget grows halfway to the smallest failed pass (to ``ceiling``, the plan's budget, when none is known; reaching
    it removes the lowered budget). Within ``1/16`` of the failure it stays (settled); after ``forget_after`` settled
    steps the failure is forgotten and growth resumes (``0``: never). ``grow_after`` ``0``: never grows."""
    if state.budget is None or grow_after <= 0:
        return state
    clean = state.clean + 1
    if clean < grow_after:
        return replace(state, clean=clean)
    good = max(state.good or 0, state.budget)
    bad = state.bad
    if bad is not None and bad - state.budget <= bad // 16:  # settled just below the failure
        settled = state.settled + 1
        if forget_after <= 0 or settled < forget_after:
            return replace(state, good=good, clean=0, settled=settled)
        bad = None
    target = ceiling if bad is None else (state.budget + bad) // 2
    budget = min(ceiling, max(state.budget + 1, target))
    return TokenBudget(budget=None if budget >= ceiling else budget, good=good, bad=bad)


def bytes_per_token(*, hidden: int, intermediate: int, layers: int, vocab: int, dtype_bytes: int,
                    checkpointing: bool) -> int:
    """Device memory one token of a training pass holds at its peak, from the model's shape (an estimate):

    ``18 x vocab`` bytes for the logits (in the model's dtype, upcast to fp32 for the loss, and their gradients), plus
    the activations kept for backward: ``(10 h + 4 i) x dtype_bytes`` a layer (attention and MLP inputs and outputs),
    every layer's without gradient checkpointing, else one hidden state a layer plus one layer's (the one being
    recomputed). Calibrated on one point (Qwen2.5-1.5B shape, bf16, sdpa, LoRA, a 16,384-token pass: 81.7 GiB peak on
    an H200; this gives 5.6 MB a token, 92 GB); the weights, their gradients and the optimizer are not per token.
    """
    layer = (10 * hidden + 4 * intermediate) * dtype_bytes
    kept = layers * hidden * dtype_bytes + layer if checkpointing else layers * layer
    return 18 * vocab + kept


def auto_pass_tokens(free_bytes: float, per_token: int, *, margin: float = 0.1, multiple: int = 256,
                     minimum: int = 256, maximum: int = 131072) -> int:
    """``pass_tokens: auto``: the tokens a pass may hold in ``free_bytes`` (the device's free memory after the model
    loaded) less a ``margin``, at ``per_token`` bytes a token (:func:`bytes_per_token`), rounded down to a multiple
    of ``multiple``, within ``[minimum, maximum]``."""
    tokens = int(free_bytes * (1.0 - margin) // max(per_token, 1)) // multiple * multiple
    return max(minimum, min(maximum, tokens))

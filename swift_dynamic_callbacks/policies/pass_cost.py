"""What one forward/backward pass costs, whether it fits a token budget, and the token budget after OOMs (pure).

The one cost model of a pass. The planner (:func:`~.balance.step_passes`: passes cut by ``pass_tokens``), the step
runner (how many pieces a drawn micro-batch or pass must run as), OOM recovery and ``memory_backoff`` under
``pass_tokens`` all ask :func:`pass_cost` / :func:`pieces_within`, so a pass the planner cut within a budget is never
cut again by the runner at the same budget, and an OOM or a memory cap lowers the budget the planner plans at.

A pass's *cost* is its tokens: ``rows x longest`` when its rows are padded to the longest (the activations and the
``tokens x vocabulary`` logits follow the padded shape), the sum of its rows' lengths when they run packed into one row
(padding-free). Memory follows tokens, not rows: a pass of two 4,000-token rows and one of sixty-four 125-token rows
cost the same. A vision-language row adds its images' and videos' work in the vision tower, in tokens
(:func:`vision_bytes_per_token` over :func:`bytes_per_token`): the tower runs on each row's patches, never on padding.

:class:`BudgetState` is what a pass may hold after OOMs (the integration's pass budget, saved with its state), in
one unit: tokens where passes are cut by a token budget (``pass_tokens``), else rows. An OOM at a pass of cost ``c``
lowers it below ``c``; clean steps raise it again by bisecting between the largest pass that ran clean and the smallest
that failed; once the two are close it settles, and after a quiet period it probes one step above the failure (a
one-off OOM does not cap the run for good), each failed probe waiting four times longer before the next, so a real
memory end costs a bounded number of OOMs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .data_plan import piece_bounds


def pass_cost(lengths: Sequence[int], *, packed: bool, vision: Sequence[int] | None = None) -> int:
    """Tokens one pass over rows of ``lengths`` costs: ``rows x longest`` padded, their sum packed (padding-free),
    plus each row's vision work (``vision``: tokens a row, its images' and videos' :func:`vision_token_cost`; ``None``:
    none)."""
    if not lengths:
        return 0
    return (sum(lengths) if packed else len(lengths) * max(lengths)) + (sum(vision) if vision else 0)


def fits(lengths: Sequence[int], budget: int | None, *, packed: bool, vision: Sequence[int] | None = None) -> bool:
    """Whether a pass over ``lengths`` (and their rows' ``vision`` work) keeps within ``budget`` tokens (``None``: no
    budget). A single row always fits: it cannot be cut further (a row that does not fit in memory is the step
    runner's to report)."""
    return budget is None or len(lengths) <= 1 or pass_cost(lengths, packed=packed, vision=vision) <= budget


def pieces_within(lengths: Sequence[int], *, packed: bool, tokens: int | None, samples: int | None = None,
                  requested: int = 1, vision: Sequence[int] | None = None) -> int:
    """The fewest pieces (at least ``requested``; contiguous, as even as :func:`~.data_plan.piece_bounds` cuts) a
    pass over rows of ``lengths`` (their ``vision`` work, :func:`pass_cost`) runs as so that every piece holds at
    most ``samples`` rows and :func:`fits` ``tokens``. A padded batch's ``lengths`` are its padded length per row (a
    piece keeps the batch's padding)."""
    rows = len(lengths)
    if rows <= 1:
        return 1
    k = max(1, min(rows, requested, ), -(-rows // samples) if samples else 1)
    while k < rows:
        if all(fits(lengths[a:b], tokens, packed=packed, vision=vision[a:b] if vision else None)
               for a, b in piece_bounds(rows, k)):
            return k
        k += 1
    return rows


@dataclass(frozen=True)
class BudgetState:
    """What a pass may hold after OOMs, in one unit (tokens or rows; ``budget`` ``None``: nothing lowered).

    Attributes:
        budget: the budget passes are planned and cut at now (``None``: the ceiling, the plan's own).
        good: the largest pass that ran clean since the first OOM (``None``: none yet): a budget at it never fails
            under a memory end that stays where it is.
        bad: the smallest pass that ran out of memory (``None``: none, or a probe above it ran clean).
        clean: clean steps (no OOM on any rank) since the budget last changed.
        settled: clean steps since the budget settled within :func:`tolerance` of ``bad``.
        probes: how much longer the next probe waits (x4 each): a probe above ``bad`` that failed, or a second OOM
            while a lowered budget was in force (the end is real), since the last probe that ran clean.
        probing: the budget is above ``bad`` now, a probe.
        crossed: a budget grown above the largest clean pass ran out of memory since the failure was last forgotten:
            from then on it grows an eighth at a time (never halfway), so the end is crossed once more at most.
    """

    budget: int | None = None
    good: int | None = None
    bad: int | None = None
    clean: int = 0
    settled: int = 0
    probes: int = 0
    probing: bool = False
    crossed: bool = False


#: while the budget is further below the smallest failed pass than this fraction of it (and no growth crossed the
#: end yet), it grows halfway to the failure at once instead of an eighth at a time
FAR = 1 / 4


def tolerance(bad: int) -> int:
    """How close below the smallest failed pass the budget settles: an eighth of it, at least 1."""
    return max(1, bad // 8)


def budget_after_oom(state: BudgetState, failed: int, ceiling: int, *, fitted: int = 0) -> BudgetState:
    """After an OOM in a pass of ``failed`` (the smallest such pass of the step, over all ranks; ``fitted``: the
    largest pass that ran clean in it, over all ranks): the largest pass that ran clean if it is below the failure,
    else half the failing pass (at least 1); a probe that failed above the failure goes back to where it settled, one
    :func:`tolerance` below the failure. A failed probe, or any OOM while a lowered budget was in force, makes the
    next probe wait four times longer (the end is real); an OOM of a budget grown above the largest clean pass marks
    the end ``crossed`` (growth is an eighth at a time from then on)."""
    bad = failed if state.bad is None else min(state.bad, failed)
    good = max(state.good or 0, fitted) or None
    if good is not None and good >= bad:
        good = None
    budget = good if good is not None else max(1, failed // 2)
    if state.probing and state.bad is not None and failed >= state.bad:  # a failed probe: back where it settled
        budget = max(budget, state.bad - tolerance(state.bad))
    grown = state.budget is not None and state.good is not None and state.budget > state.good
    confirmed = state.probing or state.budget is not None
    return BudgetState(budget=min(budget, ceiling), good=good, bad=bad,
                       probes=state.probes + int(confirmed), crossed=state.crossed or grown)


def budget_after_step(state: BudgetState, ceiling: int, *, fitted: int = 0, grow_after: int,
                      probe_after: int, headroom: bool | None = None) -> BudgetState:
    """After a clean step whose largest pass was ``fitted`` (over all ranks): every ``grow_after`` clean steps the
    budget grows toward the smallest failed pass: halfway while it is more than :data:`FAR` of it below and no grown
    budget failed yet (the first OOM's budget, half the failing pass, is far below a memory end the user's budget
    was a little above: a bisection lands near it in a step or two), else an eighth, at most halfway (halfway to
    ``ceiling`` when none is known; reaching it removes the lowered budget). Within :func:`tolerance` of the failure
    it settles; after ``probe_after`` settled steps (times four for each failed probe) it probes one tolerance above
    the failure, unless ``headroom`` says the device has none (``False``: the settled steps start again; ``None``:
    unknown). A pass at least as large as the failure that runs clean (a probe's, or one row over the budget)
    forgets the failure and growth resumes; a probe holds until then or until it fails. ``grow_after`` ``0``: never
    grows; ``probe_after`` ``0``: never probes."""
    if state.budget is None or grow_after <= 0:
        return state
    clean = state.clean + 1
    good = max(state.good or 0, fitted) or None
    bad = state.bad
    if bad is not None and good is not None and good >= bad:  # a pass as large as the failure ran clean since
        bad = None
    if bad is not None and not state.probing and bad - state.budget <= tolerance(bad):
        settled = state.settled + 1
        if probe_after <= 0 or settled < probe_after * 4 ** state.probes:
            return replace(state, clean=clean, good=good, settled=settled)
        if headroom is False:
            return replace(state, clean=clean, good=good, settled=0)
        return replace(state, budget=min(ceiling, bad + tolerance(bad)), good=good, clean=0, settled=0, probing=True)
    if clean < grow_after or (state.probing and bad is not None):  # a probe ends when a pass above the failure
        return replace(state, clean=clean, good=good, bad=bad)        # runs clean (or fails): until then it holds
    probes = 0 if state.probing else state.probes
    if bad is None:  # nothing failed below the ceiling: halfway to it
        target = (state.budget + ceiling) // 2
    elif not state.crossed and bad - state.budget > bad * FAR:  # far below the first failure: halfway at once
        target = (state.budget + bad) // 2
    else:  # toward a failure: an eighth at a time, at most halfway (one overshoot of a real memory end, then settled)
        target = min((state.budget + bad) // 2, state.budget + state.budget // 8)
    budget = min(ceiling, max(state.budget + 1, target))
    return BudgetState(budget=None if budget >= ceiling else budget, good=good, bad=bad, probes=probes,
                       crossed=state.crossed and bad is not None)


#: a linear-attention layer's bytes a token beyond a full-attention layer's, in its widths ``2 x keys + values``
#: (:func:`bytes_per_token`): fitted by the storage counter of ``scripts/bench_vision_bytes.py`` on text passes of the
#: Qwen3.5 shape (CPU, fp32, transformers' torch Gated DeltaNet: chunked, with each chunk's recurrent state kept)
LINEAR_ATTENTION_WIDTHS = 11
#: the bytes of an element of those widths, whatever the model's dtype: transformers' torch Gated DeltaNet
#: (``torch_chunk_gated_delta_rule``, its gated norm too) computes in fp32. Counted in the model's dtype, a bf16
#: Qwen3.5 held 1.50 x ``bytes_per_token`` on an H200 (28 layers, 21 of them linear); counted in fp32, 1.07 x (the
#: Qwen2.5 shape there: 1.15 x)
LINEAR_ATTENTION_DTYPE_BYTES = 4


def bytes_per_token(*, hidden: int, intermediate: int, layers: int, vocab: int, dtype_bytes: int,
                    checkpointing: bool, linear_layers: int = 0, linear_width: int = 0) -> int:
    """Device memory one token of a training pass holds at its peak, from the model's shape (an estimate):

    ``18 x vocab`` bytes for the logits (in the model's dtype, upcast to fp32 for the loss, and their gradients), plus
    the activations kept for backward: ``(10 h + 4 i) x dtype_bytes`` a layer (attention and MLP inputs and outputs),
    every layer's without gradient checkpointing, else one hidden state a layer plus one layer's (the one being
    recomputed). Calibrated on one point (Qwen2.5-1.5B shape, bf16, sdpa, LoRA, a 16,384-token pass: 81.7 GiB peak on
    an H200; this gives 5.6 MB a token, 92 GB); the weights, their gradients and the optimizer are not per token.
    ``linear_layers`` of the ``layers`` are linear attention (Qwen3.5's Gated DeltaNet, ``linear_width`` = 2 x its
    key width + its value width): each holds :data:`LINEAR_ATTENTION_WIDTHS` x ``linear_width`` more, in fp32
    (:data:`LINEAR_ATTENTION_DTYPE_BYTES`) whatever ``dtype_bytes``.
    """
    layer = (10 * hidden + 4 * intermediate) * dtype_bytes
    extra = LINEAR_ATTENTION_WIDTHS * linear_width * LINEAR_ATTENTION_DTYPE_BYTES
    linear = layer + extra if linear_layers else layer
    if checkpointing:
        kept = layers * hidden * dtype_bytes + max(layer, linear)
    else:
        kept = (layers - linear_layers) * layer + linear_layers * linear
    return 18 * vocab + kept


#: a vision block's bytes an element over a decoder layer's, at the same widths (:func:`vision_bytes_per_token`):
#: fitted on the Qwen2.5-VL shape by the storage counter of ``scripts/bench_vision_bytes.py`` (CPU; windows of
#: patches reordered, 2-D rotary on q and k, the merger's MLP), held out on the Qwen3.5 shape
VISION_BLOCK_FACTOR = 1.28
#: what a frozen tower leaves a pass an image token, in its output's widths (:func:`vision_bytes_per_token`)
FROZEN_OUTPUT_WIDTHS = 6.7


def vision_bytes_per_token(*, width: int, intermediate: int, depth: int, gated: bool, merge: int, out_width: int,
                           dtype_bytes: int, checkpointing: bool, trained: bool) -> int:
    """Device memory a vision tower adds to a pass for each image (video) token it feeds the language model (an
    estimate; each token is ``merge`` patches through ``depth`` blocks of ``width``, MLP ``intermediate``).

    A tower that trains (LoRA on its layers, or ``freeze_vit: false``) keeps its activations for the backward as a
    decoder layer does (:func:`bytes_per_token`'s ``10 h + 4 i`` a layer; ``2 i`` for an MLP that is not gated) x
    :data:`VISION_BLOCK_FACTOR`, a patch at a time: every block's without gradient checkpointing, else one width a block
    plus one block's. A frozen tower (ms-swift's ``freeze_vit``, the default under LoRA) keeps nothing for a backward
    through it; what stays while the language model runs is its output (:data:`FROZEN_OUTPUT_WIDTHS` x
    ``out_width`` a token)."""
    if not trained:
        return int(FROZEN_OUTPUT_WIDTHS * out_width * dtype_bytes)
    block = (10 * width + (4 if gated else 2) * intermediate) * dtype_bytes * VISION_BLOCK_FACTOR
    kept = depth * width * dtype_bytes + block if checkpointing else depth * block
    return int(merge * kept)


def vision_token_cost(vision_bytes: int, token_bytes: int) -> float:
    """The tokens of the cost model one image (video) token's vision work is worth: its
    :func:`vision_bytes_per_token` over a language-model token's :func:`bytes_per_token`."""
    return vision_bytes / max(token_bytes, 1)


def auto_pass_tokens(free_bytes: float, per_token: int, *, margin: float = 0.1, multiple: int = 256,
                     minimum: int = 256, maximum: int = 131072) -> int:
    """``pass_tokens: auto``: the tokens a pass may hold in ``free_bytes`` (the device's free memory after the model
    loaded) less a ``margin``, at ``per_token`` bytes a token (:func:`bytes_per_token`), rounded down to a multiple
    of ``multiple``, within ``[minimum, maximum]``."""
    tokens = int(free_bytes * (1.0 - margin) // max(per_token, 1)) // multiple * multiple
    return max(minimum, min(maximum, tokens))

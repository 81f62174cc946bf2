"""GRPO's training phase cut into passes by tokens: which rows of a micro-batch of completions each pass runs, and
how much of the micro-batch's loss each pass carries so that the passes' gradients add up to the one-pass gradient.
Pure functions (no torch): the trainer side (``integrations/grpo_passes.py``) applies them.

A micro-batch of ms-swift's GRPO is ``rows`` completions (prompt + completion), padded to one ``length``; a pass of
``k`` rows costs ``k x length`` tokens. How ms-swift 4.6 reduces the per-token loss of a call decides each pass's
weight (``_compute_loss_and_metrics`` in ``rlhf_trainers/grpo_trainer.py``):

- ``grpo`` / ``sapo`` (each completion's token mean, then the mean over completions) and ``dr_grpo`` (the token sum
  over ``rows x max_completion_length``): a pass carries its share of the rows;
- ``bnpo`` (the token mean over the call's completion tokens): its share of the completion tokens;
- ``cispo`` / ``dapo`` / ``fipo`` (the token sum over the whole accumulation window's tokens, a constant of the
  batch): all of it (weight 1).
"""

from __future__ import annotations

#: how each ``loss_type`` is reduced over a call's completions: the unit a pass's weight is counted in
WEIGHTING = {'grpo': 'rows', 'sapo': 'rows', 'dr_grpo': 'rows', 'bnpo': 'tokens', 'cispo': 'window',
             'dapo': 'window', 'fipo': 'window'}


def plan_passes(rows: int, length: int, budget: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, end)`` row ranges covering ``rows`` rows of ``length`` padded tokens, each pass as many rows
    as fit in ``budget`` tokens (at least one row: a completion longer than the budget runs alone)."""
    if rows <= 0:
        return []
    per_pass = max(1, budget // max(1, length))
    return [(start, min(rows, start + per_pass)) for start in range(0, rows, per_pass)]


def pass_weight(loss_type: str, rows: int, total_rows: int, tokens: int, total_tokens: int) -> float:
    """The share of the micro-batch's loss a pass of ``rows`` rows and ``tokens`` completion tokens carries (of
    ``total_rows`` / ``total_tokens``) under ``loss_type`` (:data:`WEIGHTING`): the pass's own loss times it, summed
    over the passes, is the one-pass loss."""
    unit = WEIGHTING.get(loss_type)
    if unit is None:
        raise ValueError(f'loss_type {loss_type!r}: no pass weighting (known: {", ".join(WEIGHTING)})')
    if unit == 'window':
        return 1.0
    if unit == 'tokens' and total_tokens > 0:
        return tokens / total_tokens
    return rows / total_rows if total_rows else 0.0

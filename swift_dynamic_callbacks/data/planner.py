"""The rest of an epoch planned as optimizer steps, agreed by the ranks: what :class:`~.elastic.ElasticDataLoader`
hands its cursor after a change of size, plan or pass budget.

Two plans, each one collective (a gather of every rank's counts) on top of the pure arithmetic of
:mod:`..policies.length` and :mod:`..policies.balance`:

- :func:`plan_micro_batches`: micro-batch sizes, every rank running as many optimizer steps as the rank that needs
  most (placeholder steps for a rank with fewer);
- :func:`plan_passes` (``pass_tokens``): steps of passes within a token budget; under an engine whose every pass
  communicates, as many passes in each step as the rank that needs most (zero-weight padding passes).

No state: the loader keeps what they return (its cursor, its padding count).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .. import distributed
from ..policies import length as length_policy
from ..policies.balance import pad_passes, step_passes


@dataclass(frozen=True)
class Planned:
    """The rest of an epoch as this rank will draw it.

    Attributes:
        sizes: every micro-batch's (or pass's) rows, in order (0: an empty slot).
        steps: the optimizer steps every rank runs (agreed).
        passes: the passes of each step (``plan_passes`` only; empty otherwise).
        padding: the zero-weight padding passes among them (``equal_passes`` only).
    """

    sizes: list[int]
    steps: int
    passes: list[int] = field(default_factory=list)
    padding: int = 0


def plan_micro_batches(sizes: list[int], remaining: int, entries: int, *, balanced: bool) -> Planned:
    """``sizes`` (this rank's planned micro-batches for the rest of the epoch, ``entries`` a step) as steps every rank
    runs: as many as the rank that needs most. A rank with too few samples to fill as many steps (a shard a sample
    short, every sample alone) runs each of its samples alone and then placeholder steps; under balanced steps the
    steps are the layout's. Collective: one gather."""
    counts = distributed.gather_objects((len(sizes), remaining))
    steps = max((length_policy.steps_for(m, entries) for m, _ in counts), default=0)
    own = min(steps, length_policy.steps_for(remaining, entries))
    if balanced:
        own = length_policy.steps_for(len(sizes), entries)
    return Planned(length_policy.equalize_steps(sizes, entries, own), steps)


def plan_passes(costs: Sequence[int], samples_a_step: int, pass_tokens: int | None, *, padding_free: bool,
                max_rows: int | None, equal_passes: bool, vision: Sequence[int] | None = None) -> Planned:
    """The rest of the epoch (``costs``: the cost of every sample left, in order) as steps of ``samples_a_step``
    samples cut into passes within ``pass_tokens`` (:func:`~..policies.balance.step_passes`; ``vision``: each
    sample's vision-tower work in tokens, beside ``costs``); every rank then runs
    as many steps as the rank that needs most (steps of empty slots) and, with ``equal_passes``, as many passes in
    each step (:func:`~..policies.balance.pad_passes`). Collective: one gather of every rank's passes a step."""
    steps = step_passes(list(costs), samples_a_step, pass_tokens, padding_free=padding_free, max_rows=max_rows,
                        vision=vision) if costs else []
    counts = distributed.gather_objects([len(step) for step in steps])
    agreed = max(len(c) for c in counts)
    steps += [[] for _ in range(agreed - len(steps))]
    padding = 0
    if equal_passes:
        steps, padding = pad_passes(steps, counts)
    return Planned([rows for step in steps for rows in step], agreed, [len(step) for step in steps], padding)

"""What a loader drew since the integration last read it: tokens, rank work spreads and budget reports.

The integration reads and resets these at each log (``take_*``); nothing here is part of a checkpoint (the counts
restart at a resume, as the log's own counters do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .interface import BudgetReports


@dataclass
class DrawStats:
    """Counters of the micro-batches drawn since the last ``take_*`` call.

    Attributes:
        real / padded / batches: real tokens, padded tokens (real ones when padding-free) and micro-batches drawn
            with a batch plan.
        spread / unbalanced / steps: the sum of the rank work spreads of the balanced steps drawn, of the host-order
            deal of the same samples, and the number of those steps.
        over_estimates: micro-batches whose real padded tokens exceed the plan's budget (estimated lengths were low).
        rows_over_budget: a stream's rows longer than the budget, ``(index, cost)`` each.
    """

    real: int = 0
    padded: int = 0
    batches: int = 0
    spread: float = 0.0
    unbalanced: float = 0.0
    steps: int = 0
    over_estimates: list[dict[str, Any]] = field(default_factory=list)
    rows_over_budget: list[tuple[int, int]] = field(default_factory=list)

    def count_batch(self, real: int, padded: int) -> None:
        """One micro-batch drawn under a plan: ``real`` and ``padded`` tokens."""
        self.real += real
        self.padded += padded
        self.batches += 1

    def count_step_spread(self, spread: tuple[float, float]) -> None:
        """One balanced step drawn: ``(its rank work spread, that of the host-order deal)``."""
        self.spread += spread[0]
        self.unbalanced += spread[1]
        self.steps += 1

    def take_token_stats(self) -> tuple[int, int, int]:
        """``(real, padded, micro_batches)`` since the last call; resets them."""
        stats = (self.real, self.padded, self.batches)
        self.real = self.padded = self.batches = 0
        return stats

    def take_spread_stats(self) -> tuple[float, float, int]:
        """``(sum of spreads, sum of unbalanced spreads, steps)`` since the last call; resets them."""
        stats = (self.spread, self.unbalanced, self.steps)
        self.spread = self.unbalanced = 0.0
        self.steps = 0
        return stats

    def take_reports(self) -> BudgetReports:
        """The budget reports since the last call; resets them."""
        reports = BudgetReports(over_estimates=self.over_estimates, rows_over_budget=self.rows_over_budget)
        self.over_estimates, self.rows_over_budget = [], []
        return reports

"""Step-indexed tables (pure functions)."""

from __future__ import annotations

from typing import Mapping


def scheduled_value(table: Mapping[int, int], step: int) -> int | None:
    """Value of ``table`` in effect at 0-based optimizer step ``step``: the entry with the largest key <= step.

    ``{0: 2, 10: 4}`` gives 2 for steps 0..9 and 4 from step 10 on (after 10 optimizer steps). ``None`` before
    the first key.
    """
    keys = [k for k in table if k <= step]
    return table[max(keys)] if keys else None


def changes_at(table: Mapping[int, int], step: int) -> bool:
    """True when the value in effect at ``step`` differs from the one at ``step - 1`` (or starts at ``step``)."""
    return scheduled_value(table, step) != (scheduled_value(table, step - 1) if step > 0 else None)

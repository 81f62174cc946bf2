"""``token_budget``: ``floor(max_tokens / longest)`` samples (at least 1), so ``samples x longest <= max_tokens``
(padding-free: the real tokens, their sum, within ``max_tokens``); a sample longer than ``max_tokens`` goes alone and
is reported."""

from __future__ import annotations

from typing import Any

from .base import LengthMode, Plan


class TokenBudgetMode(LengthMode):
    """Sized by ``micro_batch_tokens`` (the plan's ``max_tokens``)."""

    name = 'token_budget'
    reads = ('micro_batch_tokens', )
    sizes_by_tokens = True

    def limit(self, plan: Plan, longest: int) -> int:
        return max(1, plan.max_tokens // max(longest, 1))

    def sizes(self, plan: Plan) -> str:
        return f'max {plan.max_tokens} {"real" if plan.padding_free else "padded"} tokens'

    def pass_limit(self, plan: Plan) -> dict[str, Any]:
        return {'samples': None, 'tokens': plan.max_tokens, 'rules': []}

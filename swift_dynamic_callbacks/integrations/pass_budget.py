"""The token budget of a pass under ``pass_tokens`` after OOMs: agreed at every step boundary, planned at.

Under ``length_batching.pass_tokens`` a pass is sized by tokens, so an OOM says a pass of that many *tokens* did not
fit, whatever its rows. At each step boundary, from every rank's OOM records of the step that ended (the same list on
every rank: ``requests.agree_step`` exchanges them), :class:`PassBudget` folds the smallest failed pass's cost into
:class:`~..policies.pass_cost.TokenBudget` (lower after an OOM, halfway back after clean steps), so every rank holds
the same budget; the coordinator then plans the steps from this one on at it (``ElasticDataLoader.set_pass_budget``)
and the step runner cuts no pass above it. A one-off OOM costs a few steps of smaller passes; a real memory end settles
just below the smallest pass that failed.

State (saved with the integration's): the :class:`~..policies.pass_cost.TokenBudget`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Iterable, Mapping

from ..policies.pass_cost import TokenBudget, budget_after_oom, budget_after_step
from ..records import DecisionRecord


class PassBudget:
    """The agreed token budget of a pass (``budget`` ``None``: the plan's ``pass_tokens``).

    Args:
        grow_after: clean steps before the budget grows (``integration.oom_grow_back_steps``; 0: never).
        forget_after: settled clean steps before a failure is forgotten (``integration.oom_forget_steps``; 0: never).
    """

    def __init__(self, grow_after: int = 2, forget_after: int = 32) -> None:
        self.grow_after = grow_after
        self.forget_after = forget_after
        self.state = TokenBudget()

    @property
    def budget(self) -> int | None:
        return self.state.budget

    def at_boundary(self, ooms: Iterable[DecisionRecord], ceiling: int | None, step: int) -> DecisionRecord | None:
        """Fold the step that ended in (``ooms``: every rank's OOM records of it; ``ceiling``: the plan's
        ``pass_tokens``, ``None`` when passes are not cut by tokens). Returns a ``pass_budget`` record when the budget
        changed."""
        if ceiling is None:
            self.state = TokenBudget()
            return None
        old = self.state
        failed = [int(r.values['pass_tokens']) for r in ooms if r.values.get('pass_tokens')]
        if failed:
            self.state = budget_after_oom(old, min(failed), ceiling)
            action = 'oom'
        else:
            self.state = budget_after_step(old, ceiling, grow_after=self.grow_after, forget_after=self.forget_after)
            action = 'grow_back' if (self.state.budget or ceiling) > (old.budget or ceiling) else 'forget'
        if self.state.budget == old.budget:
            return None
        new = self.state.budget if self.state.budget is not None else ceiling
        values = {'old': old.budget if old.budget is not None else ceiling, 'new': new, 'pass_tokens': ceiling,
                  'failed_pass_tokens': min(failed) if failed else None, 'good': self.state.good,
                  'bad': self.state.bad}
        if action == 'oom':
            message = (f'out of memory in a pass of {min(failed)} tokens: passes planned within {new} tokens from '
                       'this step on (rows not capped)')
        else:
            message = (f'{self.grow_after} clean steps: passes planned within {new} tokens' +
                       (' (the plan\'s pass_tokens)' if self.state.budget is None else
                        f' (halfway to the smallest failed pass, {self.state.bad})'))
        return DecisionRecord('integration', 'pass_budget', action, values, message, step=step)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        self.state = TokenBudget(**(state or {}))

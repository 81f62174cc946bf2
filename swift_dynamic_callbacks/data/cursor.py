"""The batch plan's cursor over the rest of an epoch: the micro-batch sizes planned, the passes of each step when a
token budget cuts passes here (``pass_tokens``), and the optimizer steps every rank agreed on.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import StateError
from ..policies import length as length_policy
from ..policies.balance import pass_slots, rank_sizes


class PlanCursor:
    """What is planned for the rest of the epoch under a batch plan (``plan``; None: no plan, nothing planned).

    State: ``plan``, ``sizes`` (micro-batch sizes left in the epoch; with passes: pass sizes), ``passes`` (passes of
    each step left, when passes are cut here), ``steps`` (optimizer steps left, agreed by all ranks). Saved as
    ``plan``, ``plan_sizes`` / ``plan_passes`` (run-length encoded) and ``plan_steps``.
    """

    def __init__(self) -> None:
        self.plan: length_policy.BatchPlan | None = None
        self.sizes: list[int] = []
        self.passes: list[int] = []
        self.steps = 0

    @property
    def cuts_passes(self) -> bool:
        """Whether each step's share is cut into passes by a token budget here (``pass_tokens``)."""
        return self.plan is not None and self.plan.cuts_passes

    def set(self, sizes: list[int], steps: int, passes: Sequence[int] = ()) -> None:
        """The rest of the epoch, as just planned."""
        self.sizes, self.steps, self.passes = sizes, steps, list(passes)

    def next_step(self, entries: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """The sizes of the next step's micro-batches and, when passes are cut here, the number of passes in each of
        HF's ``entries`` slots (None: one micro-batch a slot; a short last step has empty ones first). Does not
        consume them (:meth:`advance`)."""
        if self.cuts_passes:
            planned = tuple(self.sizes[:self.passes[0]])
            return planned, pass_slots(len(planned), entries)
        planned = tuple(self.sizes[:entries])
        return (0, ) * (entries - len(planned)) + planned, None

    def advance(self, entries: int) -> None:
        """The step :meth:`next_step` planned was drawn."""
        del self.sizes[:self.passes[0] if self.cuts_passes else entries]
        if self.cuts_passes:
            del self.passes[:1]
        self.steps -= 1

    def budget_sizes(self, remaining: int, batch: int, entries: int) -> list[int]:
        """The micro-batch sizes the rest of the epoch counts as for the step budget: the plan's, or, when passes are
        cut here, micro-batches of the per-device size (the steps are the same: a step's passes are its share)."""
        if self.cuts_passes:
            return rank_sizes(remaining, batch, entries)
        return list(self.sizes)

    def state_dict(self) -> dict[str, Any]:
        if self.plan is None:
            return {}
        state = {'plan': self.plan.to_json(), 'plan_sizes': length_policy.run_length(self.sizes),
                 'plan_steps': self.steps}
        if self.passes:
            state['plan_passes'] = length_policy.run_length(self.passes)
        return state

    def load(self, state: Mapping[str, Any], left: int, entries: int) -> None:
        """The saved plan and what it had planned for the ``left`` samples of the epoch still to draw."""
        self.plan = length_policy.BatchPlan.from_json(state['plan']) if state.get('plan') else None
        if self.plan is None:
            self.set([], 0)
            return
        sizes = length_policy.from_run_length(state.get('plan_sizes', []))
        if sum(sizes) != left:
            raise StateError(f'corrupt loader state: planned micro-batches hold {sum(sizes)} samples, but {left} are '
                             'left in the epoch')
        steps = int(state.get('plan_steps', length_policy.steps_for(len(sizes), entries)))
        passes: list[int] = []
        if self.plan.cuts_passes:
            passes = length_policy.from_run_length(state.get('plan_passes', []))
            if sum(passes) != len(sizes) or len(passes) != steps:
                raise StateError(f'corrupt loader state: {len(passes)} steps of {sum(passes)} passes planned, but '
                                 f'{steps} steps and {len(sizes)} passes are left in the epoch')
        self.set(sizes, steps, passes)

"""The interface every training loader of the pack meets: what the integration calls, declared once.

Two loaders implement it: :class:`~.elastic.ElasticDataLoader` (a map-style dataset: exactly-once epochs, length-aware
plans, balanced steps, resume on another number of processes) and :class:`~.stream.StreamLoader` (a stream:
rows in stream order, buckets inside bounded windows). The integration asks a loader what it can do through the
capability flags below instead of probing for attributes; what only a loader with a length offers is
:class:`SizedTrainLoader`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

from ..policies.length import BatchPlan


@dataclass
class BudgetReports:
    """What a loader found over a token budget since the last call (:meth:`TrainLoader.take_reports`).

    Attributes:
        over_estimates: micro-batches whose real padded tokens exceed the plan's budget because the length estimates
            (a lazy dataset) were low: ``{'indices': [...], 'padded': n}`` each.
        rows_over_budget: a stream's rows longer than the budget, read since the last call: ``(index, cost)`` each.
    """

    over_estimates: list[dict[str, Any]] = field(default_factory=list)
    rows_over_budget: list[tuple[int, int]] = field(default_factory=list)


@runtime_checkable
class TrainLoader(Protocol):
    """A training loader whose per-device batch size may change at any optimizer-step boundary.

    Capability flags: ``has_length`` (an epoch has a known size: epoch budgets, coverage, resume on another number of
    processes; a stream has not), ``lengths_estimated`` (the plan's lengths are estimates refined as rows are
    encoded), ``balanced_steps`` (the current epoch is laid out in balanced global steps).
    """

    state_key: str
    has_length: bool
    lengths_estimated: bool
    batch_size: int
    entries_per_step: int
    num_pieces: int
    epoch: int
    position: int
    samples_seen: int
    plan: BatchPlan | None

    # ---- position and progress
    @property
    def epoch_complete(self) -> bool: ...

    @property
    def epoch_progress(self) -> float: ...

    @property
    def epoch_size(self) -> int: ...

    @property
    def balanced_steps(self) -> bool: ...

    @property
    def pass_pieces(self) -> int: ...

    @property
    def cuts_passes(self) -> bool: ...

    @property
    def pass_tokens(self) -> int | None: ...

    def set_pass_budget(self, tokens: int | None) -> bool: ...

    def start_next_epoch(self) -> None: ...

    def skip_to(self, consumed: int) -> None:
        """Resume by HF's arithmetic (a checkpoint without the pack's state): ``consumed`` samples at a constant
        batch size are behind."""

    # ---- drawing and changing
    def next_step(self, entries: int) -> list[tuple[list[int], Any]]: ...

    def set_batch_size(self, batch_size: int) -> None: ...

    def set_entries_per_step(self, entries: int) -> None: ...

    def set_num_pieces(self, num_pieces: int) -> None: ...

    def set_plan(self, plan: BatchPlan) -> bool: ...

    def close(self) -> None: ...

    # ---- what it planned and drew
    @property
    def lengths(self) -> list[int]: ...

    def over_budget(self) -> list[int]: ...

    def planned_padding(self) -> tuple[int, int, int]: ...

    def planned_spread(self) -> dict[str, float]: ...

    def take_token_stats(self) -> tuple[int, int, int]: ...

    def take_spread_stats(self) -> tuple[float, float, int]: ...

    def take_reports(self) -> BudgetReports: ...

    # ---- state
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class SizedTrainLoader(TrainLoader, Protocol):
    """A loader over a dataset with a length (``has_length``): the epoch budget in steps, and the samples left in an
    epoch re-dealt on another number of processes."""

    def steps_to_budget(self, budget_epochs: float) -> int: ...

    def resume_from_rests(self, states: Any, *, rank: int, world: int,
                          batch_size: int | None = None) -> dict[str, Any]: ...


def meets(loader: Any, interface: type = TrainLoader) -> bool:
    """Whether ``loader`` has every member of ``interface``, looked up without running properties (``isinstance`` on
    a protocol evaluates them before Python 3.12)."""
    names = {n for cls in interface.__mro__ if cls not in (object, Protocol, type(Protocol))
             for n in getattr(cls, '__protocol_attrs__', None) or _members(cls)}
    missing = object()
    return all(inspect.getattr_static(loader, name, missing) is not missing for name in names)


def _members(cls: type) -> set[str]:
    own = set(cls.__dict__) | set(getattr(cls, '__annotations__', {}))
    return {n for n in own if not n.startswith('_')}

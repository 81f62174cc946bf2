"""The interface every length mode of ``length_batching`` meets (one mode a module; the registry is :mod:`.`).

A mode is the value of ``length_batching.mode`` and of a :class:`~..length.BatchPlan`'s ``mode``: how many samples
a micro-batch may hold given its longest one, which settings it reads, and the few properties the loaders, the
integration and the settings ask instead of comparing names. Everything else (bucketing, the greedy cut, the cap,
balanced layouts) is shared. Pure: no torch, no files.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol


class Plan(Protocol):
    """What a mode reads of a batch plan (:class:`~..length.BatchPlan`)."""

    max_tokens: int
    rules: tuple[tuple[int, int], ...]
    bucketing: bool
    bucket_width: float
    padding_free: bool


class LengthMode:
    """One length mode (module docstring); stateless, one instance in the registry. Subclasses set ``name`` and
    override what differs."""

    #: its value of ``length_batching.mode``
    name: ClassVar[str] = ''
    #: the ``length_batching`` settings it reads (the settings' ``reads`` table: the others stay at their defaults)
    reads: ClassVar[tuple[str, ...]] = ()
    #: whether micro-batches are sized by the token budget ``max_tokens`` (real tokens when padding-free, else
    #: ``samples x longest``): a sample over it runs alone and is reported
    sizes_by_tokens: ClassVar[bool] = False
    #: whether epochs are laid out in balanced global steps of micro-batches of the per-device size
    #: (:mod:`..balance`): needs bucketing, the whole epoch (no stream) and ``split: micro_batches``; the only
    #: layout ``pass_tokens`` cuts into passes
    balances_steps: ClassVar[bool] = False

    def limit(self, plan: Plan, longest: int) -> int:
        """Most samples of a micro-batch whose longest sample has ``longest`` tokens (at least 1)."""
        raise NotImplementedError

    def sizes(self, plan: Plan) -> str:
        """What bounds a micro-batch, in the ``batch_plan`` record's message (``max 4096 padded tokens``)."""
        raise NotImplementedError

    def describe(self, plan: Plan) -> str:
        """The ``batch_plan`` record's message (without the padding-free note)."""
        bucketing = f'on (width {plan.bucket_width})' if plan.bucketing else 'off'
        return f'{self.name}: {self.sizes(plan)} per micro-batch, bucketing {bucketing}'

    def pass_limit(self, plan: Plan) -> dict[str, Any]:
        """The pass limit ``split: passes`` requests (``{'samples', 'tokens', 'rules'}``, ``protocol``'s form):
        micro-batches keep their size, each pass of one holds what the mode would let a micro-batch hold."""
        raise ValueError(f'length_batching.mode: {self.name} has no pass limit (split: passes)')

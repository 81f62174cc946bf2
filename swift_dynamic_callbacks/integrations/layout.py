"""The batch layout of a run: samples a step = per-device batch × micro-batches a step × processes.

A run resumed on another number of processes (or with another ``gradient_accumulation_steps``) keeps its global batch:
the per-device batch is derived again (:func:`~..policies.data_plan.per_device_batch`). The callbacks keep counting
per-device sizes in the layout the run started with (their tables, growth and LR scaling are in those units), so each
size they request is converted to the current layout here.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..policies.data_plan import per_device_batch


class Layout:
    """The run's reference layout (its first: ``world``, ``entries``, the initial per-device ``batch``) and the
    current one.

    State (under the integration's, key ``layout``): the reference layout, kept across resumes; all ``None`` in a run
    whose batches are its trainer's (GRPO, GKD: no loader of the pack's lays them out).
    """

    def __init__(self) -> None:
        self.world: int | None = None  # the reference layout: processes ...
        self.entries: int | None = None  # ... micro-batches a step ...
        self.batch: int | None = None  # ... and the per-device batch the run started with
        self.current: tuple[int, int] = (1, 1)

    def begin(self, world: int, entries: int, batch: int) -> None:
        """The layout this process trains in; the first one of the run becomes the reference."""
        self.current = (world, entries)
        if self.world is None:
            self.world, self.entries = world, entries
        if self.batch is None:
            self.batch = batch

    @property
    def changed(self) -> bool:
        return self.world is not None and (self.world, self.entries) != self.current

    def per_device(self, size: int) -> tuple[int, bool]:
        """A per-device batch size in reference units as this layout's, with whether it keeps the global batch
        exactly."""
        if not self.changed:
            return size, True
        world, entries = self.current
        return per_device_batch(size * self.world * self.entries, world, entries)

    def state_dict(self) -> dict[str, Any]:
        return {'world': self.world, 'entries': self.entries, 'batch': self.batch}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if state:
            self.world, self.entries, self.batch = (None if state.get(key) is None else int(state[key])
                                                    for key in ('world', 'entries', 'batch'))

"""Memory policies: samples per forward/backward pass, OOM backoff, proactive backoff with hysteresis (pure).

How many pieces a pass runs as under a limit is :func:`~.pass_cost.pieces_within` (the one cost model of a pass).

A *pass limit* caps the samples of one forward/backward pass; a micro-batch larger than the cap runs as
several passes with the same loss normalisation (the same gradient). It is a JSON-able mapping::

    {'samples': int | None, 'tokens': int | None, 'rules': [[longer_than, samples], ...]}

``samples``: at most this many samples a pass; ``tokens``: at most this many padded tokens a pass
(``samples x padded length``); ``rules``: a pass whose padded length is greater than ``longer_than`` takes at
most ``samples`` (the first matching rule, rules sorted by descending ``longer_than``; the seed's
``{1024: 2}`` means "longest > 1024 tokens -> 2 a pass").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping


def pass_cap(length: int, limit: Mapping[str, Any] | None) -> int | None:
    """Most samples one pass of padded length ``length`` may take under ``limit`` (``None``: no cap). Never < 1."""
    if not limit:
        return None
    caps = []
    if limit.get('samples') is not None:
        caps.append(int(limit['samples']))
    if limit.get('tokens') is not None and length > 0:
        caps.append(int(limit['tokens']) // length)
    for longer_than, samples in sorted(limit.get('rules') or (), key=lambda r: -r[0]):
        if length > longer_than:
            caps.append(int(samples))
            break
    return max(1, min(caps)) if caps else None


def oom_backoff(pass_size: int) -> int:
    """The samples-a-pass cap after an OOM in a pass of ``pass_size`` samples: half, at least 1."""
    return max(1, pass_size // 2)


@dataclass(frozen=True)
class PressureState:
    """Proactive backoff state: the current cap (``None``: none), clean steps in a row, the size before backing off,
    and what they count (``samples`` a pass, or ``tokens`` a pass where passes are cut by a token budget)."""

    cap: int | None = None
    clean: int = 0
    unlimited: int | None = None
    unit: str = 'samples'


def pressure_step(state: PressureState, fraction: float, pass_size: int, *, high: float, low: float,
                  clean_steps: int, shrink: float, grow: float, minimum: int) -> tuple[PressureState, str | None]:
    """Fold one step's peak memory fraction in; returns the new state and ``'backoff'``, ``'grow_back'`` or None.

    - ``fraction > high``: cap the pass at ``max(minimum, floor(pass_size * shrink))`` (when that is smaller than
      the pass that just ran and than the cap in force: a backoff never raises it; under a token cap a pass over it
      is a single row, which no cap can cut); the clean count restarts.
    - ``fraction < low`` for ``clean_steps`` steps in a row while capped: raise the cap by ``grow``; once it
      reaches the pass size from before the first backoff, the cap is removed.
    - In between (the hysteresis band ``[low, high]``): hold, and the clean count restarts.
    """
    if fraction > high:
        cap = max(minimum, math.floor(pass_size * shrink))
        if cap >= pass_size:  # already at the minimum
            return replace(state, clean=0), None
        if state.cap is not None and cap >= state.cap:  # a pass over the cap is one row that cannot be cut: hold
            return replace(state, clean=0), None
        unlimited = state.unlimited if state.unlimited is not None else pass_size
        return PressureState(cap=cap, clean=0, unlimited=unlimited, unit=state.unit), 'backoff'
    if fraction >= low or state.cap is None:
        return replace(state, clean=0), None
    clean = state.clean + 1
    if clean < clean_steps:
        return replace(state, clean=clean), None
    cap = max(state.cap + 1, math.ceil(state.cap * grow))
    if state.unlimited is not None and cap >= state.unlimited:
        return PressureState(unit=state.unit), 'grow_back'
    return PressureState(cap=cap, clean=0, unlimited=state.unlimited, unit=state.unit), 'grow_back'

"""The length modes of ``length_batching`` (``mode``), one a module (:mod:`.base` says what each meets).

Adding a mode: a module with a :class:`~.base.LengthMode` subclass and its line in :data:`LENGTH_MODES`; the
settings (``config/length_batching.py``: the choices of ``mode``, the ``reads`` table) follow from the registry.
"""

from __future__ import annotations

from .balanced import BalancedMode
from .base import LengthMode, Plan
from .rules import RulesMode
from .token_budget import TokenBudgetMode

#: the modes by name, in the order the settings list them
LENGTH_MODES: dict[str, LengthMode] = {m.name: m for m in (TokenBudgetMode(), RulesMode(), BalancedMode())}

__all__ = ['LENGTH_MODES', 'LengthMode', 'Plan']

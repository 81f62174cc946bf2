"""The one owner of what a forward/backward pass may hold: every cap on a pass, the effective limit computed once.

What a pass may hold comes from four places, all held here:

- the **requested limit** (``control.new_pass_limit``: ``memory_backoff``'s cap, its length rules and token budget);
- the **plan's ceiling**: passes cut by a token budget (``length_batching.pass_tokens``) are planned at it;
- the **OOM budget** (:class:`~..policies.pass_cost.BudgetState`): lowered after an OOM, grown back after clean steps,
  settled below a real memory end and probed above it after a quiet period. Its unit follows what memory follows:
  tokens where passes are cut by tokens, else rows;
- **this step's caps**: the cap after an OOM inside the step (until its end) and the token budget a micro-batch must
  hold to while its lengths are estimates.

:meth:`PassBudget.limit` is the limit a pass is cut at (the step runner asks it before each batch), :meth:`plan_tokens`
the token budget the loader plans passes at (the coordinator hands it over at every boundary). An OOM walks forward
only: the runner reports it (:meth:`after_oom`: this step's cap), the coordinator exchanges every rank's OOM records at
the next boundary (or at a checkpoint, whichever comes first) and :meth:`fold` folds them, once per step, into the OOM
budget, the same on every rank.

State (saved with the integration's): the requested limit, the OOM budget and its unit, the last step folded.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import asdict, replace
from typing import Any, Iterable, Mapping

from ..policies.pass_cost import BudgetState, budget_after_oom, budget_after_step
from ..records import DecisionRecord

logger = logging.getLogger('swift_dynamic_callbacks')

UNITS = ('samples', 'tokens')


def _least(*values: int | None) -> int | None:
    present = [int(v) for v in values if v is not None]
    return min(present) if present else None


class PassBudget:
    """What a pass may hold (see the module docstring).

    Args:
        grow_after: clean steps before the OOM budget grows (``integration.oom_grow_back_steps``; 0: never).
        probe_after: settled clean steps before the OOM budget probes above a failure
            (``integration.oom_probe_steps``; x4 after each failed probe; 0: never).
    """

    def __init__(self, grow_after: int = 2, probe_after: int = 64) -> None:
        self.grow_after = grow_after
        self.probe_after = probe_after
        self.requested: dict[str, Any] | None = None  # the requested pass limit (samples / tokens / rules)
        self.unit = 'samples'  # what the OOM budget counts: 'tokens' where passes are cut by tokens
        self.ceiling: int | None = None  # the plan's pass_tokens (tokens), or the rows of a micro-batch (samples)
        self.oom = BudgetState()
        self.folded = -1  # the last step whose outcome was folded in (a checkpoint folds its step early)
        self.step_cap: int | None = None  # this step's cap after an OOM in it (the unit's)
        self.estimate: int | None = None  # this step's token budget while lengths are estimates
        self.fitted = 0  # the largest pass (the unit's) that ran clean in this step on this rank

    # ---- what the run is cut by (each boundary) --------------------------------------------------------------
    def configure(self, *, tokens_ceiling: int | None, rows: int) -> None:
        """At a boundary: passes are cut by a token budget ``tokens_ceiling`` (the plan's ``pass_tokens``) or not
        (``None``: the OOM budget counts rows, at most ``rows``, a micro-batch's). A change of unit starts the OOM
        budget afresh (a budget in rows says nothing about tokens)."""
        unit = 'tokens' if tokens_ceiling is not None else 'samples'
        if unit != self.unit:
            self.oom = BudgetState()
        self.unit = unit
        self.ceiling = tokens_ceiling if tokens_ceiling is not None else max(1, int(rows))

    def start_step(self, estimate: int | None) -> None:
        """A new step: no OOM cap yet; ``estimate``: the token budget while lengths are estimates."""
        self.step_cap, self.estimate, self.fitted = None, estimate, 0

    def set_requested(self, limit: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The requested pass limit (all caps empty: none); returns the old one."""
        old = self.requested
        self.requested = None if not limit or all(not v for v in limit.values()) else dict(limit)
        return old

    # ---- the limit, computed here only --------------------------------------------------------------------------
    @property
    def budget(self) -> int | None:
        """The OOM budget now (``None``: not lowered), in :attr:`unit`."""
        return self.oom.budget

    def limit(self, *, estimates_split: bool = False) -> dict[str, Any] | None:
        """The limit a pass is cut at now: ``{'samples', 'tokens', 'rules'}`` (``None``: no limit). ``estimates_split``:
        a micro-batch may run as several passes, so the estimate's token budget applies too."""
        req = self.requested or {}
        oom_tokens = self.unit == 'tokens'
        samples = _least(req.get('samples'), None if oom_tokens else self.oom.budget,
                         None if oom_tokens else self.step_cap)
        tokens = _least(req.get('tokens'), self.oom.budget if oom_tokens else None,
                        self.step_cap if oom_tokens else None, self.estimate if estimates_split else None)
        rules = list(req.get('rules') or [])
        if samples is None and tokens is None and not rules:
            return None
        return {'samples': samples, 'tokens': tokens, 'rules': rules}

    def plan_tokens(self) -> int | None:
        """The token budget the loader plans passes at below the plan's own (``None``: the plan's): the OOM budget and
        a requested token cap, where passes are cut by tokens."""
        if self.unit != 'tokens':
            return None
        return _least(self.oom.budget, (self.requested or {}).get('tokens'))

    # ---- out of memory ---------------------------------------------------------------------------------------
    def _measure(self, size: int, cost: int) -> int:
        """A pass of ``size`` rows costing ``cost`` tokens, in the budget's unit."""
        return cost if self.unit == 'tokens' else size

    def ran(self, size: int, cost: int) -> None:
        """A pass of ``size`` rows and ``cost`` tokens ran (its backward included) on this rank."""
        self.fitted = max(self.fitted, self._measure(size, cost))

    def after_oom(self, size: int, cost: int) -> int | None:
        """An OOM in a pass of ``size`` rows costing ``cost`` tokens, inside the step: the cap for the rest of the
        step, in the unit: the largest pass known to run clean below the failing one (this step's, or the OOM
        budget's since the first OOM: a probe that failed goes back to where passes ran), else half the failing pass;
        ``None`` for a one-row pass (it cannot be cut: it is run again as it is)."""
        if size <= 1:
            return None
        failed = self._measure(size, cost)
        known = [g for g in (self.fitted, self.oom.good) if g and g < failed]
        cap = max([max(1, failed // 2)] + known)
        self.step_cap = cap if self.step_cap is None else min(self.step_cap, cap)
        return self.step_cap

    def resume_budget(self, size: int, cost: int) -> int | None:
        """What a run resumed after an OOM that ended this one, in a pass of ``size`` rows costing ``cost`` tokens,
        plans within: :meth:`fold`'s policy on this run's budget now. ``None``: a one-row pass, which the fold does not
        cut (nothing is lowered), or no plan yet."""
        if size <= 1 or self.ceiling is None:
            return None
        return budget_after_oom(self.oom, self._measure(size, cost), self.ceiling, fitted=self.fitted).budget

    def fold(self, ooms: Iterable[DecisionRecord], step: int, *, fitted: int = 0,
             headroom: bool | None = None, again: bool = False) -> DecisionRecord | None:
        """Fold the outcome of step ``step`` into the OOM budget, once (a checkpoint may fold its step before the
        boundary does). ``ooms``: every rank's OOM records of it; a one-row pass's OOM is not folded in (it cannot
        be cut; recorded only). ``fitted``: the largest pass that ran clean in it over all ranks. ``again``: fold
        OOMs of a step already folded (an OOM that ended a run after its last checkpoint, folded on resume). Returns
        a ``pass_budget`` record when the budget changed."""
        if (step <= self.folded and not again) or self.ceiling is None:
            return None
        self.folded = step
        key = 'pass_tokens' if self.unit == 'tokens' else 'pass_size'
        failed = [int(r.values[key]) for r in ooms if r.values.get(key) and int(r.values.get('pass_size') or 0) > 1]
        clean = [int(r.values.get('fitted') or 0) for r in ooms]
        old = self.oom
        ceiling = self.ceiling
        if failed:
            self.oom = budget_after_oom(old, min(failed), ceiling, fitted=max(clean + [fitted]))
            action = 'probe_failed' if old.probing else 'oom'
        elif ooms and old.budget is None:
            return None  # only one-row OOMs, nothing lowered: nothing to fold
        else:
            self.oom = budget_after_step(old, ceiling, fitted=fitted, grow_after=self.grow_after,
                                         probe_after=self.probe_after, headroom=headroom)
            action = 'probe' if self.oom.probing and not old.probing else 'grow_back'
        if self.oom.budget == old.budget:
            return None
        unit = 'tokens' if self.unit == 'tokens' else 'rows'
        new = self.oom.budget if self.oom.budget is not None else ceiling
        values = {'unit': self.unit, 'old': old.budget if old.budget is not None else ceiling, 'new': new,
                  'ceiling': ceiling, 'failed': min(failed) if failed else None, 'good': self.oom.good,
                  'bad': self.oom.bad, 'probes': self.oom.probes}
        if action == 'oom':
            message = f'out of memory in a pass of {min(failed)} {unit}: passes within {new} {unit} from this step on'
        elif action == 'probe_failed':
            message = (f'the probe above {old.bad} {unit} ran out of memory: back to {new} {unit}; the next probe '
                       f'waits {self.probe_after * 4 ** self.oom.probes} settled steps')
        elif action == 'probe':
            message = (f'{self.probe_after * 4 ** old.probes} quiet steps at {old.budget} {unit}: probing {new} '
                       f'{unit}, one step above the smallest failed pass ({old.bad})')
        else:
            message = (f'{self.grow_after} clean steps: passes within {new} {unit}' +
                       (' (no cap: the ceiling)' if self.oom.budget is None else
                        f' (toward the smallest failed pass, {self.oom.bad})' if self.oom.bad else ''))
        return DecisionRecord('integration', 'pass_budget', action, values, message, step=step)

    # ---- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {'requested': self.requested, 'unit': self.unit, 'oom': asdict(self.oom), 'folded': self.folded}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        state = dict(state or {})
        if 'oom' not in state and 'budget' in state:  # a checkpoint of 0.1 (the token budget alone)
            state = {'unit': 'tokens', 'oom': {k: state[k] for k in ('budget', 'good', 'bad', 'clean') if k in state}}
        self.requested = state.get('requested')
        self.unit = state.get('unit', 'samples')
        self.oom = replace(BudgetState(), **(state.get('oom') or {}))
        self.folded = int(state.get('folded', -1))


#: the note an OOM that ended a run leaves in the output folder, one a rank (written by the runner, read on resume)
OOM_NOTE = 'dynamic_oom.rank{rank}.json'


def oom_note_name(rank: int) -> str:
    """The file name of rank ``rank``'s OOM note (:data:`OOM_NOTE`)."""
    return OOM_NOTE.format(rank=rank)


def write_oom_note(output_dir: str, note: Mapping[str, Any]) -> None:
    """Leave ``note`` (``step``, ``rank``, ``pass_size``, ``pass_tokens``, ``unit``, ``fitted``, ``engine``,
    ``error``, ``time``) in ``output_dir`` for :func:`oom_notes` of a resumed run."""
    with open(os.path.join(output_dir, oom_note_name(int(note['rank']))), 'w', encoding='utf-8') as f:
        json.dump(dict(note), f)


def oom_notes(output_dir: str, after_step: int) -> list[DecisionRecord]:
    """The OOMs that ended a run (under an engine without OOM recovery) after step ``after_step``: every rank's note
    ``dynamic_oom.rank<R>.json`` in ``output_dir``, as ``oom`` records (reason ``unrecovered``) to fold into the pass
    budget of a run resumed from that step's checkpoint. Read by every rank (the same notes: the same budget)."""
    records = []
    for path in sorted(glob.glob(os.path.join(output_dir, OOM_NOTE.format(rank='*')))):
        try:
            with open(path, encoding='utf-8') as f:
                note = json.load(f)
        except (OSError, ValueError) as e:  # a rank ended while writing it: said, and planned without it
            logger.warning(f'the OOM note {path} cannot be read ({e}); this run plans its passes without it')
            continue
        if int(note.get('step', -1)) < after_step:
            continue
        values = {k: note.get(k) for k in ('rank', 'pass_size', 'pass_tokens', 'unit', 'fitted', 'engine', 'error')}
        records.append(DecisionRecord(
            'integration', 'oom', 'unrecovered', values,
            f'rank {note.get("rank")} ran out of memory at step {int(note["step"]) + 1} in a pass of '
            f'{note.get("pass_size")} rows ({note.get("pass_tokens")} tokens) and the run ended (no OOM recovery under '
            f'{note.get("engine")}); read by this resumed run (its pass_budget record says what it plans at)',
            step=int(note['step']) + 1))  # the step it ran in (as a recovered OOM's record)
    return records

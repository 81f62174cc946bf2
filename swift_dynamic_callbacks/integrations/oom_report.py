"""What the step runner says about an out-of-memory error: the messages, the OOM note and the ``oom`` record.

Pure builders, apart from the runner that meets the error (:class:`~.steps.StepRunner`): it gathers the facts of the
failing pass (:class:`PassOom`) and the budget, these functions turn them into what the user reads and what the
integration records. Three outcomes, one builder each:

- recovered (:func:`recovered`): the step ran again in smaller passes; an :class:`~..protocol.OomEvent` for the
  callbacks and the ``oom`` decision record (held until the step boundary, where every rank's are exchanged);
- not recovered, recovery off here (:func:`unrecovered_message`, :func:`unrecovered_note`): which pass, the budget, the
  setting to lower, and the note a resumed run folds into its pass budget;
- one sample that cannot fit (:func:`too_large_message`): the run stops; the sample is never skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .. import protocol
from ..records import DecisionRecord
from .loss_kind import LossKind
from .pass_budget import oom_note_name


@dataclass(frozen=True)
class PassOom:
    """The facts of one OOM in a pass.

    Attributes:
        rank: the rank it happened on.
        step: ``state.global_step`` when it happened (the step being run is ``step + 1``).
        pass_size: rows of the failing pass (0: outside any pass).
        pass_tokens: the failing pass's cost in tokens (``None``: outside any pass).
        unit: what the pass budget counts, ``tokens`` (``pass_tokens``) or ``samples``.
        fitted: the largest pass (the unit's) that ran clean in this step on this rank.
        memory: the device's figures after freeing memory (:func:`~..device_memory.device_figures`).
    """

    rank: int
    step: int
    pass_size: int
    pass_tokens: int | None
    unit: str
    fitted: int
    memory: Mapping[str, Any]

    @property
    def tokens(self) -> bool:
        return self.unit == 'tokens'


def recovered(oom: PassOom, *, new_cap: int | None, retries: int, single_sample_retries: int, oom_count: int,
              loss: LossKind) -> tuple[protocol.OomEvent, DecisionRecord]:
    """An OOM the runner recovered from: the event set on the control and the ``oom`` record. ``new_cap``: the rows
    (or tokens, under ``pass_tokens``) a pass may hold for the rest of the step; ``None`` when the pass ran again as
    it was (one row, or outside a pass)."""
    tokens = oom.tokens
    event = protocol.OomEvent(oom.pass_size, None if tokens else new_cap, retries, dict(oom.memory),
                              pass_tokens=oom.pass_tokens, new_tokens=new_cap if tokens else None)
    if new_cap is not None:
        how = (f'passes of at most {new_cap} tokens (rows not capped)' if tokens else f'at most {new_cap} rows a '
               'pass') + ' for the rest of the step'
    elif oom.pass_size == 0:
        how = 'the same micro-batch after freeing memory (the OOM was outside a pass)'
    else:
        how = 'the same one-row pass after freeing memory (one row cannot be cut)'
    weighted = (f': each piece weighted by its share of the {loss.kind.split("_")[0]}s, {loss.setting})'
                if loss.kind in ('token_mean', 'row_mean') else ')')
    record = DecisionRecord(
        'integration', 'oom', 'recovered', {
            'rank': oom.rank,
            'pass_size': oom.pass_size,
            'pass_tokens': oom.pass_tokens,
            'unit': oom.unit,
            'new_pass_cap': None if tokens else new_cap,
            'new_pass_tokens': new_cap if tokens else None,
            'fitted': oom.fitted,
            'retries': retries,
            'single_sample_retries': single_sample_retries,
            'oom_count': oom_count,
            'loss': loss.kind,
            **{f'memory_{k}': v for k, v in oom.memory.items()}
        }, f'out of memory in a pass of {oom.pass_size} rows ({oom.pass_tokens} tokens): the step was run again with '
        f'{how} (same samples, same gradient' + weighted, step=oom.step + 1)  # the step it ran in: its boundary's
    return event, record


def fewer_rows(rows: int, accumulation: int) -> tuple[int, int]:
    """Micro-batches of at most half of ``rows`` that keep the global batch: ``(rows a micro-batch,
    gradient_accumulation_steps)``, ``rows`` cut by its smallest divisor above 1 (3 rows x GA 2 -> 1 x 6)."""
    k = next(d for d in range(2, max(rows, 2) + 1) if rows % d == 0)
    return rows // k, accumulation * k


def fewer_rows_advice(rows: int, accumulation: int) -> str:
    """What to set so that a run whose micro-batches cannot be cut into passes runs micro-batches half as large (or
    smaller) at the same global batch (:func:`fewer_rows`)."""
    smaller, steps = fewer_rows(rows, accumulation)
    return (f'gradient_accumulation_steps: {steps} (now {accumulation}) keeps the global batch in micro-batches of '
            f'{smaller} row(s) instead of {rows} (a resumed run derives them from the global batch; a new run also '
            f'sets per_device_train_batch_size: {smaller})')


def unrecovered_message(oom: PassOom, *, engine: str, why_off: str, budget: int | None, ceiling: int | None,
                        resume: int | None, cannot_split: str | None = None, accumulation: int = 1) -> str:
    """An OOM where recovery is off (``why_off``: the engine's or the setting's reason): which pass, the budget it
    ran under (``budget``, else the plan's ``ceiling``), the setting to lower and the budget a resumed run plans
    within (``resume``, :meth:`~.pass_budget.PassBudget.resume_budget`; ``None``: a one-row pass, nothing to cut).
    ``cannot_split``: why this run may not cut a micro-batch into passes (:meth:`~.steps.StepRunner.split_refusal`):
    a resumed run plans at the same micro-batches, so the advice is smaller micro-batches at the same global batch
    (``accumulation``: ``gradient_accumulation_steps`` now)."""
    lower = ('length_batching.pass_tokens' if oom.tokens else
             'per_device_train_batch_size, batch_growth.maximum or batch_growth.micro_batch_cap')
    of = f'pass_tokens {ceiling}' if oom.tokens else 'the micro-batch'
    cost = oom.pass_tokens or 0
    if oom.pass_size <= 1:
        after = ('One row cannot be cut into passes, so a resumed run would meet it again: lower max_length '
                 '(or truncation_strategy) or free memory. ')
    elif cannot_split is not None:
        after = (f'This run cannot cut a micro-batch into smaller passes ({cannot_split}), so a run resumed as it is '
                 f'runs the same micro-batches: set {fewer_rows_advice(oom.pass_size, accumulation)} and resume '
                 'from the last checkpoint, or free memory. ')
    elif resume is not None:
        after = (f'Lower {lower}, or resume from the last checkpoint: the resumed run plans its passes within {resume} '
                 f'{oom.unit} from its first step (the note {oom_note_name(oom.rank)} in the output folder). ')
    else:
        after = f'Lower {lower} and resume from the last checkpoint. '
    return (f'out of memory on rank {oom.rank} in a pass of {oom.pass_size} rows ({cost} tokens) at step '
            f'{oom.step + 1}, under {engine} where OOM recovery is off ({why_off}); the pass budget was '
            f'{budget or ceiling} {oom.unit} ({of}). {after}Memory: {dict(oom.memory)}')


def unrecovered_note(oom: PassOom, *, engine: str, error: BaseException, time: float) -> dict[str, Any]:
    """The note an unrecovered OOM leaves in the output folder (:func:`~.pass_budget.write_oom_note`); ``time``: when
    it happened (seconds since the epoch)."""
    return {'step': oom.step, 'rank': oom.rank, 'pass_size': oom.pass_size, 'pass_tokens': oom.pass_tokens or 0,
            'unit': oom.unit, 'fitted': oom.fitted, 'engine': engine, 'error': str(error)[:300], 'time': time}


def too_large_message(*, sample: int | None, tokens: int | None, padded: int | None, halvings: int, retries: int,
                      setting_retries: int, memory: Mapping[str, Any]) -> str:
    """One sample that ran out of memory alone after ``halvings`` of its pass and ``retries`` of it
    (``setting_retries``: ``integration.oom_single_sample_retries``): what it is and what to change."""
    return (f'out of memory on a single sample (dataset index {sample}, {tokens} tokens, padded to {padded}) after '
            f'{halvings} halvings of the pass and {retries} retries of the one-sample pass (memory freed before '
            f'each; integration.oom_single_sample_retries: {setting_retries}); memory: {dict(memory)}. It cannot '
            'fit: shorten it (max_length / truncation_strategy), use a smaller model, gradient checkpointing, or more '
            'memory. It was not skipped: skipping would silently lose data.')

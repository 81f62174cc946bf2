"""HF's micro-batch slots: ``gradient_accumulation_steps`` of them a step, whatever the pack runs in them.

HF's loop calls ``training_step`` once per slot and counts slots to know when the optimizer steps, so a step always
has that many. A slot holds one collated micro-batch, nothing (:class:`EmptyMicroBatch`: the short last step of an
epoch, or a step cut into fewer passes than slots) or several passes (:class:`PassGroup`: a step cut into more passes
than slots by ``pass_tokens``).
"""

from __future__ import annotations

from typing import Any, Sequence


class EmptyMicroBatch(dict):
    """Placeholder for a micro-batch with no sample (the short last step of an epoch, or a slot a step cut into
    fewer passes than ``gradient_accumulation_steps`` leaves empty), or a padding pass in a :class:`PassGroup` (a rank
    with fewer passes in a step than another, under an engine whose every pass communicates): nothing of the data
    runs for it (the engine runs a zero-weight pass where its collectives need one)."""


class PassGroup(dict):
    """One of HF's micro-batch slots holding several passes (a step cut into more passes than
    ``gradient_accumulation_steps`` by ``pass_tokens``): ``passes`` are collated micro-batches, run one after
    another with the same loss normalisation. Empty as a mapping, so HF's per-micro-batch token and FLOP counters
    see no ``input_ids`` (the pack counts its own tokens)."""

    def __init__(self, passes: Sequence[Any]) -> None:
        super().__init__()
        self.passes = list(passes)


def slot_batches(slot: Any) -> list[Any]:
    """The collated batches of data one micro-batch slot runs: a :class:`PassGroup`'s passes (its padding passes
    left out), none for an :class:`EmptyMicroBatch`, else the slot itself."""
    if isinstance(slot, PassGroup):
        return [p for p in slot.passes if not isinstance(p, EmptyMicroBatch)]
    return [] if isinstance(slot, EmptyMicroBatch) else [slot]


def group_passes(passes: list[tuple[list[int], Any]], slots: Sequence[int]) -> list[tuple[list[int], Any]]:
    """A step's passes ``(indices, batch)`` in HF's micro-batch slots, ``slots[k]`` passes in slot ``k``: an empty
    slot is ``([], EmptyMicroBatch())``, one pass is itself, several are ``(their indices, PassGroup)``."""
    out, start = [], 0
    for count in slots:
        chunk = passes[start:start + count]
        start += count
        if not chunk:
            out.append(([], EmptyMicroBatch()))
        elif len(chunk) == 1:
            out.append(chunk[0])
        else:
            out.append(([i for indices, _ in chunk for i in indices], PassGroup([batch for _, batch in chunk])))
    if start != len(passes):
        raise AssertionError(f'group_passes: {len(passes)} passes, slots {list(slots)}')  # a bug, never user input
    return out

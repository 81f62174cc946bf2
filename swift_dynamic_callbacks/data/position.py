"""Where this rank is in the data: its shard of the current epoch (the samples, in training order) and how many of
them were used; the re-deal record of an epoch whose rest was dealt again; and the rests every rank saved, checked
(:func:`saved_rests`) before a resume deals them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import StateError
from ..state import pack_indices, unpack_indices


class ShardPosition:
    """This rank's shard of the current epoch and the samples of it consumed.

    Args:
        order: this rank's shard of epoch 0, in training order.
        span: samples of the largest rank's shard (agreed once by the loader): steps are counted on it, so every rank
            ends an epoch at the same optimizer step.

    State: ``epoch``, ``position`` (samples of ``order`` consumed), ``samples_seen`` (this rank, all epochs),
    ``padding`` (samples this rank's shorter shard lacked in its last step, without a plan), ``redealt`` (the current
    epoch's rest was dealt again: ``consumed`` samples of the epoch before it, all ranks; ``dealt``; ``world``).
    """

    def __init__(self, order: list[int], span: int) -> None:
        self.order = order
        self.epoch = 0
        self.position = 0
        self.samples_seen = 0
        self.padding = 0
        self.span = span
        self.full_span, self.full_len = span, len(order)  # of an epoch that was not re-dealt
        self.redealt: dict[str, int] | None = None

    @property
    def remaining(self) -> int:
        return len(self.order) - self.position

    @property
    def rest(self) -> list[int]:
        """The samples of the shard not used yet, in order."""
        return self.order[self.position:]

    def upcoming(self, size: int) -> list[int]:
        """The next ``size`` samples of the shard (not consumed)."""
        return self.order[self.position:self.position + size]

    def advance(self, size: int) -> None:
        """``size`` samples were drawn."""
        self.position += size
        self.samples_seen += size

    def pad(self, step_samples: int, drawn: int) -> None:
        """A step without a plan is about to draw ``drawn`` samples where the largest shard takes ``step_samples``
        (called before the draw): count what this shard lacks (at most one sample, under data parallelism)."""
        self.padding += min(self.span - self.position - self.padding, step_samples) - drawn

    def used_up(self, planned: bool) -> bool:
        """Whether the shard is used up (without a plan: also the largest rank's, counting the padding)."""
        if planned:
            return self.position >= len(self.order)
        return self.position >= len(self.order) and self.position + self.padding >= self.span

    def coverage(self, planned: bool, complete: bool, dataset_size: int) -> float:
        """The fraction of the current epoch's data used (a re-dealt epoch counts what was used before it)."""
        if not planned:
            done = (self.position + self.padding) / self.span if self.span else 1.0
        elif complete or not self.order:
            done = 1.0
        else:
            done = min(self.position / len(self.order), 1.0 - 1e-6)  # not done while steps are left
        if self.redealt is None:
            return done
        covered = (self.redealt['consumed'] + done * self.redealt['dealt']) / max(dataset_size, 1)
        return covered if done >= 1.0 else min(covered, 1.0 - 1e-6)

    def start_epoch(self, epoch: int, order: list[int]) -> None:
        """Epoch ``epoch`` starts with the shard ``order``."""
        self.epoch, self.order = epoch, order
        self.position = self.padding = 0
        self.span, self.redealt = self.full_span, None

    def take_share(self, share: list[int], *, consumed: int, dealt: int, world: int) -> None:
        """The rest of the epoch is ``share``: this rank's part of the ``dealt`` samples re-dealt over ``world``
        processes after ``consumed`` samples of the epoch were used."""
        self.order, self.position, self.padding = share, 0, 0
        self.redealt = {'consumed': consumed, 'dealt': dealt, 'world': world}
        self.span = -(-dealt // world)

    def skip_to(self, epoch_position: int, consumed: int) -> None:
        """Resume by HF's arithmetic: ``epoch_position`` samples into the current epoch, ``consumed`` in all."""
        self.position, self.samples_seen = epoch_position, consumed

    def state_dict(self) -> dict[str, Any]:
        state = {'epoch': self.epoch, 'position': self.position, 'samples_seen': self.samples_seen,
                 'epoch_size': len(self.order), 'rest': pack_indices(self.rest)}
        if self.padding:
            state['padding'] = self.padding
        if self.redealt is not None:
            state['redealt'] = dict(self.redealt)
        return state

    def load(self, state: Mapping[str, Any], order: list[int]) -> None:
        """Continue the saved position in the shard ``order`` (the saved epoch laid out again)."""
        position = int(state['position'])
        if int(state.get('epoch_size', len(order))) != len(order):
            raise StateError(f'the checkpoint was written for an epoch of {state["epoch_size"]} samples on this rank, '
                             f'but the training dataset now gives {len(order)}; resume with the same dataset')
        if not 0 <= position <= len(order):
            raise StateError(f'corrupt loader state: position {position} outside the epoch of {len(order)} samples')
        self.epoch, self.order, self.position = int(state['epoch']), order, position
        self.samples_seen = int(state.get('samples_seen', 0))
        self.padding = int(state.get('padding', 0))
        self.span, self.redealt = self.full_span, None  # a saved epoch that was re-dealt resumes by saved_rests


@dataclass(frozen=True)
class SavedRests:
    """The samples every saved rank left in an epoch (:func:`saved_rests`)."""

    epoch: int
    rests: list[list[int]]
    consumed: int  # samples of the epoch used before the save, all ranks (and before an earlier re-deal)

    @property
    def left(self) -> int:
        return sum(len(r) for r in self.rests)


def saved_rests(states: Sequence[Mapping[str, Any]], dataset_size: int) -> SavedRests:
    """Read and check the rests of every saved rank's loader state.

    Raises:
        StateError: a state without its rest (written before elastic resume), ranks in different epochs, rests that are
            not distinct indices of the dataset, or a dataset of another size.
    """
    first = states[0]
    epoch = int(first['epoch'])
    if any('rest' not in s for s in states):
        raise StateError('the checkpoint\'s loader state has no list of the samples left in the epoch (written by '
                         'a version before elastic resume): resume it with the number of processes that wrote it')
    if any(int(s['epoch']) != epoch for s in states):
        raise StateError(f'corrupt loader state: the ranks were in different epochs {[s["epoch"] for s in states]}')
    rests = [unpack_indices(s['rest']) for s in states]
    left = sum(len(r) for r in rests)
    consumed = int((first.get('redealt') or {}).get('consumed', 0)) + sum(int(s['position']) for s in states)
    if any(i < 0 or i >= dataset_size for r in rests for i in r) or len({i for r in rests for i in r}) != left:
        raise StateError(f'corrupt loader state: the samples left in epoch {epoch} are not distinct indices of the '
                         f'{dataset_size}-sample dataset')
    if consumed + left != dataset_size:
        raise StateError(f'the checkpoint was written for a dataset of {consumed + left} samples (consumed '
                         f'{consumed} + left {left} in epoch {epoch}), the training dataset now has {dataset_size}; '
                         'resume with the same dataset')
    return SavedRests(epoch, rests, consumed)

"""The elastic loader's state in checkpoints: save, restore on the same processes, and resume on another number.

A mixin of :class:`~.loader.ElasticDataLoader` (it reads and sets the loader's position, order and plan). The state
keeps, besides the position, each rank's samples left in the epoch (``rest``): what a resume on another number of
processes re-deals (:meth:`LoaderState.resume_from_rests`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .errors import StateError
from .policies import length as length_policy
from .policies.data_plan import redeal
from .state import pack_indices, unpack_indices


class LoaderState:
    """``state_dict`` / ``load_state_dict`` / ``resume_from_rests`` of the elastic loader (see its docstring for the
    state's keys)."""

    def state_dict(self) -> dict[str, Any]:
        state = {
            'epoch': self.epoch,
            'position': self.position,
            'batch_size': self.batch_size,
            'num_pieces': self.num_pieces,
            'entries_per_step': self.entries_per_step,
            'samples_seen': self.samples_seen,
            'epoch_size': len(self._order),
            'rest': pack_indices(self._order[self.position:]),
        }
        if self._padding:
            state['padding'] = self._padding
        if self.redealt is not None:
            state['redealt'] = dict(self.redealt)
        if self.plan is not None:
            state['plan'] = self.plan.to_json()
            state['order_plan'] = self._order_plan.to_json() if self._order_plan is not None else None
            state['plan_sizes'] = length_policy.run_length(self._sizes)
            state['plan_steps'] = self._plan_steps
            if self._passes:
                state['plan_passes'] = length_policy.run_length(self._passes)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get('redealt'):  # the epoch's order came from a re-deal: only the saved rest tells it
            self.resume_from_rests([state], rank=0, world=1)
            return
        epoch, position = int(state['epoch']), int(state['position'])
        plan = length_policy.BatchPlan.from_json(state['plan']) if state.get('plan') else None
        order_plan = length_policy.BatchPlan.from_json(state['order_plan']) if state.get('order_plan') else None
        # balanced steps lay an epoch out for the batch it ran at (a change inside an epoch re-deals it)
        self.batch_size = int(state['batch_size'])
        self.entries_per_step = int(state.get('entries_per_step', self.entries_per_step))
        order, chunks = self._layout(epoch, order_plan, keep=True)
        if int(state.get('epoch_size', len(order))) != len(order):
            raise StateError(f'the checkpoint was written for an epoch of {state["epoch_size"]} samples on this rank, '
                             f'but the training dataset now gives {len(order)}; resume with the same dataset')
        if not 0 <= position <= len(order):
            raise StateError(f'corrupt loader state: position {position} outside the epoch of {len(order)} samples')
        sizes = length_policy.from_run_length(state.get('plan_sizes', [])) if plan is not None else []
        if plan is not None and sum(sizes) != len(order) - position:
            raise StateError(f'corrupt loader state: planned micro-batches hold {sum(sizes)} samples, but '
                             f'{len(order) - position} are left in the epoch')
        self.epoch, self._order, self.position = epoch, order, position
        self.plan, self._order_plan, self._chunks, self._sizes = plan, order_plan, chunks, sizes
        self._plan_steps = int(state.get('plan_steps', length_policy.steps_for(len(sizes), self.entries_per_step)))
        self._passes = self._saved_passes(state, sizes)
        self._needs_epoch_seed = True
        self.num_pieces = int(state.get('num_pieces', 1))
        self.samples_seen = int(state.get('samples_seen', 0))
        self._padding = int(state.get('padding', 0))
        self._restart()

    def _saved_passes(self, state: Mapping[str, Any], sizes: Sequence[int]) -> list[int]:
        """The passes of each step left in the epoch, as saved (a plan that cuts passes; else none)."""
        if self.plan is None or not self.plan.cuts_passes:
            return []
        passes = length_policy.from_run_length(state.get('plan_passes', []))
        if sum(passes) != len(sizes) or len(passes) != self._plan_steps:
            raise StateError(f'corrupt loader state: {len(passes)} steps of {sum(passes)} passes planned, but '
                             f'{self._plan_steps} steps and {len(sizes)} passes are left in the epoch')
        return passes

    def _take_share(self, share: list[int], *, consumed: int, dealt: int, world: int) -> None:
        """The rest of the epoch is ``share``: this rank's part of the ``dealt`` samples re-dealt over ``world``
        processes after ``consumed`` samples of the epoch were used (a resume elsewhere, or balanced steps laid out
        again)."""
        self._order, self.position, self._padding = share, 0, 0
        self.redealt = {'consumed': consumed, 'dealt': dealt, 'world': world}
        self._span = -(-dealt // world)

    def resume_from_rests(self, states: Sequence[Mapping[str, Any]], *, rank: int, world: int,
                          batch_size: int | None = None) -> dict[str, Any]:
        """Resume as rank ``rank`` of ``world`` from the loader states of every rank of the saved run.

        On another number of processes the samples the saved ranks left in the epoch are re-dealt
        (:func:`~.policies.data_plan.redeal`), laid out by the epoch's bucketing again and planned again at
        ``batch_size`` (default: the saved one). On the same number (an epoch that was re-dealt before, whose order
        only the saved rests tell) each rank continues with its own rest and its planned micro-batches. Returns what
        was dealt (for the decision record).

        Raises:
            StateError: a state without its rest (written before elastic resume), or one that does not fit the dataset.
        """
        first, same_world = states[0], len(states) == world
        epoch = int(first['epoch'])
        if any('rest' not in s for s in states):
            raise StateError('the checkpoint\'s loader state has no list of the samples left in the epoch (written by '
                             'a version before elastic resume): resume it with the number of processes that wrote it')
        if any(int(s['epoch']) != epoch for s in states):
            raise StateError(f'corrupt loader state: the ranks were in different epochs {[s["epoch"] for s in states]}')
        rests = [unpack_indices(s['rest']) for s in states]
        n, left = len(self.dataset), sum(len(r) for r in rests)
        consumed = int((first.get('redealt') or {}).get('consumed', 0)) + sum(int(s['position']) for s in states)
        if any(i < 0 or i >= n for r in rests for i in r) or len({i for r in rests for i in r}) != left:
            raise StateError(f'corrupt loader state: the samples left in epoch {epoch} are not distinct indices of the '
                             f'{n}-sample dataset')
        if consumed + left != n:
            raise StateError(f'the checkpoint was written for a dataset of {consumed + left} samples (consumed '
                             f'{consumed} + left {left} in epoch {epoch}), the training dataset now has {n}; resume '
                             'with the same dataset')
        own = states[rank] if same_world else first
        plan = length_policy.BatchPlan.from_json(own['plan']) if own.get('plan') else None
        order_plan = length_policy.BatchPlan.from_json(own['order_plan']) if own.get('order_plan') else None
        self.batch_size = int(batch_size if batch_size is not None else own['batch_size'])
        self._spreads = []
        chunks = None
        if same_world:
            share = rests[rank]
        elif order_plan is not None and order_plan.balanced:  # balanced steps for the new world
            share = self._balanced(redeal(rests, 1)[0], epoch, plan=order_plan, salt=consumed, keep=True)
        else:
            share = redeal(rests, world)[rank]
            if order_plan is not None and order_plan.bucketing:
                share, chunks = length_policy.epoch_layout(share, self.lengths, order_plan, epoch)
        self.epoch = epoch
        self._take_share(share, consumed=consumed, dealt=left, world=world)
        self.plan, self._order_plan, self._chunks = plan, order_plan, chunks
        self.num_pieces = int(own.get('num_pieces', 1))
        saved = [int(s.get('samples_seen', 0)) for s in states]
        self.samples_seen = saved[rank] if same_world else (sum(saved) if rank == 0 else 0)
        saved_entries = int(own.get('entries_per_step', self.entries_per_step))
        unchanged = (self.batch_size, self.entries_per_step) == (int(own['batch_size']), saved_entries)
        if same_world and plan is not None and unchanged:
            self._sizes = length_policy.from_run_length(own.get('plan_sizes', []))
            if sum(self._sizes) != len(share):
                raise StateError(f'corrupt loader state: planned micro-batches hold {sum(self._sizes)} samples, but '
                                 f'{len(share)} are left in the epoch')
            self._plan_steps = int(own.get('plan_steps', length_policy.steps_for(len(self._sizes),
                                                                                 self.entries_per_step)))
            self._passes = self._saved_passes(own, self._sizes)
        else:
            self._replan()
        self._needs_epoch_seed = True
        self._restart()
        return {'epoch': epoch, 'consumed_in_epoch': consumed, 'left_in_epoch': left, 'share': len(share)}

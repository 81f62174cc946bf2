"""The elastic loader's parts, each on its own contract (``swift_dynamic_callbacks/data``): the shard position, the plan
cursor, the draw statistics, the row lengths, and the pure budget arithmetic the loader feeds; and the package rule
that no part reaches into another object's private members."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import swift_dynamic_callbacks
from swift_dynamic_callbacks.data.cursor import PlanCursor
from swift_dynamic_callbacks.data.elastic import ElasticDataLoader
from swift_dynamic_callbacks.data.position import ShardPosition, saved_rests
from swift_dynamic_callbacks.data.rows import RowLengths
from swift_dynamic_callbacks.data.stats import DrawStats
from swift_dynamic_callbacks.errors import StateError
from swift_dynamic_callbacks.policies.data_plan import (epoch_steps, micro_batches_to, planned_steps_to_budget,
                                                        redealt_to_draw, steps_to_budget)
from swift_dynamic_callbacks.policies.length import BatchPlan


# ---- the budget arithmetic ----------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(epoch_size=st.integers(1, 60), batch=st.integers(1, 9), entries=st.integers(1, 4),
       position=st.integers(0, 60), budget=st.floats(0.0, 3.5).map(lambda x: round(x, 3)))
def test_the_planned_budget_of_equal_micro_batches_is_the_constant_batch_budget(epoch_size, batch, entries, position,
                                                                                budget):
    position = min(position, epoch_size)

    def sizes(start: int) -> list[int]:
        return [s for step in epoch_steps(epoch_size - start, batch, entries) for s in step if s]

    planned = planned_steps_to_budget(0, position, epoch_size, budget, entries, sizes(position), lambda e: sizes(0))
    assert planned == steps_to_budget(0, position, epoch_size, budget, batch, entries)


def test_the_planned_budget_counts_the_micro_batches_that_reach_each_epochs_share():
    # 10 samples an epoch in micro-batches of 4, 4, 2 (entries 2: 2 steps an epoch); later epochs 5, 5 (1 step)
    later = []
    steps = planned_steps_to_budget(0, 0, 10, 2.5, 2, [4, 4, 2], lambda e: later.append(e) or [5, 5])
    # epoch 0: 3 micro-batches -> 2 steps; epoch 1: 2 -> 1; half of epoch 2: 5 samples = 1 micro-batch -> 1 step
    assert steps == 4 and later == [1, 2]
    assert planned_steps_to_budget(0, 10, 10, 1.0, 2, [], lambda e: pytest.fail('not needed')) == 0
    assert micro_batches_to([4, 4, 2], 5) == 2 and micro_batches_to([4, 4, 2], 0) == 0
    with pytest.raises(ValueError, match='epoch_size'):
        planned_steps_to_budget(0, 0, 0, 1.0, 1, [], lambda e: [])


def test_a_redealt_epoch_draws_its_share_of_what_the_budget_still_needs():
    # 100 samples, 40 used before a re-deal of the other 60 over 2 ranks (30 each), 10 drawn here since
    assert redealt_to_draw(3.0, 0, 100, 40, 60, 30, 10) == 20  # the budget is beyond the epoch: the whole share
    # budget 0.7 epochs: 70 samples, 30 still needed over 60 dealt -> 15 of this rank's 30, 10 drawn
    assert redealt_to_draw(0.7, 0, 100, 40, 60, 30, 10) == 5
    assert redealt_to_draw(0.3, 0, 100, 40, 60, 30, 10) == 0  # reached before the re-deal


# ---- the shard position -------------------------------------------------------------------------------------------
def test_the_shard_position_counts_its_samples_and_saves_its_rest():
    shard = ShardPosition(list(range(10)), span=10)
    assert shard.upcoming(3) == [0, 1, 2]
    shard.advance(3)
    assert (shard.position, shard.samples_seen, shard.remaining, shard.rest[:2]) == (3, 3, 7, [3, 4])
    assert shard.coverage(planned=False, complete=False, dataset_size=10) == pytest.approx(0.3)
    state = shard.state_dict()
    assert state['epoch_size'] == 10 and 'padding' not in state and 'redealt' not in state
    other = ShardPosition(list(range(10)), span=10)
    other.load(state, list(range(10)))
    assert (other.position, other.samples_seen, other.rest) == (3, 3, shard.rest)
    with pytest.raises(StateError, match='epoch of 10 samples on this rank'):
        other.load(state, list(range(9)))
    with pytest.raises(StateError, match='position 11 outside'):
        other.load({**state, 'position': 11}, list(range(10)))


def test_a_shorter_shard_pads_its_last_step_and_a_share_counts_as_redealt():
    shard = ShardPosition(list(range(4)), span=5)  # this rank's shard is a sample short of the largest
    shard.pad(step_samples=8, drawn=4)  # before the draw: the largest shard takes 5 samples in this step, this 4
    shard.advance(4)
    assert shard.padding == 1 and shard.used_up(planned=False)
    shard.take_share([7, 8, 9], consumed=20, dealt=6, world=2)
    assert (shard.order, shard.position, shard.padding, shard.span) == ([7, 8, 9], 0, 0, 3)
    assert shard.redealt == {'consumed': 20, 'dealt': 6, 'world': 2}
    # 20 of 26 used before the re-deal, none of the share since: not complete
    assert shard.coverage(planned=True, complete=False, dataset_size=26) == pytest.approx(20 / 26)
    state = shard.state_dict()
    shard.start_epoch(1, list(range(5)))
    assert (shard.epoch, shard.span, shard.redealt, shard.full_span) == (1, 5, None, 5)
    shard.take_share([7, 8, 9], consumed=20, dealt=6, world=2)
    shard.load({**state, 'redealt': None}, list(range(3)))  # a state without a re-deal: the stale record goes
    assert (shard.span, shard.redealt, shard.epoch) == (5, None, 0)


def test_saved_rests_are_checked_before_they_are_dealt():
    shard = ShardPosition([3, 1, 4, 0, 2, 5], span=6)
    shard.advance(2)
    state = shard.state_dict()
    rests = saved_rests([state], 6)
    assert (rests.epoch, rests.rests, rests.consumed, rests.left) == (0, [[4, 0, 2, 5]], 2, 4)
    with pytest.raises(StateError, match='dataset of 6 samples'):
        saved_rests([state], 7)
    with pytest.raises(StateError, match='no list of the samples left'):
        saved_rests([{k: v for k, v in state.items() if k != 'rest'}], 6)


# ---- the plan cursor ----------------------------------------------------------------------------------------------
def test_the_cursor_gives_each_step_its_sizes_and_saves_what_is_left():
    cursor = PlanCursor()
    assert cursor.state_dict() == {}
    cursor.plan = BatchPlan(mode='token_budget', max_tokens=64)
    cursor.set([3, 2, 2, 1, 1], steps=3)
    assert cursor.next_step(2) == ((3, 2), None)
    cursor.advance(2)
    cursor.advance(2)
    assert cursor.next_step(2) == ((0, 1), None) and cursor.steps == 1  # a short last step: empty slots first
    state = cursor.state_dict()
    other = PlanCursor()
    other.load(state, left=1, entries=2)
    assert (other.plan, other.sizes, other.steps) == (cursor.plan, [1], 1)
    with pytest.raises(StateError, match='hold 1 samples, but 2 are left'):
        other.load(state, left=2, entries=2)


def test_the_cursor_cuts_passes_into_slots_and_checks_the_saved_passes():
    cursor = PlanCursor()
    cursor.plan = BatchPlan(mode='balanced', pass_tokens=256)
    cursor.set([4, 4, 8, 3, 5], steps=2, passes=[3, 2])
    sizes, slots = cursor.next_step(4)
    assert sizes == (4, 4, 8) and sum(slots) == 3 and len(slots) == 4
    assert cursor.budget_sizes(remaining=12, batch=2, entries=2) == [2, 2, 2, 2, 2, 2]
    cursor.advance(4)
    assert (cursor.sizes, cursor.passes, cursor.steps) == ([3, 5], [2], 1)
    state = cursor.state_dict()
    with pytest.raises(StateError, match='passes planned'):
        PlanCursor().load({**state, 'plan_passes': [[1, 1]]}, left=8, entries=4)


# ---- draw statistics and row lengths ------------------------------------------------------------------------------
def test_draw_stats_are_taken_once():
    stats = DrawStats()
    stats.count_batch(10, 16)
    stats.count_batch(5, 8)
    stats.count_step_spread((0.1, 0.3))
    stats.over_estimates.append({'indices': [1, 2], 'padded': 99})
    assert stats.take_token_stats() == (15, 24, 2) and stats.take_token_stats() == (0, 0, 0)
    assert stats.take_spread_stats() == (0.1, 0.3, 1) and stats.take_spread_stats() == (0.0, 0.0, 0)
    assert stats.take_reports().over_estimates == [{'indices': [1, 2], 'padded': 99}]
    assert stats.take_reports().over_estimates == []


def test_row_lengths_are_read_once_and_refined():
    calls = []
    rows = RowLengths(3, lambda: calls.append(1) or [5, 6, 7], lambda: [2, 3, 4])
    assert rows.costs == [5, 6, 7] and rows.real == [2, 3, 4] and rows.costs is rows.costs and calls == [1]
    rows.refine([0, 2], [9, None])
    assert rows.costs == [9, 6, 7] and rows.real == [9, 3, 4]
    with pytest.raises(ValueError, match='got 2 lengths for a dataset of 3'):
        RowLengths(3, lambda: [1, 2]).costs  # noqa: B018
    with pytest.raises(ValueError, match='built without them'):
        RowLengths(3, None).costs  # noqa: B018


# ---- the loader feeds its parts -----------------------------------------------------------------------------------
def test_the_loaders_budget_is_the_pure_functions_answer():
    lengths = [(7 * i) % 50 + 5 for i in range(37)]
    loader = ElasticDataLoader(list(range(37)), list, lambda epoch: list(range(37)), batch_size=4, entries_per_step=2,
                               lengths=lambda: lengths)
    assert loader.steps_to_budget(2.5) == steps_to_budget(0, 0, 37, 2.5, 4, 2)
    loader.set_plan(BatchPlan(mode='token_budget', max_tokens=120, bucket_width=4))
    loader.next_step(2)
    expected = planned_steps_to_budget(0, loader.position, 37, 2.5, 2, loader.budget_sizes(),
                                       loader._epoch_sizes)  # noqa: SLF001  (the loader's own feed)
    assert loader.steps_to_budget(2.5) == expected > 0


def test_no_part_of_the_data_package_reaches_into_another_objects_private_members():
    # (the integrations may: they adapt a host whose hooks are private members; the data plane has no host)
    folder = os.path.join(os.path.dirname(swift_dynamic_callbacks.__file__), 'data')
    for name in os.listdir(folder):
        if not name.endswith('.py'):
            continue
        with open(os.path.join(folder, name), encoding='utf-8') as f:
            for k, line in enumerate(f, 1):
                code = line.split('#')[0]
                # obj._private where obj is not self/cls (a torch DataLoader's own iterator excepted: closing it)
                for m in re.finditer(r'\b(\w+)\.(_[a-z]\w*)', code):
                    if m.group(1) not in ('self', 'cls') and m.group(0) != '_loader._iterator':
                        pytest.fail(f'data/{name}:{k}: {m.group(0)}')

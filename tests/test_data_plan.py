"""Pure planning functions: how an epoch is cut into optimizer steps / micro-batches, and step tables."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swift_dynamic_callbacks.policies.data_plan import epoch_steps, piece_bounds, step_sizes, steps_in_epoch
from swift_dynamic_callbacks.policies.schedule import changes_at, scheduled_value

remaining_st = st.integers(min_value=0, max_value=500)
batch_st = st.integers(min_value=1, max_value=32)
entries_st = st.integers(min_value=1, max_value=8)

# ---- step_sizes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    'remaining,batch_size,entries,expected',
    [
        (100, 4, 1, (4, )),
        (100, 4, 3, (4, 4, 4)),
        (12, 4, 3, (4, 4, 4)),  # exactly one full step
        (11, 4, 3, (3, 4, 4)),
        (10, 4, 3, (3, 3, 4)),
        (9, 4, 3, (3, 3, 3)),
        (5, 4, 3, (1, 2, 2)),
        (2, 4, 3, (0, 1, 1)),
        (1, 4, 3, (0, 0, 1)),
        (1, 1, 1, (1, )),
        (3, 7, 1, (3, )),
        (0, 4, 3, (0, 0, 0)),
        (0, 1, 1, (0, )),
        (7, 2, 4, (1, 2, 2, 2)),
    ],
)
def test_step_sizes_table(remaining, batch_size, entries, expected):
    assert step_sizes(remaining, batch_size, entries) == expected


@pytest.mark.parametrize('args', [(-1, 2, 1), (5, 0, 1), (5, 2, 0), (5, -3, 2), (5, 2, -1)])
def test_step_sizes_rejects_bad_arguments(args):
    with pytest.raises(ValueError, match='step_sizes'):
        step_sizes(*args)


@settings(max_examples=300, deadline=None)
@given(remaining_st, batch_st, entries_st)
def test_step_sizes_properties(remaining, batch_size, entries):
    sizes = step_sizes(remaining, batch_size, entries)
    assert isinstance(sizes, tuple)
    assert len(sizes) == entries
    assert sum(sizes) == min(remaining, batch_size * entries)
    assert all(0 <= s <= batch_size for s in sizes)
    assert list(sizes) == sorted(sizes)  # ascending
    if remaining > 0:
        assert sizes[-1] > 0  # the gradient-synchronising micro-batch is never empty
    assert max(sizes) - min(sizes) <= 1  # balanced
    if remaining >= batch_size * entries:
        assert sizes == (batch_size, ) * entries


# ---- epoch_steps / steps_in_epoch ------------------------------------------------------------------------


@pytest.mark.parametrize(
    'remaining,batch_size,entries,expected',
    [
        (0, 3, 2, []),
        (10, 3, 1, [(3, ), (3, ), (3, ), (1, )]),
        (10, 2, 2, [(2, 2), (2, 2), (1, 1)]),
        (16, 4, 2, [(4, 4), (4, 4)]),
        (5, 4, 3, [(1, 2, 2)]),
        (13, 2, 3, [(2, 2, 2), (2, 2, 2), (0, 0, 1)]),
    ],
)
def test_epoch_steps_table(remaining, batch_size, entries, expected):
    assert list(epoch_steps(remaining, batch_size, entries)) == expected
    assert steps_in_epoch(remaining, batch_size, entries) == len(expected)


@pytest.mark.parametrize('remaining,batch_size,entries,expected', [(0, 1, 1, 0), (1, 1, 1, 1), (10, 3, 1, 4),
                                                                   (12, 3, 2, 2), (13, 3, 2, 3), (100, 7, 3, 5)])
def test_steps_in_epoch_table(remaining, batch_size, entries, expected):
    assert steps_in_epoch(remaining, batch_size, entries) == expected


@settings(max_examples=300, deadline=None)
@given(remaining_st, batch_st, entries_st)
def test_epoch_steps_properties(remaining, batch_size, entries):
    steps = list(epoch_steps(remaining, batch_size, entries))
    assert sum(sum(s) for s in steps) == remaining  # nothing dropped, nothing repeated
    assert steps_in_epoch(remaining, batch_size, entries) == len(steps)
    assert len(steps) == -(-remaining // (batch_size * entries))
    # all steps but the last are full; every step is a valid step_sizes output for what was left
    left = remaining
    for i, sizes in enumerate(steps):
        assert sizes == step_sizes(left, batch_size, entries)
        if i < len(steps) - 1:
            assert sizes == (batch_size, ) * entries
        assert sizes[-1] > 0
        left -= sum(sizes)
    assert left == 0


# ---- piece_bounds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    'size,num_pieces,expected',
    [
        (0, 1, ()),
        (0, 4, ()),
        (1, 1, ((0, 1), )),
        (4, 1, ((0, 4), )),
        (4, 2, ((0, 2), (2, 4))),
        (5, 2, ((0, 3), (3, 5))),
        (7, 3, ((0, 3), (3, 5), (5, 7))),
        (2, 5, ((0, 1), (1, 2))),  # fewer pieces than asked
    ],
)
def test_piece_bounds_table(size, num_pieces, expected):
    assert piece_bounds(size, num_pieces) == expected


@pytest.mark.parametrize('args', [(-1, 1), (4, 0), (4, -2)])
def test_piece_bounds_rejects_bad_arguments(args):
    with pytest.raises(ValueError, match='piece_bounds'):
        piece_bounds(*args)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=300), st.integers(min_value=1, max_value=40))
def test_piece_bounds_properties(size, num_pieces):
    bounds = piece_bounds(size, num_pieces)
    assert len(bounds) == min(size, num_pieces)
    # contiguous cover of [0, size)
    position = 0
    for start, stop in bounds:
        assert start == position
        assert stop > start  # non-empty
        position = stop
    assert position == size
    lengths = [stop - start for start, stop in bounds]
    if lengths:
        assert max(lengths) - min(lengths) <= 1
        assert sum(lengths) == size


# ---- schedule tables -------------------------------------------------------------------------------------


def test_scheduled_value_table():
    table = {0: 2, 10: 4, 15: 1}
    assert [scheduled_value(table, s) for s in range(18)] == [2] * 10 + [4] * 5 + [1] * 3
    assert scheduled_value(table, 10_000) == 1


def test_scheduled_value_before_first_key_and_unsorted():
    table = {20: 8, 5: 3}  # key order must not matter
    assert scheduled_value(table, 0) is None
    assert scheduled_value(table, 4) is None
    assert scheduled_value(table, 5) == 3
    assert scheduled_value(table, 19) == 3
    assert scheduled_value(table, 20) == 8
    assert scheduled_value({}, 0) is None
    assert scheduled_value({}, 7) is None


def test_changes_at_table():
    table = {0: 2, 10: 4, 12: 4, 15: 1}
    assert [s for s in range(20) if changes_at(table, s)] == [0, 10, 15]  # 12 repeats the value: no change
    assert [s for s in range(10) if changes_at({3: 5}, s)] == [3]
    assert not any(changes_at({}, s) for s in range(5))


tables_st = st.dictionaries(st.integers(min_value=0, max_value=60), st.integers(min_value=1, max_value=5), max_size=8)


@settings(max_examples=200, deadline=None)
@given(tables_st, st.integers(min_value=0, max_value=80))
def test_scheduled_value_follows_table(table, step):
    expected = None
    for key in sorted(table):
        if key <= step:
            expected = table[key]
    assert scheduled_value(table, step) == expected
    if step in table:
        assert scheduled_value(table, step) == table[step]


@settings(max_examples=200, deadline=None)
@given(tables_st)
def test_changes_at_matches_walk(table):
    values = [scheduled_value(table, s) for s in range(70)]
    for s in range(70):
        before = values[s - 1] if s > 0 else None
        assert changes_at(table, s) == (values[s] != before)
    # a change can only happen at a key of the table
    assert {s for s in range(70) if changes_at(table, s)} <= set(table)


def test_the_tolerant_ceiling_and_comparison_absorb_floating_point_noise():
    from swift_dynamic_callbacks.policies.data_plan import before, tolerant_ceil
    assert (0.1 + 0.2) * 10 > 3 and tolerant_ceil((0.1 + 0.2) * 10) == 3  # 3.0000000000000004 samples are 3
    assert tolerant_ceil(3.2) == 4 and tolerant_ceil(3.0) == 3 and tolerant_ceil(0.0) == 0
    assert not before(0.1 + 0.2, 0.3) and before(0.29, 0.3)  # 0.30000000000000004 epochs reached 0.3

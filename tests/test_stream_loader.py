"""The elastic loader over a stream: exactly once in stream order at changing batch sizes, windows, resume."""

from __future__ import annotations

import os

import pytest
from torch.utils.data import IterableDataset

from swift_dynamic_callbacks.policies.length import BatchPlan
from swift_dynamic_callbacks.state import StateError
from swift_dynamic_callbacks.data.stream import StreamLoader, _RankShard, stream_fingerprint


class Stream(IterableDataset):
    """Rows ``{'input_ids': [..] * length}``; ``set_epoch`` reverses the order on odd epochs (a stream's shuffle)."""

    def __init__(self, lengths):
        self.lengths = list(lengths)
        self.epoch = 0
        self.reads = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = range(len(self.lengths))
        for i in (reversed(order) if self.epoch % 2 else order):
            self.reads += 1
            yield {'input_ids': [i] * self.lengths[i], 'row': i}


def collate(rows):
    return {'rows': [r['row'] for r in rows]}


LENGTHS = [5 + (i * 37) % 60 for i in range(53)]


def make(lengths=LENGTHS, **kwargs):
    kwargs.setdefault('batch_size', 2)
    kwargs.setdefault('entries_per_step', 2)
    return StreamLoader(Stream(lengths), collate, **kwargs)


def run_epoch(loader, sizes=None, steps=None):
    """Draw until the epoch ends (or ``steps`` steps); ``sizes``: batch size per step (the last one repeats).
    Returns the rows drawn (their stream index is their position in the epoch's stream order)."""
    seen, step = [], 0
    order = list(reversed(range(len(loader.dataset.lengths)))) if loader.epoch % 2 else list(range(
        len(loader.dataset.lengths)))
    while not loader.epoch_complete and (steps is None or step < steps):
        if sizes:
            loader.set_batch_size(sizes[min(step, len(sizes) - 1)])
        for indices, batch in loader.next_step(loader.entries_per_step):
            if indices:
                assert batch['rows'] == [order[k] for k in indices]
                assert len(indices) <= loader.batch_size
            seen.extend(batch['rows'] if indices else [])
        step += 1
    return seen


def test_stream_order_exactly_once_at_changing_batch_sizes():
    loader = make()
    seen = run_epoch(loader, sizes=[1, 3, 2, 5, 4])
    assert seen == list(range(53))  # stream order, every row once
    assert loader.epoch_complete and loader.epoch_progress == 1.0 and loader.samples_seen == 53
    loader.start_next_epoch()
    assert run_epoch(loader, sizes=[4]) == list(reversed(range(53)))  # set_epoch: the stream's next order
    assert loader.epoch == 1 and loader.samples_seen == 106


def test_batch_size_applies_at_the_next_step():
    loader = make(batch_size=1, entries_per_step=1)
    first = loader.next_step(1)
    loader.set_batch_size(4)
    second = loader.next_step(1)
    assert [len(i) for i, _ in first + second] == [1, 4] and second[0][0] == [1, 2, 3, 4]


@pytest.mark.parametrize('plan', [None, BatchPlan(max_tokens=150, bucketing=False), BatchPlan(max_tokens=150, seed=3)])
@pytest.mark.parametrize('stop', [1, 4, 9])
def test_resume_continues_at_the_next_unseen_sample(plan, stop):
    sizes = [2, 3, 5]
    straight = make(window=16)
    if plan:
        straight.set_plan(plan)
    whole = run_epoch(straight, sizes=sizes)
    assert sorted(whole) == list(range(53))

    first = make(window=16)
    if plan:
        first.set_plan(plan)
    head = run_epoch(first, sizes=sizes, steps=stop)
    state = first.state_dict()
    second = make(window=16)
    second.load_state_dict(state)
    tail = run_epoch(second, sizes=sizes[min(stop, len(sizes) - 1):])
    assert head + tail == whole  # the same samples in the same order: nothing skipped, nothing repeated
    assert second.samples_seen == 53


def test_plan_windows_bound_the_budget_and_keep_rows_in_their_window():
    loader = make(window=10, batch_size=8, entries_per_step=1)
    loader.set_plan(BatchPlan(max_tokens=150, seed=1))
    seen = []
    while not loader.epoch_complete:
        for indices, _ in loader.next_step(1):
            if indices:
                cost = len(indices) * max(LENGTHS[i] for i in indices)
                assert cost <= 150 or len(indices) == 1
                assert len({i // 10 for i in indices}) == 1  # a micro-batch never spans two windows
            seen.extend(indices)
    assert sorted(seen) == list(range(53)) and seen != list(range(53))  # bucketed inside windows
    assert [i // 10 for i in seen] == sorted(i // 10 for i in seen)  # windows in stream order
    real, padded, batches = loader.take_token_stats()
    assert real == sum(LENGTHS) and padded >= real and batches > 0


def test_over_budget_rows_are_noted_and_run_alone():
    loader = make(lengths=[10, 500, 10, 10], window=4, batch_size=4, entries_per_step=1)
    loader.set_plan(BatchPlan(max_tokens=100, bucketing=False))
    batches = []
    while not loader.epoch_complete:
        batches += [indices for indices, _ in loader.next_step(1) if indices]
    assert [1] in batches and sorted(i for b in batches for i in b) == [0, 1, 2, 3]  # the long row alone
    assert loader.stats.rows_over_budget == [(1, 500)]


def test_rank_shards_cover_the_stream():
    data = Stream(range(1, 12))
    shards = [[k for k, _ in _RankShard(data, 0, 0, r, 3)] for r in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]
    assert [k for k, _ in _RankShard(data, 0, 2, 1, 3)] == [7, 10]  # skip 2 of rank 1's rows


def test_workers_read_the_stream_ahead_in_order():
    loader = make(loader_kwargs={'num_workers': 1})
    try:
        assert run_epoch(loader, sizes=[3, 1, 4]) == list(range(53))
    finally:
        loader.close()


def test_state_checks():
    loader = make()
    with pytest.raises(StateError, match='map-style'):
        loader.load_state_dict({'epoch': 0, 'position': 3, 'batch_size': 2})
    with pytest.raises(StateError, match='corrupt'):
        loader.load_state_dict({'epoch': 0, 'position': 3, 'batch_size': 2, 'streaming': True,
                                'plan': BatchPlan().to_json(), 'window_start': 0, 'window_taken': 1})
    with pytest.raises(TypeError):
        len(loader)
    assert stream_fingerprint(Stream([3, 4]))['sha256'] == stream_fingerprint(Stream([3, 4]))['sha256']
    assert stream_fingerprint(Stream([3, 4]))['sha256'] != stream_fingerprint(Stream([4, 4]))['sha256']


# ---- configuration ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('settings,section,match', [
    ({}, {}, 'max_steps: streaming: true needs max_steps > 0'),
    ({'max_steps': 10}, {'integration': {'max_steps_unit': 'samples'}}, 'max_steps_unit: samples is not supported'),
])
def test_stream_refusals_name_the_setting(settings, section, match):
    from swift_dynamic_callbacks.config import ConfigError
    from swift_dynamic_callbacks.config.launch import check_run
    from swift_dynamic_callbacks.config.pack import parse_section
    pack = parse_section({**section, 'batch_growth': {}}, ['batch_growth'])
    with pytest.raises(ConfigError, match=match):
        check_run(pack, {'streaming': True, 'callbacks': ['batch_growth'], **settings})
    check_run(pack, {'streaming': True, 'callbacks': ['batch_growth'], 'max_steps': 10}) if not section else None


# ---- end to end ---------------------------------------------------------------------------------------------------


@pytest.fixture
def _register():
    import swift_dynamic_callbacks as sdc
    yield sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    plugin.unregister()


@pytest.mark.e2e
def test_swift_sft_streaming_batch_growth(_register, tmp_path, tiny_llama, fixture_dir):
    """``streaming: true``: growth 1 -> 2 -> 4 every 2 steps, length buckets in windows of 4 rows, 12 rows a pass of
    the stream; every row of the first pass once, in windows of the stream order, then the stream again."""
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    from swift_runs import decisions, run_sft, sample_trace, train_logs
    data = str(write_gsm8k_dataset(fixture_dir / 'gsm8k-12.jsonl', 12))
    growth = {'initial': 1, 'factor': 2, 'interval': 2, 'maximum': 4}
    _register.register(batch_growth=growth, length_batching={'max_tokens': 100000},
                       integration={'record_samples': True, 'stream_window': 4})
    out = run_sft(tiny_llama, 'llama', data, str(tmp_path / 'out'), callbacks=['batch_growth', 'length_batching'],
                  streaming=True, max_steps=7, dataset_shuffle=False)
    trace = sample_trace(out)
    assert [row['batch_size'] for row in trace] == [1, 1, 2, 2, 4, 4, 4]
    first = [i for row in trace if row['epoch'] == 0 for b in row['batches'] for i in b]
    assert sorted(first) == list(range(12))  # every row of the stream once
    for row in trace:
        for batch in row['batches']:
            assert len(batch) <= row['batch_size'] and len({i // 4 for i in batch}) <= 1  # inside one window
    assert [i // 4 for i in first] == sorted(i // 4 for i in first)  # windows in stream order
    assert any(row['epoch'] == 1 for row in trace)  # the stream read again after its end
    logs = train_logs(out)
    assert len(logs) == 7 and all('dynamic/tokens_per_batch' in row for row in logs)
    assert [d['values']['new'] for d in decisions(out)
            if d['kind'] == 'batch_size' and d['reason'] == 'interval'] == [2, 4]


@pytest.mark.e2e
def test_swift_sft_streaming_resume_continues_at_the_next_unseen_row(_register, tmp_path, tiny_llama, fixture_dir):
    """A stream run checkpointed at step 3 and resumed to step 6 draws the rows the uninterrupted run draws."""
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    from swift_runs import decisions, run_sft, sample_trace
    data = str(write_gsm8k_dataset(fixture_dir / 'gsm8k-10.jsonl', 10))
    _register.register(batch_growth={'initial': 1, 'factor': 2, 'interval': 2, 'maximum': 4},
                       integration={'record_samples': True})
    common = dict(callbacks=['batch_growth'], streaming=True, dataset_shuffle=False, save_steps=3)
    straight = run_sft(tiny_llama, 'llama', data, str(tmp_path / 'straight'), max_steps=6, **common)
    first = run_sft(tiny_llama, 'llama', data, str(tmp_path / 'resumed'), max_steps=3, **common)
    resumed = run_sft(tiny_llama, 'llama', data, first, max_steps=6, fresh=False,
                      resume_from_checkpoint=os.path.join(first, 'checkpoint-3'), **common)
    rows = lambda out: [(r['step'], r['epoch'], r['batches']) for r in sample_trace(out)]  # noqa: E731
    assert rows(straight)[3:] == rows(resumed)[-3:] and rows(straight)[:3] == rows(resumed)[:3]
    (resume, ) = [d for d in decisions(resumed) if d['kind'] == 'resume']
    assert resume['values']['position'] == 4  # 1 + 1 + 2 rows of the stream consumed

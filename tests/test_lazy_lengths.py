"""Lazy datasets at scale: length estimates from characters (Arrow), cached and refined; the budget holds on real
rows (an over-budget micro-batch runs as passes within it)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from swift_dynamic_callbacks.data.length_estimates import apply, char_counts, estimate_lengths, fit, is_lazy
from swift_dynamic_callbacks.data.elastic import ElasticDataLoader
from swift_dynamic_callbacks.data.rows import item_lengths, row_cost
from swift_dynamic_callbacks.policies.length import BatchPlan
from swift_runs import free_port


def raw_rows(n=40):
    import datasets
    rows = [{'messages': [{'role': 'user', 'content': 'q' * (3 + i)}, {'role': 'assistant', 'content': 'a' * (5 * i)}],
             'rejected_response': 'r' * (i % 4)} for i in range(n)]
    return datasets.Dataset.from_list(rows)


class Lazy:
    """A stand-in for ms-swift's ``LazyLLMDataset``: ``encode_func`` on raw rows when read (1 token a character + 7)."""

    def __init__(self, raw, extra=0):
        self.dataset, self.extra, self.reads = raw, extra, 0

    def encode_func(self, row, return_length=True):
        chars = sum(len(m['content']) for m in row['messages']) + len(row.get('rejected_response') or '')
        return {'input_ids': [1] * (chars + 7 + self.extra)}

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        self.reads += 1
        return self.encode_func(self.dataset[i])


def test_char_counts_of_messages_and_strings_by_arrow():
    raw = raw_rows()
    expected = [(3 + i) + 5 * i + (i % 4) + len('user') + len('assistant') for i in range(40)]
    assert char_counts(raw).tolist() == expected
    shuffled = raw.shuffle(seed=1)  # an indices mapping: the rows of the view
    assert char_counts(shuffled).tolist() == [expected[i] for i in shuffled._indices.column(0).to_pylist()]


def test_char_counts_of_json_messages_as_ms_swift_stores_them():
    import pyarrow as pa

    class Raw:  # ms-swift keeps ``messages`` as a list of JSON texts (an Arrow extension type)
        def __init__(self, table):
            self.data = table

    texts = [['{"role":"user","content":"ab"}', '{"role":"assistant","content":"abcd"}'], ['{"c":"x"}']]
    flat = pa.ExtensionArray.from_storage(pa.json_(), pa.array([x for t in texts for x in t]))
    column = pa.ListArray.from_arrays(pa.array([0, 2, 3], type=pa.int32()), flat)
    assert char_counts(Raw(pa.table({'messages': column}))).tolist() == [sum(map(len, t)) for t in texts]


def test_fit_never_under_estimates_the_sample():
    chars = np.array([10, 20, 40, 80])
    costs = [17, 30, 45, 90]
    a, b, scale = fit(chars, costs)
    assert all(apply(chars, a, b, scale) >= costs)
    assert fit([5], [9])[2] >= 1.0


def test_estimates_read_only_a_sample_and_are_cached(tmp_path):
    raw = raw_rows(200)
    lazy = Lazy(raw)
    assert is_lazy(lazy) and not is_lazy(raw)
    measure = lambda item, i: row_cost(item_lengths(item, i))  # noqa: E731
    lengths, info = estimate_lengths(lazy, measure, sample=16, cache=str(tmp_path))
    assert lazy.reads == 16 and info['sampled'] == 16 and not info['cached']
    true = [measure(lazy.encode_func(raw[i]), i) for i in range(200)]
    assert all(e >= t for e, t in zip(lengths, true))  # linear data: the fit covers every row
    assert max(e / t for e, t in zip(lengths, true)) < 1.3
    again, info2 = estimate_lengths(Lazy(raw), measure, sample=16, cache=str(tmp_path))
    assert info2['cached'] and again == lengths and os.path.exists(info2['cache'])
    other, info3 = estimate_lengths(Lazy(raw, extra=50), measure, sample=16, cache=str(tmp_path))
    assert not info3['cached']  # another encoding (template, max_length): another key


def test_loader_refines_estimates_and_notes_micro_batches_over_the_budget():
    raw = raw_rows(24)
    lazy = Lazy(raw)
    low = [5] * 24  # far too low: every real row is longer
    loader = ElasticDataLoader(lazy, lambda items: items, lambda epoch: list(range(24)), batch_size=8,
                               entries_per_step=1, lengths=lambda: list(low))
    loader.lengths_estimated = True
    loader.set_plan(BatchPlan(max_tokens=200, bucketing=False))
    seen = []
    while not loader.epoch_complete:
        for indices, _ in loader.next_step(1):
            seen.extend(indices)
    assert sorted(seen) == list(range(24))
    real = [row_cost(item_lengths(lazy.encode_func(raw[i]))) for i in range(24)]
    assert loader.lengths == real  # every estimate replaced by the real cost once encoded
    assert loader.stats.over_estimates and all(e['padded'] > 200 for e in loader.stats.over_estimates)
    loader.start_next_epoch()  # the next epoch is planned from the real lengths: within the budget
    loader.stats.over_estimates.clear()
    while not loader.epoch_complete:
        loader.next_step(1)
    assert loader.stats.over_estimates == []


@pytest.mark.e2e
def test_swift_sft_lazy_length_batching(tmp_path, tiny_llama, fixture_dir, monkeypatch):
    """``lazy_tokenize: true`` + length_batching: one ``length_estimate`` record, a sample encoded (not every row),
    every row once, and no micro-batch over the budget on real tokens (the collated ``input_ids``) unless an
    ``over_estimate`` record says it ran as passes within it."""
    import swift_dynamic_callbacks as sdc
    drawn = []  # (indices, padded tokens of the collated micro-batch)
    next_step = ElasticDataLoader.next_step

    def traced(self, entries):
        pairs = next_step(self, entries)
        drawn.extend((list(indices), batch['input_ids'].numel()) for indices, batch in pairs if indices)
        return pairs

    monkeypatch.setattr(ElasticDataLoader, 'next_step', traced)
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.tiny import write_gsm8k_dataset
    from swift_runs import decisions, indices_by_epoch, run_sft, sample_trace, train_logs
    data = str(write_gsm8k_dataset(fixture_dir / 'gsm8k-24.jsonl', 24))
    try:
        sdc.register(length_batching={'max_tokens': 600}, integration={'record_samples': True})
        out = run_sft(tiny_llama, 'llama', data, str(tmp_path / 'out'), callbacks=['length_batching'],
                      lazy_tokenize=True, num_train_epochs=1, max_steps=-1, per_device_train_batch_size=8)
    finally:
        plugin.unregister()
    records = decisions(out)
    (estimate, ) = [d for d in records if d['kind'] == 'length_estimate']
    assert estimate['values']['rows'] == 24 and estimate['values']['sampled'] <= 24
    assert sorted(indices_by_epoch(sample_trace(out))[0]) == list(range(24))
    logs = train_logs(out)
    assert all('dynamic/estimate_overruns' in row for row in logs)
    overruns = [d for d in records if d['kind'] == 'over_estimate']
    assert logs[-1]['dynamic/estimate_overruns'] == len(overruns)
    assert all(d['reason'] == 'split' for d in overruns)
    recorded = {tuple(d['values']['indices']) for d in overruns}
    over = [(indices, padded) for indices, padded in drawn if len(indices) > 1 and padded > 600]
    assert drawn and all(tuple(indices[:32]) in recorded for indices, _ in over), over


def _estimate_on_rank(rank, world, folder, port, out):
    """One rank of a 2-process run (gloo): the main process writes the cache, the other reads it after the barrier."""
    import json

    import torch.distributed as dist

    from swift_dynamic_callbacks import distributed
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world)
    try:
        lazy = Lazy(raw_rows(120))
        measure = lambda item, i: row_cost(item_lengths(item, i))  # noqa: E731
        lengths, info = estimate_lengths(lazy, measure, sample=16, cache=folder, is_main=rank == 0,
                                         wait=lambda: distributed.gather_objects(0), key=('tmpl', 1024, 'right'))
        with open(os.path.join(out, f'rank{rank}.json'), 'w') as f:
            json.dump({'lengths': lengths, 'cached': info['cached'], 'cache': info['cache']}, f)
    finally:
        dist.destroy_process_group()


def test_two_processes_share_one_cache_file(tmp_path):
    """Under 2 real processes the main one writes the estimates once (atomically), the other reads that file after
    the barrier: the same lengths on both, one file; a second run of both reads it."""
    import json
    import torch.multiprocessing as mp
    folder, out = tmp_path / 'cache', tmp_path / 'out'
    folder.mkdir(), out.mkdir()
    for attempt in range(2):
        mp.spawn(_estimate_on_rank, args=(2, str(folder), free_port(), str(out)), nprocs=2, join=True)
        ranks = [json.loads((out / f'rank{r}.json').read_text()) for r in range(2)]
        assert ranks[0]['lengths'] == ranks[1]['lengths'] and ranks[0]['cache'] == ranks[1]['cache']
        assert ranks[1]['cached'] and ranks[0]['cached'] == (attempt == 1)  # rank 0 wrote it, then both read it
        assert [p.name for p in folder.iterdir()] == [os.path.basename(ranks[0]['cache'])]  # no temporary left


def test_the_cache_key_holds_what_changes_a_rows_length(tmp_path):
    """Another template, max_length or truncation gives another cache file, never the estimates of the first."""
    raw = raw_rows(60)
    measure = lambda item, i: row_cost(item_lengths(item, i))  # noqa: E731
    _, first = estimate_lengths(Lazy(raw), measure, sample=8, cache=str(tmp_path), key=('qwen2_5', 1024, 'right'))
    _, same = estimate_lengths(Lazy(raw), measure, sample=8, cache=str(tmp_path), key=('qwen2_5', 1024, 'right'))
    _, other = estimate_lengths(Lazy(raw), measure, sample=8, cache=str(tmp_path), key=('qwen2_5', 512, 'right'))
    assert same['cached'] and same['cache'] == first['cache']
    assert not other['cached'] and other['cache'] != first['cache'] and len(os.listdir(tmp_path)) == 2


def test_each_rows_media_tokens_come_with_the_estimate_and_from_its_cache(tmp_path):
    """The vision tower's work is priced a row at a time (the planner's ``pass_tokens`` passes): the estimate hands
    back each row's image tokens (``row_media``), computed from the headers once and read back from the cache."""
    import datasets
    from PIL import Image
    sizes = [(56, 56), (112, 56), None, (112, 112)]
    rows = []
    for i, size in enumerate(sizes * 4):
        row = {'messages': [{'role': 'user', 'content': 'q' * (5 + i)}, {'role': 'assistant', 'content': 'a' * i}],
               'images': []}
        if size is not None:
            path = tmp_path / f'{i}.png'
            Image.new('RGB', size).save(path)
            row['images'] = [str(path)]
        rows.append(row)
    raw = datasets.Dataset.from_list(rows)

    def measure(item, i):
        return row_cost(item_lengths(item, i))

    def tokens(w, h):  # 28 x 28 pixels a token, as Qwen2-VL
        return (w // 28) * (h // 28)
    expected = [0 if s is None else tokens(*s) for s in sizes * 4]
    _, info = estimate_lengths(Lazy(raw), measure, sample=4, cache=str(tmp_path / 'c'), image_tokens=tokens)
    assert info['row_media'] == expected and not info['cached']
    _, again = estimate_lengths(Lazy(raw), measure, sample=4, cache=str(tmp_path / 'c'), image_tokens=tokens)
    assert again['cached'] and again['row_media'] == expected
    _, text = estimate_lengths(Lazy(raw), measure, sample=4, cache=str(tmp_path / 'c'))
    assert 'row_media' not in text  # images not counted: none handed back


def test_the_planner_prices_each_rows_vision_work_beside_its_tokens():
    """A loader with each index's vision work (tokens of the cost model) plans ``pass_tokens`` passes as the step
    runner prices them: rows whose images' work does not fit one pass are planned in more."""
    from swift_dynamic_callbacks.data.rows import RowLengths, dataset_media_tokens
    from swift_dynamic_callbacks.policies.balance import step_passes
    assert step_passes([10] * 4, 4, 60) == [[4]]
    assert step_passes([10] * 4, 4, 60, vision=[30, 0, 0, 0]) == [[3, 1]]  # 4 x 10 + 30 = 70: the fourth row apart
    assert step_passes([10] * 4, 4, 60, vision=[0, 0, 0, 45]) == [[3, 1]]
    items = [{'input_ids': [5, 9, 9, 9, 1]}, {'input_ids': [5, 1]}, {'input_ids': [8, 9, 8]}]
    assert dataset_media_tokens(items, [9, 8]) == [3, 0, 3]
    assert dataset_media_tokens(items, []) is None and dataset_media_tokens([{'labels': [1]}], [9]) is None
    import datasets
    assert dataset_media_tokens(datasets.Dataset.from_list(items), [9]) == [3, 0, 1]
    table = RowLengths(3, lambda: [4, 5, 6], vision=lambda: [0, 7, 0])
    assert table.vision == [0, 7, 0]
    assert RowLengths(3, lambda: [4, 5, 6], vision=lambda: [0, 0, 0]).vision is None  # nothing to price
    with pytest.raises(ValueError, match='2 vision costs for a dataset of 3'):
        RowLengths(3, lambda: [4, 5, 6], vision=lambda: [1, 2]).vision  # noqa: B018
    order = list(range(8))
    loaders = {}
    for name, vision in (('tokens', None), ('vision', [40, 0, 0, 0, 40, 0, 0, 0])):
        loader = ElasticDataLoader(list(range(8)), lambda items: items, lambda epoch: order, batch_size=4,
                                   entries_per_step=1, lengths=lambda: [10] * 8, vision=lambda v=vision: v)
        loader.set_plan(BatchPlan(max_tokens=10**6, mode='balanced', pass_tokens=60, bucketing=True))
        loaders[name] = (list(loader.cursor.sizes), list(loader.cursor.passes))
    assert loaders['tokens'] == ([4, 4], [1, 1])  # 2 steps of 4 rows, each one pass of 40 tokens
    sizes, passes = loaders['vision']
    assert sum(sizes) == 8 and sum(passes) == 3  # the two rows of 40 tokens of vision work: passes of 2 (the
    assert sorted(sizes) == [2, 2, 4]            # layout deals them into one step), the other step one pass of 4

#!/usr/bin/env python
"""Length-aware batching on real data: padding, batches per epoch and tokens per batch (a benchmark, not a test).

Sample lengths are real: every row of gsm8k (train), alpaca-gpt4-en-demo, lima and glaive-toolcall-en-demo from
``../shared/data`` (``--data``) is rendered with the Qwen2.5-Instruct chat template and tokenized with the real
Qwen2.5 tokenizer vendored in the package (:func:`swift_dynamic_callbacks.testing.tiny.materialize_tokenizer`);
``mix`` is all four sets together. Lengths are cached in ``--work-dir`` (computed once). No model is run: the figures
are
those of the batches each method forms, padded to their longest member (what ms-swift's collator does):

- ``random, batch 16``: ms-swift's default sampler (a seeded permutation, fixed per-device batch 16);
- ``group_by_length, batch 16``: ms-swift's ``group_by_length: true`` (HF's ``get_length_grouped_indices``:
  random mega-batches of 50 x 16 samples sorted by length, cut into batches of 16);
- ``pack buckets, batch 16``: this pack's bucketed order (``length_batching`` with ``mode: rules``,
  ``rules: {0: 16}``), batch 16 samples;
- ``pack token budget``: ``length_batching`` with ``mode: token_budget``, ``max_tokens`` = ``--max-tokens``,
  bucketing on, at most ``--cap`` samples a micro-batch (``per_device_train_batch_size``);
- ``pack token budget, no buckets``: the same budget on the random order (``bucketing: false``).

Columns: padded-token fraction (``1 - real / padded`` tokens, summed over the epoch), micro-batches per epoch,
padded tokens per micro-batch (``samples x longest``; mean and max), samples per micro-batch (mean), and the
time the method takes to plan one epoch. Figures are over ``--epochs`` epochs (seeds ``--seed + epoch``).

Usage (from the repository root)::

    python scripts/bench_length.py                       # data from ../shared/data
    python scripts/bench_length.py --data /path/to/shared/data --max-tokens 16384 --cap 128
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import base_parser, machine_lines

REPO = Path(__file__).resolve().parent.parent
BATCH = 16
DATASETS = {
    'gsm8k': 'gsm8k/train.jsonl.gz',
    'alpaca-gpt4-en-demo': 'alpaca-gpt4-en-demo/alpaca_en_demo.json.gz',
    'lima': 'lima/lima.json.gz',
    'glaive-toolcall-en-demo': 'glaive-toolcall-en-demo/glaive_toolcall_en_demo.json.gz',
}


# ---- data -> chat messages -------------------------------------------------------------------------------------
def _read(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, 'rt', encoding='utf-8') as f:
        text = f.read()
    if path.name.endswith('.jsonl.gz'):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def _alpaca(row: dict[str, Any]) -> tuple[list[dict[str, Any]], None]:
    messages = []
    for user, assistant in row.get('history') or []:
        messages += [{'role': 'user', 'content': user}, {'role': 'assistant', 'content': assistant}]
    prompt = row['instruction'] + ('\n\n' + row['input'] if row.get('input') else '')
    return messages + [{'role': 'user', 'content': prompt}, {'role': 'assistant', 'content': row['output']}], None


def _glaive(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    roles = {'human': 'user', 'gpt': 'assistant', 'observation': 'tool'}
    messages = []
    for turn in row['conversations']:
        if turn['from'] == 'function_call':
            call = json.loads(turn['value'])
            messages.append({'role': 'assistant', 'content': '', 'tool_calls': [
                {'type': 'function', 'function': {'name': call['name'], 'arguments': call.get('arguments', {})}}]})
        else:
            messages.append({'role': roles[turn['from']], 'content': turn['value']})
    tools = json.loads(row['tools']) if row.get('tools') else []
    return messages, [{'type': 'function', 'function': t} for t in tools] or None


def _messages(name: str, row: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    if name == 'gsm8k':
        return [{'role': 'user', 'content': row['question']}, {'role': 'assistant', 'content': row['answer']}], None
    if name == 'glaive-toolcall-en-demo':
        return _glaive(row)
    return _alpaca(row)


def load_lengths(data: Path, work_dir: Path) -> dict[str, list[int]]:
    """Templated Qwen2.5 token lengths of every row of every set (cached in ``work_dir/lengths.json``)."""
    from swift_dynamic_callbacks.testing.tiny import materialize_tokenizer
    files = {name: data / rel for name, rel in DATASETS.items()}
    for name, path in files.items():
        if not path.is_file():
            raise SystemExit(f'{name}: {path} not found; pass --data <shared/data directory>')
    key = hashlib.sha256(''.join(f'{p.name}:{p.stat().st_size};' for p in files.values()).encode()).hexdigest()[:16]
    cache = work_dir / 'lengths.json'
    if cache.is_file():
        cached = json.loads(cache.read_text())
        if cached.get('key') == key:
            return cached['lengths']
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(materialize_tokenizer(work_dir / 'qwen2.5-tokenizer'))
    lengths: dict[str, list[int]] = {}
    for name, path in files.items():
        out = []
        for row in _read(path):
            messages, tools = _messages(name, row)
            ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)
            ids = ids['input_ids'] if isinstance(ids, dict) or hasattr(ids, 'keys') else ids
            out.append(len(ids))
        lengths[name] = out
        print(f'[bench] {name}: {len(out)} rows tokenized', file=sys.stderr)
    work_dir.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({'key': key, 'lengths': lengths}))
    return lengths


# ---- the methods ------------------------------------------------------------------------------------------------
def _fixed(order: list[int], size: int) -> list[list[int]]:
    return [order[k:k + size] for k in range(0, len(order), size)]


def random_fixed(lengths: list[int], seed: int) -> list[list[int]]:
    import torch
    return _fixed(torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist(), BATCH)


def group_by_length(lengths: list[int], seed: int) -> list[list[int]]:
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices
    order = get_length_grouped_indices(lengths, BATCH, generator=torch.Generator().manual_seed(seed))
    return _fixed(order, BATCH)


def pack(plan_kwargs: dict[str, Any], cap: int) -> Callable[[list[int], int], list[list[int]]]:
    from swift_dynamic_callbacks.policies.length import BatchPlan, epoch_layout, plan_sizes

    def batches(lengths: list[int], seed: int) -> list[list[int]]:
        import torch
        plan = BatchPlan(seed=seed, **plan_kwargs)
        base = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()  # host order
        order, chunks = epoch_layout(base, lengths, plan, epoch=0)
        sizes = plan_sizes([lengths[i] for i in order], 0, chunks, plan, cap)
        out, at = [], 0
        for size in sizes:
            out.append(order[at:at + size])
            at += size
        return out

    return batches


def measure(lengths: list[int], method: Callable, seeds: list[int]) -> dict[str, float]:
    real = padded = count = samples = 0
    peak, seconds = 0, 0.0
    for seed in seeds:
        start = time.perf_counter()
        batches = method(lengths, seed)
        seconds += time.perf_counter() - start
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # exactly once
        for b in batches:
            longest = max(lengths[i] for i in b)
            real += sum(lengths[i] for i in b)
            padded += len(b) * longest
            peak = max(peak, len(b) * longest)
        count += len(batches)
        samples += len(lengths)
    epochs = len(seeds)
    return {'padding': 1 - real / padded, 'batches': count / epochs, 'tokens_mean': padded / count,
            'tokens_max': peak, 'samples_mean': samples / count, 'plan_ms': 1000 * seconds / epochs}


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__, REPO, 'bench_length')
    parser.add_argument('--data', default=str(REPO.parent / 'shared' / 'data'),
                        help='the shared data directory (default: ../shared/data next to the repository)')
    parser.add_argument('--max-tokens', type=int, default=8192, help='token budget per micro-batch (default 8192)')
    parser.add_argument('--cap', type=int, default=64,
                        help='most samples per micro-batch for the token budget (per_device_train_batch_size)')
    parser.add_argument('--bucket-width', type=float, default=0.03)
    parser.add_argument('--bucket-fill', type=float, default=0.5)
    parser.add_argument('--epochs', type=int, default=3)
    opts = parser.parse_args(argv)
    lengths = load_lengths(Path(opts.data), Path(opts.work_dir))
    lengths['mix (all four)'] = [n for name in DATASETS for n in lengths[name]]
    seeds = [opts.seed + e for e in range(opts.epochs)]
    width = opts.bucket_width
    methods = {
        f'random, batch {BATCH}': random_fixed,
        f'group_by_length (ms-swift/HF), batch {BATCH}': group_by_length,
        f'pack buckets, batch {BATCH}': pack({'mode': 'rules', 'rules': ((0, BATCH), ), 'bucket_width': width,
                                                 'bucket_fill': opts.bucket_fill}, BATCH),
        f'pack token budget {opts.max_tokens}, cap {opts.cap}': pack(
            {'mode': 'token_budget', 'micro_batch_tokens': opts.max_tokens, 'bucket_width': width,
             'bucket_fill': opts.bucket_fill}, opts.cap),
        f'pack token budget {opts.max_tokens}, cap {opts.cap}, no buckets': pack(
            {'mode': 'token_budget', 'micro_batch_tokens': opts.max_tokens, 'bucketing': False}, opts.cap),
    }
    results: dict[str, dict[str, dict[str, float]]] = {}
    lines = machine_lines(['python', 'scripts/bench_length.py'] + list(argv if argv is not None else sys.argv[1:]))
    lines += ['', f'Epochs per figure: {opts.epochs} (seeds {seeds[0]}..{seeds[-1]}); bucket width {width}, fill '
              f'{opts.bucket_fill}; '
              'lengths: Qwen2.5-Instruct chat template, real Qwen2.5 tokenizer.', '',
              '| dataset (rows) | method | padding | micro-batches / epoch | padded tokens / batch (mean) | '
              'padded tokens / batch (max) | samples / batch | plan ms / epoch |',
              '|---|---|---:|---:|---:|---:|---:|---:|']
    for name, values in lengths.items():
        results[name] = {}
        over = sum(1 for n in values if n > opts.max_tokens)
        for label, method in methods.items():
            r = measure(values, method, seeds)
            results[name][label] = r
            lines.append(f'| {name} ({len(values)}) | {label} | {100 * r["padding"]:.1f} % | {r["batches"]:.0f} | '
                         f'{r["tokens_mean"]:.0f} | {r["tokens_max"]} | {r["samples_mean"]:.1f} | '
                         f'{r["plan_ms"]:.1f} |')
        if over:
            lines.append(f'| {name} | ({over} sample(s) longer than {opts.max_tokens}: alone in their micro-batch, '
                         'over the budget) | | | | | | |')
    print('\n'.join(lines))
    if opts.json:
        with open(opts.json, 'w', encoding='utf-8') as f:
            json.dump({'options': vars(opts), 'results': results}, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())

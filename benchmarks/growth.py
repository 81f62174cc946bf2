#!/usr/bin/env python
"""Batch growth vs. fixed small and fixed large batches: steps, samples, time, loss (a benchmark, not a test).

One Python process builds the tiny Qwen2 model and a gsm8k dataset (offline,
:mod:`swift_dynamic_callbacks.testing.tiny`) in ``--work-dir`` and runs three in-process ``sft_main`` LoRA trainings
on the same data, model, seed and LR
configuration (``learning_rate`` 1e-3, ``lr_scheduler_type`` cosine, ms-swift's default warmup_ratio 0), each for
``--epochs`` epochs (``num_train_epochs``), ``gradient_accumulation_steps`` 1, ``logging_steps`` 1, no checkpoint,
``dataloader_num_workers`` 0:

- ``fixed-small``: plain ms-swift (no callbacks), per-device batch ``--small``;
- ``fixed-large``: plain ms-swift (no callbacks), per-device batch ``--large``;
- ``growth``: ``swift_dynamic_callbacks.register(batch_growth={...})`` with ``callbacks=['batch_growth']``:
  policy ``interval``, ``initial`` = ``--small``, ``factor`` 2, ``maximum`` = ``--large``, ``lr_scaling`` sqrt,
  ``reference_batch`` = ``--small``. The interval (unless ``--interval`` is given) is the largest number of steps
  for which the whole growth (small -> 2 small -> ... -> large) uses at most half of the run's samples, so the
  batch reaches ``--large`` within the first half of the data.

For every run the table shows: optimizer steps, samples seen (``dynamic/samples_seen`` of the last training line
of ``logging.jsonl`` where present, else steps x batch), ``train_runtime`` (HF's summary line in ``logging.jsonl``:
the training loop only, no model/data loading), samples/s (samples seen / train_runtime), the final training loss
(mean of the last 5 logged losses), the learning rate at the last step, the 1-minute load average before the run,
and the whole ``sft_main`` wall time. For the growth run the batch sizes over time are listed from
``dynamic_decisions.jsonl`` (one record per change, with the LR scale), and the integration's own records (the
scheduler horizon / ``max_steps`` it derived for the epoch budget).

Caveats printed with the table: the losses are training losses at different batch sizes (a mean of 5 logged
values that average 5 x batch samples), not an evaluation; on a machine shared with other jobs the times measure
that load as well (the load average is shown before and after every run).

Usage (from the repository root)::

    python scripts/bench_growth.py                               # 64 rows, 2 epochs, batch 1 / 8 / growth 1 -> 8
    python scripts/bench_growth.py --rows 128 --epochs 1 --small 2 --large 16 --threads 0

Default runtime, measured on a 2-core CPU machine with another job's pytest running beside it (load average 2.4-2.9):
3 min 20 s with the default ``--threads 1``; the same run with torch's own 2 threads (``--threads 0``) took 10
minutes there.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import base_parser, machine_lines

REPO = Path(__file__).resolve().parent.parent
LAST_LOSSES = 5

os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')


def growth_sizes(small: int, large: int, factor: float = 2.0) -> list[int]:
    """The batch sizes of the interval policy from ``small`` to ``large`` (same rounding as the policy)."""
    from swift_dynamic_callbacks.policies.growth import interval_size
    sizes = [small]
    k = 1
    while sizes[-1] < large:
        sizes.append(interval_size(k, initial=small, factor=factor, interval=1, maximum=large, delay=0))
        k += 1
    return sizes


def choose_interval(small: int, large: int, total_samples: int) -> int:
    """Largest interval (>= 1) with which the growth to ``large`` uses at most half of ``total_samples``."""
    before_max = sum(growth_sizes(small, large)[:-1])  # samples per "interval" step spent below the maximum
    return max(1, (total_samples // 2) // max(before_max, 1))


def _sft_kwargs(model: str, dataset: str, output_dir: str, opts: argparse.Namespace, batch: int,
                callbacks: list[str]) -> dict[str, Any]:
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
    return offline_sft_kwargs(
        model,
        dataset,
        output_dir,
        max_steps=-1,
        num_train_epochs=opts.epochs,
        per_device_train_batch_size=batch,
        lr_scheduler_type='cosine',
        save_strategy='no',
        seed=opts.seed,
        data_seed=opts.seed,
        disable_tqdm=True,
        callbacks=callbacks,
    )


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding='utf-8') as f:
        return [json.loads(line) for line in f if line.strip()]


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, 'getloadavg') else None


def _run(name: str, batch: int, model: str, dataset: str, opts: argparse.Namespace,
         growth: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``sft_main`` run; returns the figures read back from its ``logging.jsonl`` / ``dynamic_decisions.jsonl``."""
    from swift import SftArguments, sft_main
    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin

    output_dir = os.path.join(opts.work_dir, 'runs', name)
    shutil.rmtree(output_dir, ignore_errors=True)
    if growth is not None:
        sdc.register(batch_growth=growth)
        callbacks = ['batch_growth']
    else:
        plugin.unregister()  # plain ms-swift: no pack callback listed, no settings left over
        callbacks = []
    gc.collect()
    load_before = _load()
    log = io.StringIO()
    redirect = (contextlib.redirect_stdout(log), contextlib.redirect_stderr(log)) if opts.quiet else ()
    try:
        with contextlib.ExitStack() as stack:
            for r in redirect:
                stack.enter_context(r)
            if opts.quiet:  # the loggers hold the original stderr: silence INFO (warnings still show)
                logging.disable(logging.INFO)
                stack.callback(logging.disable, logging.NOTSET)
            t0 = time.perf_counter()
            sft_main(SftArguments(**_sft_kwargs(model, dataset, output_dir, opts, batch, callbacks)))
            wall = time.perf_counter() - t0
    except BaseException:
        sys.stderr.write(log.getvalue()[-20000:])  # the hidden ms-swift output of the failed run
        raise
    finally:
        plugin.unregister()
    load_after = _load()

    lines = _read_jsonl(os.path.join(output_dir, 'logging.jsonl'))
    train = [row for row in lines if 'loss' in row]
    summary = next((row for row in reversed(lines) if 'train_runtime' in row), {})
    if not train or not summary:
        raise RuntimeError(f'{name}: no training lines or no summary line in {output_dir}/logging.jsonl')
    progress = str(summary.get('global_step/max_steps') or train[-1].get('global_step/max_steps', ''))
    steps = int(progress.split('/')[0]) if progress.split('/')[0].isdigit() else len(train)
    if 'dynamic/samples_seen' in train[-1]:
        samples, samples_from = int(train[-1]['dynamic/samples_seen']), 'dynamic/samples_seen'
    else:
        samples, samples_from = steps * batch, 'steps x batch'
    runtime = float(summary['train_runtime'])
    losses = [float(row['loss']) for row in train]
    decisions = _read_jsonl(os.path.join(output_dir, 'dynamic_decisions.jsonl'))
    args_file = os.path.join(output_dir, 'args.json')
    run_args: dict[str, Any] = {}
    if os.path.exists(args_file):
        with open(args_file, encoding='utf-8') as f:
            run_args = json.load(f)
    return {
        'name': name,
        'batch': batch,
        'steps': steps,
        'samples': samples,
        'samples_from': samples_from,
        'train_runtime': runtime,
        'samples_per_s': samples / runtime if runtime > 0 else float('nan'),
        'hf_samples_per_s': summary.get('train_samples_per_second'),
        'final_loss': statistics.fmean(losses[-LAST_LOSSES:]),
        'train_loss': summary.get('train_loss'),
        'last_lr': train[-1].get('learning_rate'),
        'epoch': summary.get('epoch'),
        'wall_s': wall,
        'load_before': load_before,
        'load_after': load_after,
        'losses': losses,
        'batch_by_step': [row.get('dynamic/batch_size') for row in train],
        'decisions': decisions,
        'output_dir': output_dir,
        'warmup': f'{run_args.get("warmup_ratio", "?")} (warmup_steps {run_args.get("warmup_steps", "?")})',
    }


def _fmt_load(x: float | None) -> str:
    return '-' if x is None else f'{x:.2f}'


def _growth_timeline(result: dict[str, Any]) -> list[str]:
    """The growth run's batch sizes over time, from its decision log."""
    out: list[str] = []
    sizes = [d for d in result['decisions'] if d.get('source') == 'batch_growth' and d.get('kind') == 'batch_size']
    if sizes:
        parts = []
        for d in sizes:
            v = d.get('values', {})
            parts.append(f'{v.get("new")} from step {d.get("step")} (samples seen {d.get("samples_seen")}, '
                         f'lr x{float(v.get("lr_scale", 1.0)):.4g}, {d.get("reason")})')
        out.append('- batch size over time (dynamic_decisions.jsonl): ' + ' → '.join(parts))
    else:
        out.append('- batch size over time: no batch_growth decision recorded')
    steps_at: dict[int, int] = {}
    for size in result['batch_by_step']:
        if size is not None:
            steps_at[size] = steps_at.get(size, 0) + 1
    if steps_at:
        out.append('- optimizer steps per batch size (logging.jsonl `dynamic/batch_size`): ' +
                   ', '.join(f'{size}: {n}' for size, n in sorted(steps_at.items())))
    for d in result['decisions']:
        if d.get('source') == 'integration':
            out.append(f'- integration record at step {d.get("step")}: {d.get("kind")} ({d.get("reason")}) '
                       f'{json.dumps(d.get("values", {}))}' + (f' — {d["message"]}' if d.get('message') else ''))
    return out


def _report(results: list[dict[str, Any]], opts: argparse.Namespace, argv: list[str], growth: dict[str, Any],
            setup_s: float, total_s: float, load_start: float | None, load_end: float | None,
            dataset_rows: int) -> str:
    lines: list[str] = []
    add = lines.append
    add('## Batch growth vs. fixed batches (same data, model, seed and LR configuration)')
    add('')
    lines.extend(machine_lines(argv))
    add(f'Load average (1 min) at start {_fmt_load(load_start)}, at end {_fmt_load(load_end)} '
        f'(a 2-core machine shared with other jobs shows in every time below)')
    warmup = ' / '.join(sorted({r['warmup'] for r in results}))
    add(f'Setup: tiny Qwen2 (hidden 64, 2 layers, real 151936 vocab) LoRA fp32, gsm8k {opts.rows} rows written '
        f'({dataset_rows} in ms-swift\'s train set), num_train_epochs {opts.epochs}, grad accum 1, workers 0, '
        f'learning_rate 1e-3, lr_scheduler_type cosine, warmup_ratio {warmup}, logging_steps 1, '
        f'save_strategy no, seed {opts.seed}.')
    add(f'Growth: `batch_growth={json.dumps(growth)}`'
        + ('' if opts.interval is not None else ' (interval chosen so the growth uses at most half of the samples)'))
    add('')
    add('| run | per-device batch | optimizer steps | samples seen | train_runtime (s) | samples/s | '
        f'final loss (mean of last {LAST_LOSSES}) | HF train_loss (mean) | LR at last step | load avg before / after '
        '| sft_main wall (s) |')
    add('|---|---|---|---|---|---|---|---|---|---|---|')
    for r in results:
        batch = (f'{opts.small} → {opts.large}' if r['name'] == 'growth' else str(r['batch']))
        samples = f'{r["samples"]}' + ('' if r['samples_from'] == 'dynamic/samples_seen' else ' (steps x batch)')
        last_lr = '-' if r['last_lr'] is None else f'{float(r["last_lr"]):.3g}'
        train_loss = '-' if r['train_loss'] is None else f'{float(r["train_loss"]):.4f}'
        add(f'| {r["name"]} | {batch} | {r["steps"]} | {samples} | {r["train_runtime"]:.2f} | '
            f'{r["samples_per_s"]:.2f} | {r["final_loss"]:.4f} | {train_loss} | {last_lr} | '
            f'{_fmt_load(r["load_before"])} / {_fmt_load(r["load_after"])} | {r["wall_s"]:.1f} |')
    add('')
    by_name = {r['name']: r for r in results}
    small, large, grow = by_name['fixed-small'], by_name['fixed-large'], by_name['growth']
    add('Ratios (growth vs. fixed): '
        f'train_runtime growth/small {grow["train_runtime"] / small["train_runtime"]:.3f}, '
        f'growth/large {grow["train_runtime"] / large["train_runtime"]:.3f}; '
        f'steps growth/small {grow["steps"] / small["steps"]:.3f}, growth/large {grow["steps"] / large["steps"]:.3f}')
    add('')
    add('Growth run:')
    lines.extend(_growth_timeline(grow))
    add('')
    add('Notes:')
    add('- samples seen: `dynamic/samples_seen` where the pack logs it (growth run); for the plain runs steps x batch '
        '(an upper bound when the row count is not a multiple of the batch: the last batch of an epoch is short).')
    add(f'- final loss is the training loss of the last {LAST_LOSSES} logged steps, each averaged over its own batch '
        '(so 5 x batch samples, different data at each batch size): a coarse figure, not an evaluation.')
    add('- train_runtime is HF\'s training-loop time (no model/data loading); samples/s = samples seen / '
        'train_runtime.')
    add('- LR at last step: the growth run\'s cosine schedule is planned for the epoch budget at the initial batch '
        'size and stretched at every growth (integration max_steps records) so it ends with the data, like the '
        'fixed runs\' schedules.')
    add(f'- time: setup (model + data) {setup_s:.1f} s, benchmark total {total_s:.1f} s')
    return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__, REPO, 'bench-growth')
    parser.add_argument('--rows', type=int, default=64, help='gsm8k rows (default 64)')
    parser.add_argument('--epochs', type=float, default=2, help='num_train_epochs of every run (default 2)')
    parser.add_argument('--small', type=int, default=1, help='small per-device batch, growth start (default 1)')
    parser.add_argument('--large', type=int, default=8, help='large per-device batch, growth maximum (default 8)')
    parser.add_argument('--interval', type=int, default=None,
                        help='growth interval in optimizer steps (default: growth done within half of the samples)')
    parser.add_argument('--threads', type=int, default=1,
                        help='torch.set_num_threads for all runs (default 1; 0: torch\'s own choice). With 2 '
                        'threads on a 2-core machine that also runs other jobs, a step can take ~10x longer (the '
                        'threads wait for each other); 1 thread keeps the default run in a few minutes')
    opts = parser.parse_args(argv)
    from swift_dynamic_callbacks.testing.tiny import GSM8K_ROWS, build_tiny_model, write_gsm8k_dataset
    if not 1 <= opts.rows <= GSM8K_ROWS:
        parser.error(f'--rows must be between 1 and {GSM8K_ROWS}')
    if opts.small < 1 or opts.large <= opts.small:
        parser.error('need 1 <= --small < --large')
    if opts.epochs <= 0:
        parser.error('--epochs must be > 0')
    if opts.epochs == int(opts.epochs):
        opts.epochs = int(opts.epochs)
    opts.work_dir = os.path.abspath(opts.work_dir)

    if opts.threads < 0:
        parser.error('--threads must be >= 0')
    if opts.threads > 0:
        import torch
        torch.set_num_threads(opts.threads)
    load_start = _load()
    t_start = time.perf_counter()
    model = str(build_tiny_model(Path(opts.work_dir) / 'tiny-qwen2', 'qwen2'))
    dataset = str(write_gsm8k_dataset(Path(opts.work_dir) / f'gsm8k-{opts.rows}.jsonl', opts.rows))
    import swift_dynamic_callbacks as sdc
    sdc.register()  # put the pack's names into callbacks_map (settings come with the growth run)
    setup_s = time.perf_counter() - t_start

    results: list[dict[str, Any]] = []
    for name, batch in (('fixed-small', opts.small), ('fixed-large', opts.large)):
        results.append(_run(name, batch, model, dataset, opts))
        print(f'[bench] {name}: {results[-1]["steps"]} steps, train_runtime {results[-1]["train_runtime"]:.1f} s, '
              f'wall {results[-1]["wall_s"]:.1f} s', file=sys.stderr, flush=True)
    # the data ms-swift really trains on (it may drop over-long rows): the plain small run's epoch in samples
    dataset_rows = opts.rows
    summary_file = os.path.join(results[0]['output_dir'], 'logging.jsonl')
    for row in _read_jsonl(summary_file):
        text = str(row.get('train_dataset', ''))
        if 'size=' in text:
            dataset_rows = int(text.rsplit('size=', 1)[1].split(',')[0].strip())
    total_samples = math.ceil(dataset_rows * opts.epochs)
    interval = opts.interval if opts.interval is not None else choose_interval(opts.small, opts.large, total_samples)
    growth = {
        'policy': 'interval',
        'initial': opts.small,
        'factor': 2,
        'interval': interval,
        'maximum': opts.large,
        'lr_scaling': 'sqrt',
        'reference_batch': opts.small,
    }
    results.append(_run('growth', opts.small, model, dataset, opts, growth=growth))
    print(f'[bench] growth: {results[-1]["steps"]} steps, train_runtime {results[-1]["train_runtime"]:.1f} s, '
          f'wall {results[-1]["wall_s"]:.1f} s', file=sys.stderr, flush=True)
    total_s = time.perf_counter() - t_start
    load_end = _load()

    argv_shown = [os.path.relpath(sys.executable, os.getcwd()) if sys.executable.startswith(os.getcwd()) else
                  'python', os.path.relpath(os.path.abspath(sys.argv[0]), os.getcwd())] + (
                      sys.argv[1:] if argv is None else list(argv))
    print(_report(results, opts, argv_shown, growth, setup_s, total_s, load_start, load_end, dataset_rows))
    if opts.json:
        with open(opts.json, 'w', encoding='utf-8') as f:
            json.dump({'options': vars(opts), 'growth': growth, 'runs': results}, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())

#!/usr/bin/env python
"""Step-time overhead of the integration installed but idle, vs. plain ms-swift (a benchmark, not a test).

Issue requirement: "Step-time ratio of a run with the integration installed and no change requested vs. plain
ms-swift, same model, data and batch, measured alternately in one run. Target <= 1.02."

One Python process builds the tiny Qwen2 model and a gsm8k dataset (offline,
:mod:`swift_dynamic_callbacks.testing.tiny`) in ``--work-dir`` and then runs ``--rounds`` rounds of two in-process
``sft_main`` LoRA trainings each:

- ``plain``: ms-swift as is;
- ``pack``: ``swift_dynamic_callbacks.register(batch_schedule={'schedule': {0: B}})`` and
  ``callbacks=['batch_schedule']`` with ``B`` the run's own per-device batch size, so the integration is installed
  (elastic loader, step-boundary hooks, log merging) but never changes anything.

The order alternates (plain first in odd rounds, pack first in even rounds) so that drift of the machine (thermal,
page cache, other load) hits both sides alike. Everything else is identical: seed, model, data, batch size,
gradient accumulation, workers, ``max_steps``, ``logging_steps=1``, no checkpoint inside the run.

Step time: both runs also list a timing callback (``bench_step_timer``: the pack's
``swift_dynamic_callbacks.testing.timing.StepTimer``, given to ``run.sft``) that records ``time.perf_counter()``
(and the process CPU time) at every
``on_step_end``. The interval between two consecutive ``on_step_end`` events is one full optimizer step
*including* the data loading (the pack draws its micro-batches in ``get_batch_samples``, before
``on_step_begin``) and the per-step logging. The first ``--warmup`` intervals are dropped; each run is summarised
by the median of the rest. The ratio of a round is ``pack median / plain median``; the headline is the median over
rounds (mean +- std also shown, with the min-step and CPU-time ratios and the 1-minute load average at the start of
each run, to judge how much other load on the machine disturbed the figures). The end-to-end ``train_runtime`` of
each run (HF's summary) is reported alongside, and every round checks that both runs logged the same losses.

``--breakdown`` adds one plain and one pack run (not part of the ratio) whose per-step entry points are clocked
(wall and calling-thread CPU time): HF's ``get_batch_samples`` / ``training_step`` / ``log`` and the
integration's ``next_step`` (with ``ElasticDataLoader.next_step``, ``apply_requests``, ``Decisions.drain``),
``run_micro_batch``, ``after_step`` and ``update_logs``, so any overhead can be pinned to a function in ms/step.

Usage (from the repository root)::

    python scripts/bench_overhead.py                      # 3 rounds x 30 steps, batch 2
    python scripts/bench_overhead.py --rounds 5 --max-steps 50 --batch-size 4 --grad-accum 2 --workers 2
    python scripts/bench_overhead.py --rounds 1 --breakdown               # where a pack step spends its time

On an idle 2-core CPU machine the default run takes about 2-3 minutes (a step of the tiny model is 0.3-0.8 s, mostly
the 151936-way output layer); on a machine shared with other jobs the wall-clock ratio mostly measures their load.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import base_parser, machine_lines

REPO = Path(__file__).resolve().parent.parent
TIMER_NAME = 'bench_step_timer'

os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')


def _sft_kwargs(model: str, dataset: str, output_dir: str, opts: argparse.Namespace, callbacks: list[str]) -> dict:
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
    return offline_sft_kwargs(
        model,
        dataset,
        output_dir,
        max_steps=opts.max_steps,
        per_device_train_batch_size=opts.batch_size,
        gradient_accumulation_steps=opts.grad_accum,
        save_steps=10**6,
        save_strategy='no',
        seed=opts.seed,
        data_seed=opts.seed,
        dataloader_num_workers=opts.workers,
        dataloader_persistent_workers=opts.workers > 0,
        disable_tqdm=True,
        callbacks=callbacks,
    )


def _run(kind: str, round_no: int, model: str, dataset: str, opts: argparse.Namespace,
         tag: str = 'r') -> dict[str, Any]:
    """One ``sft_main`` run (``kind`` is ``plain`` or ``pack``); returns its step times and summary."""
    from swift_dynamic_callbacks import run
    from swift_dynamic_callbacks.testing.timing import StepTimer

    output_dir = os.path.join(opts.work_dir, 'runs', f'{kind}-{tag}{round_no}')
    callbacks, pack = [TIMER_NAME], None  # a plain run lists no pack callback: the pack stays out of it
    if kind == 'pack':
        callbacks, pack = ['batch_schedule', TIMER_NAME], {'batch_schedule': {'schedule': {0: opts.batch_size}}}
    timers = StepTimer.factory()
    gc.collect()
    load = os.getloadavg()[0] if hasattr(os, 'getloadavg') else None
    log = io.StringIO()
    redirect = (contextlib.redirect_stdout(log), contextlib.redirect_stderr(log)) if opts.quiet else ()
    try:
        with contextlib.ExitStack() as stack:
            for r in redirect:
                stack.enter_context(r)
            result = run.sft(_sft_kwargs(model, dataset, output_dir, opts, callbacks), pack=pack,
                             extra={TIMER_NAME: timers})
    except BaseException:
        sys.stderr.write(log.getvalue()[-20000:])  # the hidden ms-swift output of the failed run
        raise
    msg, wall = result.summary, result.wall_s
    if len(timers.timers) != 1:
        raise RuntimeError(f'{kind} run {round_no}: expected one step timer, got {len(timers.timers)}')
    timer = timers.last
    steps = timer.intervals()
    if len(steps) != opts.max_steps:
        raise RuntimeError(f'{kind} run {round_no}: {len(steps)} steps timed, expected {opts.max_steps}')
    measured = steps[opts.warmup:]
    cpu = timer.intervals(1)[opts.warmup:]
    history = msg.get('log_history', []) if isinstance(msg, dict) else []
    summary = next((row for row in reversed(history) if 'train_runtime' in row), {})
    losses = [row['loss'] for row in history if 'loss' in row]
    return {
        'kind': kind,
        'round': round_no,
        'median_s': statistics.median(measured),
        'mean_s': statistics.fmean(measured),
        'min_s': min(measured),
        'p25_s': statistics.quantiles(measured, n=4)[0] if len(measured) >= 2 else measured[0],
        'cpu_median_s': statistics.median(cpu),
        'load_avg_1m': load,
        'steps_s': steps,
        'train_runtime': summary.get('train_runtime'),
        'wall_s': wall,
        'losses': losses,
    }


def _fmt_ms(seconds: float | None) -> str:
    return '-' if seconds is None else f'{seconds * 1e3:.1f}'


def _fmt_s(seconds: float | None) -> str:
    return '-' if seconds is None else f'{seconds:.2f}'


def _mean_std(xs: list[float]) -> str:
    if len(xs) < 2:
        return f'{xs[0]:.4f}' if xs else '-'
    return f'{statistics.fmean(xs):.4f} ± {statistics.stdev(xs):.4f}'


# ---- optional breakdown: where a pack step spends its time (extra runs, not part of the ratio) ----------------


@contextlib.contextmanager
def _timed_hooks(acc: dict[str, list[tuple[float, float]]]):
    """Wrap the integration's per-step entry points (and HF's) with clocks: (wall, CPU time of the calling thread).

    The calling thread's CPU time hardly moves when other processes take the cores, so it is the steadier figure
    on a loaded machine (it leaves out torch's other intra-op threads, so it is not the whole cost of a matmul).

    Only used for the ``--breakdown`` runs; the wrappers cost a few microseconds per call.
    """
    import transformers
    from swift_dynamic_callbacks.integrations import trainer as integ
    from swift_dynamic_callbacks.integrations.decisions import Decisions
    from swift_dynamic_callbacks.data.elastic import ElasticDataLoader

    patched: list[tuple[Any, str, Any]] = []

    def clock(label: str, fn):

        def wrapped(*args, **kwargs):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc.setdefault(label, []).append((time.perf_counter() - t, time.thread_time() - c))

        return wrapped

    def patch(owner: Any, name: str, label: str) -> None:
        original = owner.__dict__[name]
        patched.append((owner, name, original))
        setattr(owner, name, clock(label, original))

    hf = transformers.Trainer
    patch(hf, 'get_batch_samples', 'Trainer.get_batch_samples (HF; plain: fetch+collate+count, pack: count only)')
    patch(hf, 'training_step', 'Trainer.training_step (HF: forward+backward)')
    patch(hf, 'log', 'Trainer.log (HF)')
    patch(integ.Integration, 'next_step', 'Integration.next_step (pack: whole get_batch_samples)')
    patch(integ.Integration, 'apply_requests', '  Integration.apply_requests')
    patch(Decisions, 'drain', '  Decisions.drain (all calls)')
    patch(ElasticDataLoader, 'next_step', '  ElasticDataLoader.next_step (fetch+collate)')
    patch(integ.Integration, 'run_micro_batch', 'Integration.run_micro_batch (wraps training_step)')
    patch(integ.Integration, 'after_step', 'Integration.after_step (on_step_end)')
    patch(integ.Integration, 'update_logs', 'Integration.update_logs (in log)')
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def _breakdown(model: str, dataset: str, opts: argparse.Namespace) -> str:
    rows: dict[str, dict[str, list[tuple[float, float]]]] = {}
    steps: dict[str, float] = {}
    for kind in ('plain', 'pack'):
        acc: dict[str, list[tuple[float, float]]] = {}
        with _timed_hooks(acc):
            result = _run(kind, 0, model, dataset, opts, tag='breakdown')
        rows[kind] = acc
        steps[kind] = result['median_s']
    n = opts.max_steps
    labels = sorted({label for acc in rows.values() for label in acc}, key=lambda name: (name.startswith(' '), name))
    ordered: list[str] = []
    for label in (name for name in labels if not name.startswith(' ')):
        ordered.append(label)
        if label.startswith('Integration.next_step'):
            ordered.extend(name for name in labels if name.startswith('  '))

    def total(kind: str, prefix: str, which: int) -> float:
        return sum(call[which] for label, calls in rows[kind].items() if label.startswith(prefix) for call in calls)

    def ms(x: float) -> str:
        return f'{x / n * 1e3:.3f}'

    lines = [
        '',
        f'### Breakdown (one extra plain and one extra pack run with clocked hooks, {n} steps each, not part of '
        'the ratio): ms per optimizer step = total over the run / steps',
        '',
        '| function | plain wall | plain thread-CPU | pack wall | pack thread-CPU |',
        '|---|---|---|---|---|',
    ]
    for label in ordered:
        cells = []
        for kind in ('plain', 'pack'):
            calls = rows[kind].get(label)
            cells += ['-', '-'] if not calls else [ms(sum(c[0] for c in calls)), ms(sum(c[1] for c in calls))]
        lines.append(f'| {label.replace("|", "/")} | {" | ".join(cells)} |')
    lines.append(f'| median step (on_step_end interval, wall) | {steps["plain"] * 1e3:.1f} | | '
                 f'{steps["pack"] * 1e3:.1f} | |')
    figures = []
    for which, name in ((0, 'wall'), (1, 'thread-CPU')):
        own = (total('pack', 'Integration.next_step', which) - total('pack', 'Trainer.get_batch_samples', which) -
               total('pack', '  ElasticDataLoader.next_step', which) + total('pack', 'Integration.after_step', which) +
               total('pack', 'Integration.update_logs', which) + total('pack', 'Integration.run_micro_batch', which) -
               total('pack', 'Trainer.training_step', which))
        data = total('pack', 'Integration.next_step', which) - total('plain', 'Trainer.get_batch_samples', which)
        figures.append(f'{name}: bookkeeping {ms(own)} ms, data path pack - plain {ms(data)} ms')
    lines += [
        '',
        '- pack bookkeeping per step = next_step without the fetch and HF\'s own count + after_step + update_logs + '
        'the run_micro_batch wrapper; data path = pack next_step - plain HF get_batch_samples:',
        f'  {"; ".join(figures)}',
    ]
    return '\n'.join(lines)


def _report(results: list[tuple[dict, dict]], opts: argparse.Namespace, argv: list[str], setup_s: float,
            total_s: float) -> str:
    lines: list[str] = []
    add = lines.append
    add('## Integration overhead: installed, no change requested, vs. plain ms-swift')
    add('')
    lines.extend(machine_lines(argv))
    add(f'Setup: tiny Qwen2 (hidden 64, 2 layers, real 151936 vocab) LoRA fp32, gsm8k {opts.rows} rows, '
        f'per-device batch {opts.batch_size}, grad accum {opts.grad_accum}, workers {opts.workers}, '
        f'max_steps {opts.max_steps}, logging_steps 1, seed {opts.seed}. Per run: steps '
        f'{opts.warmup + 1}..{opts.max_steps} (first {opts.warmup} dropped); a step is the interval between '
        'consecutive on_step_end events (includes data loading and logging).')
    add('')
    add('| round | order | plain median step (ms) | pack median step (ms) | **ratio (median)** | '
        'plain / pack min step (ms) | ratio (min) | plain / pack median CPU time (ms) | ratio (CPU) | '
        'paired per-step ratio (median) | plain / pack train_runtime (s) | load avg at start plain / pack | '
        'same losses |')
    add('|---|---|---|---|---|---|---|---|---|---|---|---|---|')
    ratios, min_ratios, cpu_ratios, paired_ratios, runtime_ratios = [], [], [], [], []
    for plain, pack in results:
        ratio = pack['median_s'] / plain['median_s']
        min_ratio = pack['min_s'] / plain['min_s']
        ratios.append(ratio)
        min_ratios.append(min_ratio)
        cpu_ratio = pack['cpu_median_s'] / plain['cpu_median_s']
        cpu_ratios.append(cpu_ratio)
        # both runs train on the same batches in the same order: step i of one is comparable with step i of the other
        paired = statistics.median(
            b / a for a, b in zip(plain['steps_s'][opts.warmup:], pack['steps_s'][opts.warmup:]))
        paired_ratios.append(paired)
        if plain['train_runtime'] and pack['train_runtime']:
            runtime_ratios.append(pack['train_runtime'] / plain['train_runtime'])
        order = 'plain, pack' if plain['round'] % 2 == 1 else 'pack, plain'
        same = 'yes' if plain['losses'] == pack['losses'] and plain['losses'] else 'NO'
        load = ' / '.join('-' if r['load_avg_1m'] is None else f'{r["load_avg_1m"]:.2f}' for r in (plain, pack))
        add(f'| {plain["round"]} | {order} | {_fmt_ms(plain["median_s"])} | {_fmt_ms(pack["median_s"])} | '
            f'**{ratio:.4f}** | {_fmt_ms(plain["min_s"])} / {_fmt_ms(pack["min_s"])} | {min_ratio:.4f} | '
            f'{_fmt_ms(plain["cpu_median_s"])} / {_fmt_ms(pack["cpu_median_s"])} | {cpu_ratio:.4f} | {paired:.4f} | '
            f'{_fmt_s(plain["train_runtime"])} / {_fmt_s(pack["train_runtime"])} | {load} | {same} |')
    add('')
    headline = statistics.median(ratios)
    verdict = 'PASS' if headline <= opts.target else 'FAIL'
    add(f'**Step-time ratio pack/plain (median over rounds of the per-run median ratios): {headline:.4f}** '
        f'(target <= {opts.target}: {verdict})')
    add('')
    add(f'- per-round median-step ratios: mean ± std = {_mean_std(ratios)}')
    add(f'- per-round min-step ratios (least disturbed by other load): mean ± std = {_mean_std(min_ratios)}')
    add(f'- per-round median CPU-time ratios (process CPU time per step, all threads): mean ± std = '
        f'{_mean_std(cpu_ratios)}')
    add(f'- per-round paired per-step ratios (step i of pack / step i of plain: same batch): mean ± std = '
        f'{_mean_std(paired_ratios)}')
    if runtime_ratios:
        add(f'- end-to-end train_runtime ratios: mean ± std = {_mean_std(runtime_ratios)}')
    add(f'- time: setup (model + data) {setup_s:.1f} s, benchmark total {total_s:.1f} s')
    return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__, REPO, 'bench')
    parser.add_argument('--rounds', type=int, default=3, help='alternating plain/pack rounds (default 3)')
    parser.add_argument('--max-steps', type=int, default=30, help='optimizer steps per run (default 30)')
    parser.add_argument('--batch-size', type=int, default=2, help='per-device train batch size (default 2)')
    parser.add_argument('--grad-accum', type=int, default=1, help='gradient accumulation steps (default 1)')
    parser.add_argument('--workers', type=int, default=0, help='dataloader_num_workers (default 0)')
    parser.add_argument('--warmup', type=int, default=5, help='first steps of each run left out (default 5)')
    parser.add_argument('--rows', type=int, default=None,
                        help='gsm8k rows (default: enough for one epoch of the run, at most 500)')
    parser.add_argument('--threads', type=int, default=None,
                        help='torch.set_num_threads for both sides (default: torch\'s own choice); 1 keeps a second '
                        'core free, which steadies the figures on a machine shared with other jobs')
    parser.add_argument('--target', type=float, default=1.02, help='ratio target printed as PASS/FAIL (1.02)')
    parser.add_argument('--breakdown', action='store_true',
                        help='afterwards, one more plain and pack run with timed hooks: ms per step in each of the '
                        'integration\'s entry points (not part of the ratio)')
    opts = parser.parse_args(argv)
    if opts.rounds < 1 or opts.max_steps < 2 or not 0 <= opts.warmup < opts.max_steps - 1:
        parser.error('need --rounds >= 1 and 0 <= --warmup < --max-steps - 1')
    from swift_dynamic_callbacks.testing.tiny import GSM8K_ROWS, build_tiny_model, write_gsm8k_dataset
    if opts.rows is None:
        opts.rows = min(GSM8K_ROWS, max(16, opts.max_steps * opts.batch_size * opts.grad_accum))
    opts.work_dir = os.path.abspath(opts.work_dir)

    if opts.threads is not None:
        import torch
        torch.set_num_threads(opts.threads)
    t_start = time.perf_counter()
    model = str(build_tiny_model(Path(opts.work_dir) / 'tiny-qwen2', 'qwen2'))
    dataset = str(write_gsm8k_dataset(Path(opts.work_dir) / f'gsm8k-{opts.rows}.jsonl', opts.rows))
    setup_s = time.perf_counter() - t_start

    results: list[tuple[dict, dict]] = []
    for round_no in range(1, opts.rounds + 1):
        order = ('plain', 'pack') if round_no % 2 == 1 else ('pack', 'plain')
        runs = {}
        for kind in order:
            runs[kind] = _run(kind, round_no, model, dataset, opts)
            print(f'[bench] round {round_no} {kind:5s}: median step {_fmt_ms(runs[kind]["median_s"])} ms, '
                  f'train_runtime {runs[kind]["train_runtime"]} s, run wall {runs[kind]["wall_s"]:.1f} s',
                  file=sys.stderr, flush=True)
        results.append((runs['plain'], runs['pack']))
    total_s = time.perf_counter() - t_start

    argv_shown = [os.path.relpath(sys.executable, os.getcwd()) if sys.executable.startswith(os.getcwd()) else
                  'python', os.path.relpath(os.path.abspath(sys.argv[0]), os.getcwd())] + (
                      sys.argv[1:] if argv is None else list(argv))
    report = _report(results, opts, argv_shown, setup_s, total_s)
    if opts.breakdown:
        report += '\n' + _breakdown(model, dataset, opts)
    print(report)
    if opts.json:
        with open(opts.json, 'w', encoding='utf-8') as f:
            json.dump({'options': vars(opts), 'runs': [r for pair in results for r in pair]}, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())

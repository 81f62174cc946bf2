#!/usr/bin/env python
"""Passes over an epoch when memory ends below ``pass_tokens`` (a benchmark that counts, not a timed test).

Three in-process ``sft_main`` LoRA runs of the tiny Qwen2 model, one epoch of mixed-length GSM8K rows
(``write_mixed_length_dataset``: 1 to 6 problems a row), ``length_batching`` ``mode: balanced``, per-device
``--batch`` x ``gradient_accumulation_steps`` ``--ga``, LoRA dropout 0, constant LR, the same seed and samples:

- ``no_oom``: ``pass_tokens: --pass-tokens`` on a device without a memory end (the reference losses);
- ``oom``: the same settings on a device whose memory ends at ``--memory-end`` tokens a pass (the pack's
  :class:`~swift_dynamic_callbacks.testing.faults.OomInjector`: a forward over more tokens raises
  ``torch.OutOfMemoryError``), as a user who copied a budget too large for the card;
- ``planned``: ``pass_tokens: --memory-end`` on that device, i.e. planned at the memory end from the start.

Printed: forward/backward passes over the epoch (every pass the model ran, the failed ones included), OOMs, the
``pass_budget`` records (the token budget after each OOM and each grow-back), the passes of ``oom`` against
``planned`` (goal <= 1.5x) and the largest step-loss difference between ``oom`` and ``no_oom`` (the same steps: the
same losses). Rows are truncated to ``--memory-end`` tokens (``truncation_strategy: right``) so that every sample fits
alone, as on a card that can train them at all.

    python scripts/bench_memory_end.py                      # 160 rows, 4 x GA 4, pass_tokens 1200, memory end 900
    python scripts/bench_memory_end.py --data gsm8k        # one problem a row: many rows a pass
    python scripts/bench_memory_end.py --rows 32 --batch 2 --ga 2 --steps 300   # a long run: OOMs stay bounded
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from benchmarks.common import base_parser, machine_lines, quiet_run

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')


def run_arm(name: str, opts, model: str, dataset: str, pass_tokens: int, memory_end: int | None) -> dict:
    """One run; returns its passes, OOMs, step losses and ``pass_budget`` records."""
    from swift import SftArguments, sft_main

    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs

    out = os.path.join(opts.work_dir, name)
    shutil.rmtree(out, ignore_errors=True)  # ms-swift appends to an existing logging.jsonl
    sdc.register(length_batching={'mode': 'balanced', 'pass_tokens': pass_tokens})
    kwargs = offline_sft_kwargs(
        model, dataset, out, arch='qwen2', callbacks=['length_batching'], max_steps=opts.steps or -1,
        num_train_epochs=1 if not opts.steps else 1000,
        per_device_train_batch_size=opts.batch, gradient_accumulation_steps=opts.ga, lora_dropout=0.0,
        learning_rate=1e-3, lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=100_000, seed=opts.seed,
        max_length=opts.memory_end, truncation_strategy='right')
    try:
        with quiet_run(opts.quiet), OomInjector(token_budget=memory_end) as injector:
            sft_main(SftArguments(**kwargs))
    finally:
        plugin.unregister()
    rows = [json.loads(line) for line in open(os.path.join(out, 'logging.jsonl'))]
    steps = [r for r in rows if 'loss' in r]
    records = [json.loads(line) for line in open(os.path.join(out, 'dynamic_decisions.jsonl'))]
    return {
        'passes': len(injector.passes),
        'logged_passes': sum(r['dynamic/passes_per_step'] for r in steps),
        'ooms': injector.counts['forward'] + injector.counts['backward'],
        'largest_pass_tokens': max(t for _, t in injector.passes),
        'losses': [r['loss'] for r in steps],
        'budgets': [(r['step'], r['reason'], r['values']['old'], r['values']['new'])
                    for r in records if r['kind'] == 'pass_budget'],
        'steps': len(steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__, REPO, 'bench-memory-end')
    parser.add_argument('--rows', type=int, default=160)
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--ga', type=int, default=4)
    parser.add_argument('--pass-tokens', type=int, default=1200, help='the budget the user set')
    parser.add_argument('--steps', type=int, default=None, help='run this many optimizer steps (epochs as needed) '
                        'instead of one epoch')
    parser.add_argument('--memory-end', type=int, default=900, help='tokens a pass on the simulated device')
    parser.add_argument('--data', choices=('mixed', 'gsm8k'), default='mixed',
                        help='mixed: 1-6 GSM8K problems a row (100-1,300 tokens); gsm8k: one problem a row (short '
                        'rows: many a pass, where a row cap after an OOM costs most)')
    opts = parser.parse_args(argv)
    if opts.memory_end >= opts.pass_tokens:
        parser.error(f'--memory-end: must be below --pass-tokens ({opts.pass_tokens}), got {opts.memory_end}')
    import torch

    from swift_dynamic_callbacks.testing.tiny import build_tiny_model, write_gsm8k_dataset, write_mixed_length_dataset
    torch.set_num_threads(1)
    os.makedirs(opts.work_dir, exist_ok=True)
    model = str(build_tiny_model(Path(opts.work_dir) / 'tiny-qwen2', 'qwen2'))
    write = write_mixed_length_dataset if opts.data == 'mixed' else write_gsm8k_dataset
    dataset = str(write(Path(opts.work_dir) / f'{opts.data}.jsonl', opts.rows))
    arms = {
        'no_oom': run_arm('no_oom', opts, model, dataset, opts.pass_tokens, None),
        'oom': run_arm('oom', opts, model, dataset, opts.pass_tokens, opts.memory_end),
        'planned': run_arm('planned', opts, model, dataset, opts.memory_end, opts.memory_end),
    }
    ratio = arms['oom']['passes'] / arms['planned']['passes']
    diff = max(abs(a - b) for a, b in zip(arms['oom']['losses'], arms['no_oom']['losses']))
    same_steps = arms['oom']['steps'] == arms['no_oom']['steps']
    lines = ['# Passes when memory ends below pass_tokens', '']
    lines += machine_lines([sys.argv[0]] + list(argv if argv is not None else sys.argv[1:]))
    lines += ['', f'{opts.rows} {opts.data} rows, {f"{opts.steps} steps" if opts.steps else "one epoch"}, balanced '
              f'{opts.batch} x GA {opts.ga}, pass_tokens '
              f'{opts.pass_tokens}, memory end {opts.memory_end} tokens a pass', '',
              '| run | passes (failed ones included) | OOMs | optimizer steps | largest pass tried (tokens) |',
              '|---|---:|---:|---:|---:|']
    for name, arm in arms.items():
        lines.append(f'| {name} | {arm["passes"]} | {arm["ooms"]} | {arm["steps"]} | {arm["largest_pass_tokens"]} |')
    lines += ['', f'pass_budget records of `oom` (step, reason, old, new): {arms["oom"]["budgets"]}', '',
              f'passes `oom` / `planned`: **{ratio:.2f}x** (goal <= 1.5x)',
              f'largest step-loss difference `oom` vs `no_oom`: {diff:.2e} (same steps: {same_steps})']
    print('\n'.join(lines))
    if opts.json:
        with open(opts.json, 'w') as f:
            json.dump({'arms': arms, 'ratio': ratio, 'loss_diff': diff}, f, indent=1)
    return 0 if same_steps and ratio <= 1.5 and diff < 1e-4 else 1


if __name__ == '__main__':
    sys.exit(main())

#!/usr/bin/env python
"""The wall-time cost of one OOM recovery, in step-times (a benchmark, not a test).

Two in-process ``sft_main`` LoRA runs of the tiny Qwen2 model on gsm8k (offline, built in ``--work-dir``), same
data, seed and settings (per-device batch ``--batch``, ``gradient_accumulation_steps`` ``--ga``, ``--steps``
steps, constant LR, ``lora_dropout`` 0):

- ``baseline``: no OOM;
- ``oom``: :class:`swift_dynamic_callbacks.testing.faults.OomInjector` raises ``torch.OutOfMemoryError`` in the middle
  of the backward of the *last* micro-batch of step ``--oom-step``. LoRA's gradients are restored from the
  snapshot taken before that micro-batch, which runs again at half the pass size; with ``--no-snapshot`` the
  integration takes its full-fine-tune path instead and runs every micro-batch of the step again (the worst
  case: the OOM in the last one).

Per-step wall times come from a timing callback (``on_step_begin`` -> ``on_step_end``). Printed: the median step
time before the OOM, the OOM step's time and its extra cost in step-times (goal <= 1 extra step, plus the
failed partial pass), the median step time after it (smaller passes until something grows the cap back: the
``memory_backoff`` callback does that on a device with a memory probe), whether the final LoRA weights of both
runs agree, and for comparison what transformers' ``auto_find_batch_size`` costs: it restarts training from step
0, i.e. ``--oom-step`` steps plus a new start-up.

    python scripts/bench_oom.py                      # CPU: 12 steps, OOM in step 6
    python scripts/bench_oom.py --batch 8 --ga 4 --steps 20 --oom-step 10

On a GPU the same script measures the injected OOM on the real device (the model still is the tiny one);
``scripts/gpu_oom_demo.py`` triggers a real CUDA OOM instead.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

from benchmarks.common import base_parser, machine_lines, quiet_run

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')


def run(name: str, opts, model: str, dataset: str, fail_passes: tuple[int, ...] = ()) -> dict:
    import torch
    from safetensors.torch import load_file

    from swift_dynamic_callbacks import run as sdc_run
    from swift_dynamic_callbacks.testing.faults import OomInjector
    from swift_dynamic_callbacks.testing.timing import StepTimer
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs

    torch.set_num_threads(opts.threads) if opts.threads else None
    out = os.path.join(opts.work_dir, name)
    timer = StepTimer.factory()
    kwargs = offline_sft_kwargs(
        model, dataset, out, arch='qwen2', callbacks=['bench_step_timer', 'batch_schedule'], max_steps=opts.steps,
        per_device_train_batch_size=opts.batch, gradient_accumulation_steps=opts.ga, lora_dropout=0.0,
        learning_rate=1e-3, lr_scheduler_type='constant', warmup_ratio=0.0, save_steps=opts.steps, seed=opts.seed)
    with quiet_run(opts.quiet), OomInjector(fail_passes=fail_passes) as injector:
        sdc_run.sft(kwargs, pack={'batch_schedule': {'schedule': {0: opts.batch}}},
                    extra={'bench_step_timer': timer})
    weights = load_file(os.path.join(out, f'checkpoint-{opts.steps}', 'adapter_model.safetensors'))
    return {'times': timer.last.step_seconds(), 'weights': weights, 'injected': dict(injector.counts)}


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__, REPO, 'bench-oom')
    parser.add_argument('--batch', type=int, default=4)
    parser.add_argument('--ga', type=int, default=4)
    parser.add_argument('--steps', type=int, default=12)
    parser.add_argument('--oom-step', type=int, default=6, help='1-based step whose last micro-batch fails')
    parser.add_argument('--rows', type=int, default=128)
    parser.add_argument('--threads', type=int, default=1, help='torch threads (0: torch default)')
    parser.add_argument('--no-snapshot', action='store_true',
                        help='recover by running the step\'s earlier micro-batches again (the full fine-tune path)')
    opts = parser.parse_args(argv)
    if not 2 <= opts.oom_step < opts.steps:
        parser.error(f'--oom-step: must be in [2, --steps), got {opts.oom_step}')
    import torch

    from swift_dynamic_callbacks.testing.tiny import build_tiny_model, write_gsm8k_dataset
    os.makedirs(opts.work_dir, exist_ok=True)
    model = str(build_tiny_model(Path(opts.work_dir) / 'tiny-qwen2', 'qwen2'))
    dataset = str(write_gsm8k_dataset(Path(opts.work_dir) / 'gsm8k.jsonl', opts.rows))
    if opts.no_snapshot:
        from swift_dynamic_callbacks.integrations.steps import StepRunner
        StepRunner._snapshot_grads = lambda self, model: False
    base = run('baseline', opts, model, dataset)
    failing_pass = (opts.oom_step - 1) * opts.ga + opts.ga - 1  # the last micro-batch of that step
    oom = run('oom', opts, model, dataset, fail_passes=(failing_pass, ))
    k = opts.oom_step - 1
    before = statistics.median(base['times'][1:k] + oom['times'][1:k])  # step 1 includes warm-up
    oom_step = oom['times'][k]
    after = statistics.median(oom['times'][k + 1:])
    extra = (oom_step - before) / before
    same = all(torch.allclose(base['weights'][n], oom['weights'][n], atol=1e-5, rtol=0) for n in base['weights'])
    lines = ['# OOM recovery cost', '']
    lines += machine_lines([sys.argv[0]] + list(argv if argv is not None else sys.argv[1:]))
    lines += [
        '', f'batch {opts.batch} x gradient_accumulation_steps {opts.ga}, {opts.steps} steps, injected '
        f'OOM mid-backward in the last micro-batch of step {opts.oom_step} (injected: {oom["injected"]})', '',
        '| | seconds | step-times |', '|---|---:|---:|',
        f'| median step before the OOM | {before:.3f} | 1.00 |',
        f'| the OOM step (failed pass + {"the step" if opts.no_snapshot else "the micro-batch"} again in half-size '
        f'passes) | {oom_step:.3f} | '
        f'{oom_step / before:.2f} |',
        f'| extra cost of the recovery | {oom_step - before:.3f} | **{extra:.2f}** |',
        f'| median step after (half-size passes) | {after:.3f} | {after / before:.2f} |',
        f'| `auto_find_batch_size` instead (restart from step 0) | >= {k * before:.3f} | >= {k} + start-up |', '',
        f'Final LoRA weights equal to the run without OOM (atol 1e-5): {same}',
    ]
    print('\n'.join(lines))
    return 0 if same else 1


if __name__ == '__main__':
    sys.exit(main())

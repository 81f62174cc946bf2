#!/usr/bin/env python
"""GPU only: a real CUDA out-of-memory error in a LoRA fine-tune, and the run recovering from it.

Trains the tiny Qwen2 model (its 151,936-token vocabulary makes the logits huge: ``batch x tokens x 151936 x 4``
bytes) with a per-device batch far too large for the GPU (``--batch``, default 512 gsm8k rows padded to ~300
tokens: ~90 GiB of logits alone). With the pack's integration the first step's OOM is caught, the pass is halved
until it fits, and training goes on with the same samples and gradient; ``memory_backoff`` then watches the peak
memory and grows the passes back when there is room. Printed: every OOM record (pass size, new cap, memory
figures), step times, peak memory, and whether every sample was used exactly once.

    python scripts/gpu_oom_demo.py                    # needs CUDA; exits 2 without it
    python scripts/gpu_oom_demo.py --batch 1024 --steps 6

Not part of the test suite (the suite is CPU-only); run it on a GPU machine and record its figures in the README.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--batch', type=int, default=512)
    parser.add_argument('--steps', type=int, default=4)
    parser.add_argument('--rows', type=int, default=500, help='gsm8k rows (the vendored 500 at most)')
    parser.add_argument('--work-dir', default=str(REPO / '.cache' / 'gpu-oom-demo'))
    opts = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print('gpu_oom_demo: no CUDA device; this script needs a GPU (the CPU tests simulate the OOM instead)')
        return 2
    from swift import SftArguments, sft_main

    import swift_dynamic_callbacks as sdc
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.tiny import build_tiny_model, offline_sft_kwargs, write_gsm8k_dataset
    work = Path(opts.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_model(work / 'tiny-qwen2', 'qwen2'))
    dataset = str(write_gsm8k_dataset(work / 'gsm8k.jsonl', opts.rows))
    out = str(work / 'run')
    sdc.register(batch_schedule={'schedule': {0: opts.batch}}, memory_backoff={'clean_steps': 2},
                 integration={'record_samples': True})
    kwargs = offline_sft_kwargs(model, dataset, out, arch='qwen2', callbacks=['batch_schedule', 'memory_backoff'],
                                max_steps=opts.steps, per_device_train_batch_size=opts.batch,
                                gradient_accumulation_steps=1, torch_dtype='float32', lora_dropout=0.0,
                                save_steps=10**6, dataloader_num_workers=0)
    t0 = time.perf_counter()
    try:
        sft_main(SftArguments(**kwargs))
    finally:
        plugin.unregister()
    wall = time.perf_counter() - t0

    def read(name):
        path = os.path.join(out, name)
        with open(path, encoding='utf-8') as f:
            return [json.loads(line) for line in f if line.strip()]

    records = read('dynamic_decisions.jsonl')
    logs = [row for row in read('logging.jsonl') if 'loss' in row]
    trace = read('dynamic_samples.rank0.jsonl')
    used = [i for row in trace for batch in row['batches'] for i in batch]
    print(f'# Real CUDA OOM recovery ({torch.cuda.get_device_name(0)}, torch {torch.__version__})\n')
    print(f'per-device batch {opts.batch}, {opts.steps} steps, wall {wall:.1f} s (model load included)\n')
    print('| step | record | values |\n|---:|---|---|')
    for r in records:
        if r['kind'] in ('oom', 'pass_limit'):
            print(f'| {r["step"]} | {r["source"]} {r["kind"]} ({r["reason"]}) | {r["values"]} |')
    print('\n| step | loss | pass size | peak GiB | oom count |\n|---:|---:|---:|---:|---:|')
    for row in logs:
        print(f'| {row["global_step/max_steps"]} | {row["loss"]} | {row.get("dynamic/pass_size")} | '
              f'{row.get("dynamic/memory_peak_gib")} | {row.get("dynamic/oom_count")} |')
    print(f'\nsamples used: {len(used)}, distinct: {len(set(used))} (every sample once: {len(used) == len(set(used))})')
    return 0


if __name__ == '__main__':
    sys.exit(main())

#!/usr/bin/env python
"""What the pack costs under real DDP: step time of the pack (installed, no change requested) over plain ms-swift.

Two processes (``torch.distributed.run``, gloo, ``use_cpu: true``: real ``DistributedDataParallel``) train the tiny
Qwen2 model (built offline in ``--work-dir``) with the same data and settings, through ``tests/distributed_driver.py``
(it also checks the run trained under DDP):

- ``plain``: ms-swift alone (no pack);
- ``pack``: the pack with ``batch_growth`` listed but never growing within the run (``interval`` beyond ``--steps``),
  default integration settings: OOM recovery on, so DDP passes run without DDP's in-backward all-reduce and the step's
  gradients are all-reduced after its last pass (``deferred``);
- ``pack-native``: the same with ``oom_recovery: false``: the step's last pass uses DDP's own bucketed all-reduce,
  overlapped with backward (``native``).

for LoRA and for a full fine-tune (``--tuners``). Every optimizer step's end is timed on rank 0 (a callback); the
figure is the median step time after ``--warmup`` steps, and the ratio is over ``plain``'s. Runs alternate
(plain, pack, pack-native, plain, ...) ``--repeats`` times and the median of the repeats is reported, so a load change
on a shared machine hits all arms alike; the load average is printed.

Usage (from the repository root): ``python scripts/bench_engines.py`` (about 6 minutes on 2 cores), or
``python scripts/bench_engines.py --tuners lora --steps 20 --repeats 3``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import base_parser, machine_lines

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / 'tests' / 'distributed_driver.py'
ARMS = ('plain', 'pack', 'pack-native')


def run_arm(opts, arm: str, tuner: str, model: str, dataset: str, index: int) -> list[float]:
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
    work = Path(opts.work_dir) / f'{tuner}-{arm}-{index}'
    out = work / 'out'
    subprocess.run(['rm', '-rf', str(work)], check=True)
    work.mkdir(parents=True)
    callbacks = ['step_timer'] if arm == 'plain' else ['batch_growth', 'step_timer']
    pack = None if arm == 'plain' else {'batch_growth': {'initial': opts.batch, 'maximum': opts.batch * 2,
                                                         'interval': opts.steps * 10}}
    if arm == 'pack-native':
        pack['integration'] = {'oom_recovery': False}
    device = {'use_cpu': True, 'ddp_backend': 'gloo'} if opts.device == 'cpu' else {'ddp_backend': 'nccl'}
    sft = offline_sft_kwargs(model, dataset, out, arch='qwen2', callbacks=callbacks, **device, tuner_type=tuner,
                             max_steps=opts.steps, per_device_train_batch_size=opts.batch,
                             gradient_accumulation_steps=opts.ga, lora_dropout=0.0, seed=opts.seed,
                             learning_rate=1e-3 if tuner == 'lora' else 1e-5)
    spec = {'sft': sft, 'pack': pack, 'engine': 'ddp', 'step_times': True}
    (work / 'spec.json').write_text(json.dumps(spec))
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false',
           'PYTHONPATH': os.pathsep.join(p for p in (str(REPO), str(REPO / 'tests'), os.environ.get('PYTHONPATH'))
                                         if p)}
    command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_addr', '127.0.0.1',
               '--master_port', str(29500 + (os.getpid() + index) % 2000), str(DRIVER), str(work / 'spec.json')]
    with open(work / 'run.log', 'w') as log:
        rc = subprocess.run(command, stdout=None if not opts.quiet else log, stderr=subprocess.STDOUT, env=env,
                            timeout=900).returncode
    if rc != 0:
        raise SystemExit(f'{arm} ({tuner}) failed with exit code {rc}: see {work / "run.log"}')
    times = json.loads((out / 'rank0.times.json').read_text())
    if arm != 'plain':
        trace = json.loads((out / 'rank0.trace.json').read_text())
        expected = 'MULTI_CPU' if opts.device == 'cpu' else 'MULTI_GPU'
        assert (trace['distributed_type'], trace['wrapper']) == (expected, 'DistributedDataParallel'), trace
    return [b - a for a, b in zip(times, times[1:])][opts.warmup:]


def main() -> None:
    parser = base_parser(__doc__, REPO, 'bench_engines')
    parser.add_argument('--tuners', nargs='+', default=['lora', 'full'], choices=['lora', 'full'])
    parser.add_argument('--steps', type=int, default=16)
    parser.add_argument('--warmup', type=int, default=3, help='first step intervals left out')
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--ga', type=int, default=2)
    parser.add_argument('--rows', type=int, default=128)
    parser.add_argument('--repeats', type=int, default=2)
    parser.add_argument('--device', choices=['cpu', 'cuda'], default='cpu',
                        help='cpu: 2 processes with gloo (use_cpu); cuda: 2 GPUs with NCCL')
    opts = parser.parse_args()
    from swift_dynamic_callbacks.testing.tiny import build_tiny_model, write_gsm8k_dataset
    os.makedirs(opts.work_dir, exist_ok=True)
    model = str(build_tiny_model(Path(opts.work_dir) / 'tiny-qwen2', 'qwen2'))
    dataset = str(write_gsm8k_dataset(Path(opts.work_dir) / 'gsm8k.jsonl', opts.rows))
    print('\n'.join(machine_lines(sys.argv)))
    results: dict[str, dict[str, float]] = {}
    for tuner in opts.tuners:
        medians: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for index in range(opts.repeats):
            for arm in ARMS:
                load = os.getloadavg()[0]
                steps = run_arm(opts, arm, tuner, model, dataset, index)
                medians[arm].append(statistics.median(steps))
                print(f'  {tuner:5s} {arm:12s} repeat {index}: median step {medians[arm][-1]:.3f} s '
                      f'over {len(steps)} steps (load {load:.2f})', flush=True)
        results[tuner] = {arm: statistics.median(values) for arm, values in medians.items()}
    print('\n| tuner | plain s/step | pack s/step | pack / plain | pack-native s/step | pack-native / plain |')
    print('|---|---|---|---|---|---|')
    for tuner, r in results.items():
        print(f'| {tuner} | {r["plain"]:.3f} | {r["pack"]:.3f} | {r["pack"] / r["plain"]:.3f} | '
              f'{r["pack-native"]:.3f} | {r["pack-native"] / r["plain"]:.3f} |')
    for tuner, r in results.items():
        print(json.dumps({'tuner': tuner, **{f'{k}_s': round(v, 4) for k, v in r.items()},
                          'pack_ratio': round(r['pack'] / r['plain'], 4),
                          'pack_native_ratio': round(r['pack-native'] / r['plain'], 4)}))
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1))


if __name__ == '__main__':
    main()

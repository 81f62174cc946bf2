"""Resume-to-first-step at scale: a fresh start against a resume from a checkpoint in the middle of the epoch.

One checkpoint is prepared (``--rows`` generated rows, lazily tokenised, tiny Qwen2 LoRA, ``batch_growth``, a
checkpoint at step 2). Then, alternating, one fresh process each: ``fresh`` (the same run from the start) and
``resume`` (``--resume_from_checkpoint`` that checkpoint); each reports the seconds from the ``sft_main`` call to the
end of the first optimizer step it trains. Loading the rows, the model and (for ``resume``) the checkpoint are in the
figures. The pack draws the next unseen samples directly (the position is in samples), so a resume encodes no sample
before it; ``tests/test_elastic_resume.py`` checks that at any position, this script times it end to end.

    python scripts/bench_resume.py --rows 100000 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

from benchmarks.scale import run_child, write_rows

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r'''
import json, sys, time
from swift import SftArguments, sft_main
from swift.callbacks import callbacks_map
from swift_dynamic_callbacks.testing.timing import StepTimer
import swift_dynamic_callbacks as sdc
from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
spec = json.loads(sys.argv[1])

callbacks_map['bench_timer'] = timers = StepTimer.factory(stop_after=1 if spec['stop'] else None)
sdc.register(batch_growth={'initial': 4, 'factor': 2, 'interval': 10, 'maximum': 16})
kwargs = offline_sft_kwargs(spec['model'], spec['data'], spec['out'], callbacks=['bench_timer', 'batch_growth'],
                            max_steps=3, lazy_tokenize=True, per_device_train_batch_size=4, save_steps=2,
                            max_length=512, **spec['extra'])
t0 = time.perf_counter()
sft_main(SftArguments(**kwargs))
print('BENCH ' + json.dumps({'first_step_s': round(timers.last.step_ends[0][0] - t0, 2)}))
'''


def run(spec: dict, threads: int) -> float:
    seconds, error = run_child(CHILD, spec, threads)
    if seconds is None:
        raise RuntimeError(f'the run failed:\n{error}')
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--rows', type=int, default=100_000)
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--work', default=os.path.join(ROOT, 'output', 'bench_resume'))
    parser.add_argument('--threads', type=int, default=1)
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    from swift_dynamic_callbacks.testing.tiny import build_tiny_model
    model = str(build_tiny_model(os.path.join(args.work, 'tiny-qwen2'), 'qwen2'))
    data = write_rows(os.path.join(args.work, f'rows-{args.rows}.jsonl'), args.rows)
    prepared = os.path.join(args.work, f'prepared-{args.rows}')
    shutil.rmtree(prepared, ignore_errors=True)
    run({'model': model, 'data': data, 'out': prepared, 'stop': False, 'extra': {}}, args.threads)
    checkpoint = os.path.join(prepared, 'checkpoint-2')
    times: dict[str, list[float]] = {'fresh': [], 'resume': []}
    for _ in range(args.repeats):
        out = os.path.join(args.work, 'fresh')
        shutil.rmtree(out, ignore_errors=True)
        times['fresh'].append(run({'model': model, 'data': data, 'out': out, 'stop': True, 'extra': {}},
                                  args.threads))
        out = os.path.join(args.work, 'resumed')
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(prepared, out)
        times['resume'].append(run({'model': model, 'data': data, 'out': out, 'stop': True, 'extra': {
            'resume_from_checkpoint': os.path.join(out, 'checkpoint-2')}}, args.threads))
    state_kb = os.path.getsize(os.path.join(checkpoint, 'dynamic_callbacks_state.json')) / 1024
    print(f'rows {args.rows}, lazy_tokenize, tiny Qwen2 LoRA, {args.repeats} alternating repeats, '
          f'{args.threads} torch thread(s); pack state file {state_kb:.0f} KB')
    print('| start | median s to the end of the first step | min | max |')
    print('|---|---:|---:|---:|')
    for name, values in times.items():
        print(f'| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |')


if __name__ == '__main__':
    t = time.perf_counter()
    main()
    print(f'total {time.perf_counter() - t:.0f} s', file=sys.stderr)

"""Start-up time at scale: time from ``sft_main`` to the end of optimizer step 1, vs rows, plain ms-swift and the pack.

For each row count (generated rows of varied length, written once under ``--work``) and each configuration
(``plain``: no pack; ``growth``: batch_growth; ``length_batching``: token budget with buckets), eager
(``lazy_tokenize: false``: ms-swift encodes every row before training, for every configuration) and lazy
(``lazy_tokenize: true``: rows are encoded when read; the pack estimates lengths instead of encoding them), one fresh
process runs one optimizer step of a tiny Qwen2 LoRA model and reports the seconds from the ``sft_main`` call to the
end of step 1. Loading and preprocessing the rows is ms-swift's and is in every figure; the difference to ``plain`` is
what the pack adds. ``length_batching`` lazy runs twice: cold (no length cache) and warm (the cache beside the dataset
from the cold run).

    python scripts/bench_scale.py                        # 1k, 10k, 100k, 1M rows lazy; eager up to 10k
    python scripts/bench_scale.py --rows 1000 100000 --eager-max 100000
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORDS = ('alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon '
         'phi chi psi omega').split()

CHILD = r'''
import json, os, sys, time
t_import = time.perf_counter()
from swift import SftArguments, sft_main
from swift.callbacks import callbacks_map
from swift_dynamic_callbacks.testing.timing import StepTimer
import swift_dynamic_callbacks as sdc
from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
spec = json.loads(sys.argv[1])

callbacks_map['bench_timer'] = timers = StepTimer.factory(stop_after=1)
callbacks = ['bench_timer'] + spec['callbacks']
if spec['section']:
    sdc.register(**spec['section'])
kwargs = offline_sft_kwargs(spec['model'], spec['data'], spec['out'], callbacks=callbacks, max_steps=1,
                            lazy_tokenize=spec['lazy'], per_device_train_batch_size=4, save_strategy='no',
                            max_length=512)
t0 = time.perf_counter()
sft_main(SftArguments(**kwargs))
print('BENCH ' + json.dumps({'first_step_s': round(timers.last.step_ends[0][0] - t0, 2)}))
'''

CONFIGS = {
    'plain': ([], {}),
    'growth': (['batch_growth'], {'batch_growth': {'initial': 4, 'factor': 2, 'interval': 10, 'maximum': 16}}),
    'length_batching': (['length_batching'], {'length_batching': {'micro_batch_tokens': 2048}}),
}


def write_rows(path: str, n: int) -> str:
    if os.path.exists(path):
        return path
    tmp = f'{path}.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
        for i in range(n):
            q = ' '.join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 17))
            a = ' '.join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(5 + (i * 13) % 61))
            f.write(json.dumps({'messages': [{'role': 'user', 'content': q}, {'role': 'assistant', 'content': a}]}))
            f.write('\n')
    os.replace(tmp, path)
    return path


def run_child(child: str, spec: dict, threads: int) -> tuple[float | None, str]:
    """Run ``child`` (Python source printing a ``BENCH {...first_step_s...}`` line) in a fresh process on ``spec``;
    ``(first_step_s or None, the tail of its stderr)``."""
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]),
           'OMP_NUM_THREADS': str(threads), 'TOKENIZERS_PARALLELISM': 'false'}
    result = subprocess.run([sys.executable, '-c', child, json.dumps(spec)], capture_output=True, text=True, env=env)
    for line in result.stdout.splitlines():
        if line.startswith('BENCH '):
            return json.loads(line[6:])['first_step_s'], ''
    return None, result.stderr[-3000:]


def run(spec: dict, threads: int) -> float | None:
    seconds, error = run_child(CHILD, spec, threads)
    if seconds is None:
        print(error, file=sys.stderr)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--rows', type=int, nargs='+', default=[1000, 10000, 100000, 1000000])
    parser.add_argument('--eager-max', type=int, default=10000, help='largest row count also run eager')
    parser.add_argument('--configs', nargs='+', default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument('--work', default=os.path.join(ROOT, 'output', 'bench_scale'))
    parser.add_argument('--threads', type=int, default=1)
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    from swift_dynamic_callbacks.testing.tiny import build_tiny_model
    model = str(build_tiny_model(os.path.join(args.work, 'tiny-qwen2'), 'qwen2'))
    print('| rows | tokenize | ' + ' | '.join(args.configs) + ' |')
    print('|---:|---|' + '---:|' * len(args.configs))
    for n in args.rows:
        data = write_rows(os.path.join(args.work, f'rows-{n}.jsonl'), n)
        for lazy in (False, True):
            if not lazy and n > args.eager_max:
                continue
            cells = []
            for name in args.configs:
                callbacks, section = CONFIGS[name]
                spec = {'model': model, 'data': data, 'out': os.path.join(args.work, f'out-{n}-{name}-{lazy}'),
                        'callbacks': callbacks, 'section': section, 'lazy': lazy}
                if name == 'length_batching' and lazy:
                    # the cache lies beside the dataset's Arrow files (datasets' or modelscope's cache folder)
                    for stale in glob.glob(os.path.join(os.path.expanduser('~'), '.cache', '**', 'sdc_lengths-*.npy'),
                                           recursive=True):
                        os.remove(stale)
                    for stale in glob.glob(os.path.join(spec['out'], '.sdc_cache', '*.npy')):
                        os.remove(stale)
                    cold, warm = run(spec, args.threads), run(spec, args.threads)
                    cells.append(f'{cold} (cache: {warm})')
                else:
                    cells.append(str(run(spec, args.threads)))
            print(f'| {n} | {"lazy" if lazy else "eager"} | ' + ' | '.join(cells) + ' |', flush=True)


if __name__ == '__main__':
    t = time.perf_counter()
    main()
    print(f'total {time.perf_counter() - t:.0f} s', file=sys.stderr)

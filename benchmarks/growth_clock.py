"""The clock a GPU user pays for the growth study's arms (issue 39): the study's runs, timed on the device.

The growth study (``bench_growth_study.py``) measures eval loss on a CPU; what a GPU user pays is the time of the
passes, and at a few rows a pass a GPU mostly waits, so a step of 2 rows costs about what a step of 8 costs. This script
measures, on the device, with a random-weight model of the study's shape (the weights do not change the time; the shape
comes from a folder with ``config.json`` and the tokenizer, by default the study's SmolLM2-135M-Instruct folder, weights
not read):

- ``pass`` lines: the cost of one pass (forward + backward, LoRA r 8 on every linear layer as ms-swift's default,
  random token ids, every token a label) by rows x padded length, the median of ``--repeats`` after two warm-up
  passes, and an ``optimizer_step`` line (AdamW over the LoRA parameters, ``zero_grad`` included): the table a pass
  layout is priced from;
- ``arm`` lines: each arm's whole training under ms-swift (``bench_growth_study.sft_settings``: the same rows, order
  and settings as the study's run of that seed; bf16 on a GPU; no eval), the wall time of every optimizer step
  (synchronised) and the run's pass layout (passes and padded tokens a step), after unmeasured warm-up runs
  (``--warmup-arms``: a padded arm first, as the first padded arm of the 2026-11-27 run paid a first-time cost for
  each new padded length).

Every line is printed and appended to ``--jsonl`` as it comes; ``--deadline`` (seconds) starts no arm run after it.
``bench_growth_study.py --clock FILE`` reads the lines into the study's tables (GPU seconds per arm).

Usage (GPU, as ``scripts/gpu_throughput.sh`` phase ``growth`` runs it; CPU for a smoke run):
    python scripts/growth_clock.py --device cuda --shape .gpu/smollm2-135m-shape --seeds 2 3 --jsonl clock.jsonl
    python scripts/growth_clock.py --device cpu --shape tiny --samples 16 --seeds 2 --grid-rows 1 2 \\
        --grid-lengths 32 --repeats 2                                                           # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

from benchmarks import growth_study as study  # the arms and their settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPE_FILES = ('config.json', 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json',
               'chat_template.jinja', 'special_tokens_map.json', 'vocab.json', 'merges.txt')


def random_model(shape: str, dest: str, dtype: str) -> str:
    """A model folder at ``dest``: ``shape``'s config and tokenizer files, seeded random weights in ``dtype``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    os.makedirs(dest, exist_ok=True)
    for name in SHAPE_FILES:
        if os.path.exists(os.path.join(shape, name)):
            shutil.copy(os.path.join(shape, name), os.path.join(dest, name))
    config = AutoConfig.from_pretrained(shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(dest)
    return dest


def sync(device: str) -> None:
    import torch
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def pass_grid(model_dir: str, device: str, dtype: str, rows: list[int], lengths: list[int], repeats: int,
              emit) -> None:
    """``pass`` lines (rows x length) and one ``optimizer_step`` line, from a LoRA model outside ms-swift."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, lora_dropout=0.05, target_modules='all-linear'))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    vocab = model.config.vocab_size
    for n in rows:
        for length in lengths:
            ids = torch.randint(0, vocab, (n, length), device=device)
            times = []
            try:
                for i in range(repeats + 2):
                    sync(device)
                    start = time.perf_counter()
                    model(input_ids=ids, labels=ids).loss.backward()
                    sync(device)
                    if i >= 2:
                        times.append(time.perf_counter() - start)
            except torch.OutOfMemoryError as e:  # a cell that does not fit: said, the grid goes on
                emit({'kind': 'pass', 'rows': n, 'length': length, 'seconds': None, 'error': str(e)[:200]})
                optimizer.zero_grad(set_to_none=True)
                continue
            emit({'kind': 'pass', 'rows': n, 'length': length, 'seconds': round(statistics.median(times), 6)})
    times = []
    for p in params:  # every LoRA parameter with a gradient: the step does its whole work each time
        p.grad = torch.ones_like(p) if p.grad is None else p.grad
    for i in range(repeats + 2):
        sync(device)
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    emit({'kind': 'optimizer_step', 'seconds': round(statistics.median(times), 6)})
    del model, optimizer
    if device.startswith('cuda'):
        torch.cuda.empty_cache()


def time_arm(arm: str, seed: int, args: argparse.Namespace, model: str, flags: dict, train: str) -> dict:
    """One arm's training under ms-swift on the device: its step times and pass layout."""
    out = os.path.join(args.work, 'runs', f'{arm}-seed{seed}')
    from swift_dynamic_callbacks.testing.timing import StepTimer
    timer = StepTimer.factory(device=args.device)  # the device synchronised at each step's end
    device_args = {'torch_dtype': args.dtype} if args.device != 'cpu' else {'use_cpu': True}
    kwargs, settings = study.sft_settings(arm, args.lr, seed, args.beta2, args, model, flags, train, out,
                                          ['step_timer'], **device_args)
    wall, train_rows = study.train_run(kwargs, settings, {'step_timer': timer})
    steps = study.step_log(train_rows, {})
    t = timer.last
    steps_s = t.step_seconds()
    return {'kind': 'arm', 'arm': arm, 'seed': seed, 'device': args.device_name, 'dtype': args.dtype,
            'train_s': round(t.total, 3), 'wall_s': round(wall, 1), 'optimizer_steps': len(steps_s),
            'step_s': [round(x, 4) for x in steps_s], 'batch': steps['batch'], 'passes': steps['passes'],
            'padded': steps['padded']}


def summary(lines: list[dict]) -> None:
    """The grid and the arms as markdown tables."""
    grid = [x for x in lines if x['kind'] == 'pass']
    if grid:
        lengths = sorted({x['length'] for x in grid})
        print('\ncost of one pass (forward + backward, ms), rows x padded length:')
        print('| rows | ' + ' | '.join(str(n) for n in lengths) + ' |')
        print('|---:|' + '---:|' * len(lengths))
        for n in sorted({x['rows'] for x in grid}):
            cells = {x['length']: x['seconds'] for x in grid if x['rows'] == n}
            print(f'| {n} | ' + ' | '.join('OOM' if cells.get(k) is None else f'{cells[k] * 1e3:.1f}'
                                            for k in lengths) + ' |')
    for x in lines:
        if x['kind'] == 'optimizer_step':
            print(f'optimizer step (AdamW over the LoRA parameters): {x["seconds"] * 1e3:.2f} ms')
    arms = [x for x in lines if x['kind'] == 'arm' and not x.get('warmup')]
    if arms:
        print('\neach arm\'s training on the device (seconds; steps after the first: median):')
        print('| arm | seed | steps | passes | padded tokens | train s | first step s | median step s |')
        print('|---|---:|---:|---:|---:|---:|---:|---:|')
        for x in arms:
            print(f'| {x["arm"]} | {x["seed"]} | {x["optimizer_steps"]} | {sum(x["passes"])} | {sum(x["padded"])} | '
                  f'{x["train_s"]:.2f} | {x["step_s"][0]:.3f} | {statistics.median(x["step_s"][1:] or [0]):.4f} |')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--device', default='cuda')
    parser.add_argument('--dtype', default=None, help='default bfloat16 on a GPU, float32 on a CPU')
    parser.add_argument('--shape', default=os.path.join(ROOT, '.cache', 'bench', 'smollm2-135m-instruct'),
                        help='a folder with config.json and the tokenizer (weights not read), or "tiny"')
    parser.add_argument('--arms', nargs='+', default=list(study.ARMS), choices=study.ARMS)
    parser.add_argument('--seeds', type=int, nargs='+', default=[2])
    parser.add_argument('--samples', type=int, default=128)
    parser.add_argument('--ga', type=int, default=2)
    parser.add_argument('--max-length', type=int, default=512)
    parser.add_argument('--lr', type=float, default=2e-3, help='the LR does not change the time')
    parser.add_argument('--beta2', type=float, default=0.95)
    parser.add_argument('--grid-rows', type=int, nargs='*', default=[1, 2, 4, 8, 16])
    parser.add_argument('--grid-lengths', type=int, nargs='*', default=[128, 192, 256, 384, 512])
    parser.add_argument('--repeats', type=int, default=10)
    parser.add_argument('--warmup-arms', nargs='*', default=['control_a', 'baseline'], choices=study.ARMS,
                        help='unmeasured runs first (on the first seed): a padded arm pays the first-time cost of '
                             'each padded length (on the H200 control A, run first among the padded arms, took 1.6 x '
                             'the time a pass of the others did), an unpadded one the rest')
    parser.add_argument('--deadline', type=float, default=None, help='seconds after which no arm run starts')
    parser.add_argument('--work', default=os.path.join(ROOT, 'output', 'growth_clock'))
    parser.add_argument('--jsonl', default=None)
    args = parser.parse_args(argv)
    import torch
    args.dtype = args.dtype or ('float32' if args.device == 'cpu' else 'bfloat16')
    args.device_name = torch.cuda.get_device_name(0) if args.device.startswith('cuda') else 'cpu'
    deadline = None if args.deadline is None else time.time() + args.deadline
    lines: list[dict] = []

    def emit(line: dict) -> None:
        line = {'device': args.device_name, **line}
        lines.append(line)
        print(json.dumps(line), flush=True)
        if args.jsonl:
            with open(args.jsonl, 'a', encoding='utf-8') as f:
                f.write(json.dumps(line) + '\n')

    from swift_dynamic_callbacks.testing.tiny import MODEL_FLAGS, build_tiny_model, write_gsm8k_dataset
    os.makedirs(args.work, exist_ok=True)
    train = str(write_gsm8k_dataset(os.path.join(args.work, 'gsm8k-train.jsonl'), args.samples))
    if args.shape == 'tiny':
        model, flags = str(build_tiny_model(os.path.join(args.work, 'tiny-qwen2'), 'qwen2')), dict(MODEL_FLAGS['qwen2'])
    else:
        from swift_dynamic_callbacks.demo import SMOLLM2_FLAGS
        model, flags = random_model(args.shape, os.path.join(args.work, 'model'), args.dtype), dict(SMOLLM2_FLAGS)
    if args.grid_rows and args.grid_lengths:
        pass_grid(model, args.device, args.dtype, args.grid_rows, args.grid_lengths, args.repeats, emit)
    runs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    warmups = [(arm, args.seeds[0]) for arm in args.warmup_arms] if runs else []
    for i, (arm, seed) in enumerate([*warmups, *runs]):
        if deadline is not None and time.time() > deadline:
            print(f'[arm-skipped] {arm} seed {seed}: past --deadline', file=sys.stderr, flush=True)
            continue
        try:
            result = time_arm(arm, seed, args, model, flags, train)
        except Exception as e:  # noqa: BLE001 - every arm's cause of failure is printed, the next one runs
            print(f'[arm-skipped] {arm} seed {seed}: failed: {type(e).__name__}: {e}', file=sys.stderr, flush=True)
            continue
        emit({**result, 'warmup': True} if i < len(warmups) else result)
    summary(lines)
    return 0


if __name__ == '__main__':
    sys.exit(main())

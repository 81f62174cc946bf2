"""The growth study (issue 39): a tuned fixed batch, its step-count control and a rows-indexed batch warmup, with Adam's
beta2 set per run, evaluated on 500 held-out GSM8K test rows (token-weighted), one JSON line per run.

Arms (every arm sees the same ``--samples`` GSM8K train rows once, in the same order for a seed; ``--ga`` 2):

- ``baseline``: fixed micro-batch 1 x GA 2 (2 rows a step: 64 steps on 128 rows), plain ms-swift.
- ``control_a``: fixed micro-batch 2 x GA 2 (4 rows a step: 32 steps), plain ms-swift: the control that says whether
  growth is what saves the steps.
- ``fixed_4``, ``fixed_8``: fixed micro-batch 4 (8) x GA 2 (16 and 8 steps), plain ms-swift: with the baseline and
  control A the fixed-batch frontier {1, 2, 4, 8} that the growth arms are placed on (eval loss against steps and
  against GPU seconds, ``scripts/growth_clock.py``).
- ``twin_c`` and ``seesaw_c`` (arm C, run after A and B if the futility look leaves room): a step LR schedule,
  ``lr_schedule`` ``decay: steps`` (the LR x 1, 1/2, 1/4 over rows 0-31 / 32-63 / 64-127, after the same 10 %
  warmup), at a fixed micro-batch 1 x GA 2 (the twin, 64 steps), and the same schedule under ``batch_growth``
  ``policy: seesaw`` (each cut by 2 becomes a batch x 2 and an LR cut by sqrt(2): (2 rows, eta), (4, eta / sqrt 2),
  (8, eta / 2) over the same rows, 32 steps).
- ``growth_b``: OLMo-style batch warmup in rows: 2 rows a step for the first quarter of the rows, 4 for the second,
  8 for the second half (micro 1, 2, 4 x GA 2: 16 + 8 + 8 = 32 steps on 128 rows), the LR x sqrt(2) at each
  doubling. Pack settings only: ``batch_growth`` ``policy: table`` at the steps where those rows are reached
  (:func:`rows_table`), ``lr_scaling: sqrt``. The LR schedule is HF's cosine (``warmup_ratio`` 0.1) as in the fixed
  arms: its horizon is the run's step count at micro-batch 1 (64), and the pack stretches the rest of it at every
  growth so it ends at the run's new last step; with the batch constant within a stage this makes the schedule a
  function of the rows consumed, the same as the baseline's (``integrations/scheduler.py``, ``ScaledLambda.stretch``).

Every run sets ``adam_beta2`` (``--beta2``; HF's flag) and logs per optimizer step (the ``steps`` field of its line):
the LR the optimizer used, the global batch in rows, rows consumed, training loss, gradient norm, Adam's update RMS
per unit LR (``|delta theta| / (lr sqrt(n))`` over the LoRA parameters) and the gradient-noise terms the pack measures
from the GA micro-batches (``measure_grad_noise``: ``|g|^2`` of the first pass and of the whole step with their loss
tokens; ``noise_scale`` in the table: B_simple = tr(Sigma) / |G|^2 from their EMAs, in rows).

The eval loss is token-weighted: the sum of every held-out answer token's negative log-likelihood over their count,
computed once at the end of training on the model in memory (HF's ``eval_loss`` averages per-batch means).

Usage (needs the demo extra, see ``scripts/main_job.sh``; ``scripts/growth_study.sh`` runs the study):
    python scripts/bench_growth_study.py --arms baseline --lrs 2e-3 --seeds 0 --beta2 0.95 --jsonl g.jsonl --skip-done
    python scripts/bench_growth_study.py --model tiny --samples 16 --eval-rows 8 --arms growth_b --lrs 1e-3  # smoke
    python scripts/bench_growth_study.py --from-jsonl docs/figures/growth_39.jsonl --tune-seeds 0 1   # the tables
    python scripts/bench_growth_study.py --from-jsonl growth.jsonl --tune-seeds 0 1 --pick beta2 --lrs 2e-3
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import json
import math
import os
import re
import statistics
import sys
import time

from benchmarks import quality as bench_quality  # the model folder, the train rows and the paired interval

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARMS = ('baseline', 'control_a', 'growth_b', 'fixed_4', 'fixed_8', 'twin_c', 'seesaw_c')
#: arm C's step schedule: the LR x 1, 1/2, 1/4 over rows 0-31 / 32-63 / 64-127 of 128 (fractions of the epoch)
STEP_SCHEDULE = {'decay': 'steps', 'steps': {0.25: 0.5, 0.5: 0.25}, 'warmup': 0.1, 'max_restarts': 0}
#: the fixed arms' micro-batch
FIXED = {'baseline': 1, 'control_a': 2, 'fixed_4': 4, 'fixed_8': 8}
#: the frontier's own arms: run on the futility look's reporting seeds only
FRONTIER_ARMS = ('fixed_4', 'fixed_8')
TEST_FILE = os.path.join(ROOT, 'scripts', 'assets', 'gsm8k-test-500.jsonl.gz')
TEST_ROWS = 500
#: the study's LR ladder: 2e-3 (the last study's tuned baseline) times powers of sqrt(2), as the run names write them
LADDER = tuple(f'{2e-3 * math.sqrt(2) ** k:.3g}' for k in range(-4, 5))


def rows_table(stages: dict[int, int], ga: int) -> dict[int, int]:
    """``{first row: micro-batch}`` stages -> ``batch_growth``'s ``{0-based optimizer step: micro-batch}`` table.

    A stage of ``micro`` rows a pass takes ``micro x ga`` rows a step; each stage's rows must be a whole number of
    steps (else the step table would not switch at the row named)."""
    rows = sorted(stages)
    if not rows or rows[0] != 0:
        raise ValueError(f'rows_table: the first stage starts at row 0, got {rows}')
    table, step = {}, 0
    for row, nxt in zip(rows, rows[1:] + [None]):
        table[step] = stages[row]
        if nxt is not None:
            span, per_step = nxt - row, stages[row] * ga
            if span % per_step:
                raise ValueError(f'rows_table: rows {row}-{nxt - 1} at {per_step} rows a step are not whole steps')
            step += span // per_step
    return table


def growth_stages(samples: int) -> dict[int, int]:
    """Arm B's stages: micro-batch 1 for the first quarter of the rows, 2 for the second, 4 for the second half."""
    return {0: 1, samples // 4: 2, samples // 2: 4}


def arm_settings(arm: str, samples: int, ga: int) -> tuple[dict, dict, list[str]]:
    """(ms-swift overrides, pack settings, pack callbacks) of one arm."""
    if arm in FIXED:
        return {'per_device_train_batch_size': FIXED[arm]}, {}, []
    if arm == 'twin_c':
        return {'per_device_train_batch_size': 1}, {'lr_schedule': dict(STEP_SCHEDULE)}, ['lr_schedule']
    if arm == 'seesaw_c':
        growth = {'policy': 'seesaw', 'factor': 2.0, 'initial': 1, 'maximum': 4, 'lr_scaling': 'sqrt'}
        return ({'per_device_train_batch_size': 1}, {'batch_growth': growth, 'lr_schedule': dict(STEP_SCHEDULE)},
                ['batch_growth', 'lr_schedule'])
    if arm == 'growth_b':
        table = rows_table(growth_stages(samples), ga)
        growth = {'policy': 'table', 'initial': 1, 'maximum': max(table.values()), 'table': table,
                  'lr_scaling': 'sqrt'}
        return {'per_device_train_batch_size': 1}, {'batch_growth': growth}, ['batch_growth']
    raise ValueError(f'--arms: one of {", ".join(ARMS)}, got {arm!r}')


def write_test_rows(dest: str, rows: int) -> str:
    """The first ``rows`` vendored held-out GSM8K test rows (``scripts/assets``) as a ``messages`` JSONL file, shortest
    first: the eval batches then hold rows of about one length (a quarter less padding to run through the model on
    one thread; the token-weighted loss does not depend on the batching)."""
    with gzip.open(TEST_FILE, 'rt', encoding='utf-8') as f:
        items = [json.loads(line) for line in f if line.strip()][:rows]
    items.sort(key=lambda r: len(r['question']) + len(r['answer']))
    tmp = f'{dest}.{os.getpid()}.tmp'  # written whole, then renamed: a run of another stream may be reading it
    with open(tmp, 'w', encoding='utf-8') as f:
        for r in items:
            f.write(json.dumps({'messages': [{'role': 'user', 'content': r['question']},
                                             {'role': 'assistant', 'content': r['answer']}]}) + '\n')
    os.replace(tmp, dest)
    return dest


def prepare(model: str, samples: int, eval_rows: int, root: str) -> tuple[str, dict, str, str]:
    """The model folder, its flags, the train rows (bench_quality's) and this study's held-out rows."""
    model_dir, flags, train, _ = bench_quality.prepare(model, samples, 1, root)
    return model_dir, flags, train, write_test_rows(os.path.join(root, f'gsm8k-test-{eval_rows}.jsonl'), eval_rows)


def make_probe():
    """A plain HF callback (ms-swift's ``(args, trainer)`` factory) that records each optimizer step's LR, Adam
    update RMS and the pack's gradient-noise sample, and at the end of training the token-weighted held-out loss."""
    import torch
    from swift.callbacks import TrainerCallback
    from swift_dynamic_callbacks import protocol

    class GrowthProbe(TrainerCallback):
        last = None  # the last instance: the bench reads its records after sft_main

        def __init__(self, args, trainer):
            super().__init__(args, trainer)
            GrowthProbe.last = self
            self.steps: dict[int, dict] = {}
            self.before = None
            self.eval = None

        def _params(self, model):
            return [p for p in model.parameters() if p.requires_grad]

        def on_train_begin(self, args, state, control, **kwargs):
            protocol.request_grad_noise(control)

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.before = [p.detach().clone() for p in self._params(model)]

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            params = self._params(model)
            sq = sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(params, self.before))
            n = sum(p.numel() for p in params)
            lr = float(optimizer.param_groups[0]['lr'])
            self.steps[state.global_step + 1] = {'lr': lr, 'update_rms': math.sqrt(sq / n) / lr if lr > 0 else None}
            self.before = None

        def on_step_end(self, args, state, control, **kwargs):
            sample = protocol.grad_noise_sample(control)
            if sample is not None:
                self.steps.setdefault(state.global_step, {})['noise'] = [
                    sample.small_sqnorm, sample.small_tokens, sample.big_sqnorm, sample.big_tokens, sample.samples]

        def on_train_end(self, args, state, control, model=None, **kwargs):
            start = time.perf_counter()
            was_training = model.training
            model.eval()
            nll, tokens, rows = 0.0, 0, 0
            with torch.no_grad():
                for batch in self.trainer.get_eval_dataloader():
                    batch = self.trainer._prepare_inputs(batch)
                    labels = batch['labels']
                    inputs = {k: batch[k] for k in ('input_ids', 'attention_mask', 'position_ids') if k in batch}
                    # ms-swift keeps only the labelled tail of each row (logits_to_keep): labels hold that tail
                    if 'logits_to_keep' in batch:
                        inputs['logits_to_keep'] = batch['logits_to_keep']
                    logits = model(**inputs).logits[:, -labels.shape[1]:][:, :-1].float()
                    target = labels[:, 1:]
                    nll += float(torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                        reduction='sum'))
                    tokens += int((target != -100).sum())
                    rows += int(labels.shape[0])
            if was_training:
                model.train()
            self.eval = {'eval_loss': nll / tokens, 'eval_tokens': tokens, 'eval_rows_seen': rows,
                         'eval_s': time.perf_counter() - start}

    return GrowthProbe


def sft_settings(arm: str, lr: float, seed: int, beta2: float, args: argparse.Namespace, model: str, flags: dict,
                 train: str, out: str, extra_callbacks: list[str], **overrides) -> tuple[dict, dict]:
    """(``SftArguments`` keyword arguments, pack settings) of one run of ``arm``: every run of the study and of its
    GPU clock (``growth_clock.py``) is built here, so both train the same rows in the same order with the same
    settings. ``overrides`` replace ms-swift arguments (the eval rows, the dtype)."""
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
    arm_overrides, pack, callbacks = arm_settings(arm, args.samples, args.ga)
    kwargs = offline_sft_kwargs(
        model, train, out, max_steps=-1, num_train_epochs=1, gradient_accumulation_steps=args.ga, learning_rate=lr,
        lr_scheduler_type='cosine', warmup_ratio=0.1, seed=seed, data_seed=seed, max_length=args.max_length,
        adam_beta2=beta2, eval_strategy='no', gradient_checkpointing=False, save_strategy='no',
        callbacks=[*callbacks, 'training_log', *extra_callbacks], **{**flags, **arm_overrides, **overrides})
    return kwargs, {**pack, 'training_log': {'memory': False}}


def train_run(kwargs: dict, settings: dict, callbacks: dict) -> tuple[float, list[dict]]:
    """One ``sft_main`` run of ``kwargs`` (its output folder emptied first) with the pack registered with ``settings``
    and ``callbacks`` (name -> ms-swift callback factory) in ms-swift's callbacks map: (wall seconds, the training
    log lines)."""
    from swift_dynamic_callbacks import run
    result = run.sft(kwargs, pack=settings, extra=callbacks)
    return result.wall_s, result.train_logs


def run_arm(arm: str, lr: float, seed: int, beta2: float, args: argparse.Namespace, model: str, flags: dict,
            train: str, test: str) -> dict:
    name = run_name(arm, lr)
    out = os.path.join(args.out, run_key(name, seed, beta2))
    probe = make_probe()
    kwargs, settings = sft_settings(arm, lr, seed, beta2, args, model, flags, train, out, ['growth_probe'],
                                    val_dataset=[test], per_device_eval_batch_size=4)
    wall, train_rows = train_run(kwargs, settings, {'growth_probe': probe})
    last = train_rows[-1]
    tokens, padded = float(last['dynamic/tokens_seen']), float(last['dynamic/padded_tokens_seen'])
    recorder = probe.last
    return {
        'arm': name,
        'seed': seed,
        'adam_beta2': beta2,
        'lr': lr,
        'optimizer_steps': int(str(last['global_step/max_steps']).split('/')[0]),
        'passes': sum(int(r['dynamic/global_batch_size']) // int(r['dynamic/batch_size']) for r in train_rows),
        'train_loss': round(statistics.fmean(float(r['loss']) for r in train_rows[-3:]), 4),
        'eval_loss': round(recorder.eval['eval_loss'], 5),
        'eval_tokens': recorder.eval['eval_tokens'],
        'eval_rows': args.eval_rows,
        'wall_s': round(wall, 1),
        'eval_s': round(recorder.eval['eval_s'], 1),
        'padding': round(1 - tokens / padded, 4) if padded else None,
        'padded_tokens': int(padded),
        'steps': step_log(train_rows, recorder.steps),
    }


def step_log(train_rows: list[dict], probe: dict[int, dict]) -> dict[str, list]:
    """Per optimizer step (logging_steps 1), column-wise: LR used, global batch (rows), rows consumed, passes, padded
    tokens (the pass layout a GPU clock is priced from), loss, gradient norm, Adam update RMS per unit LR, and the
    noise terms ``[|g_1|^2, tokens_1, |g|^2, tokens, rows]``."""
    cols: dict[str, list] = {k: [] for k in ('lr', 'batch', 'rows', 'passes', 'padded', 'loss', 'grad_norm',
                                             'update_rms', 'noise')}
    padded_before = 0
    for r in train_rows:
        step = int(str(r['global_step/max_steps']).split('/')[0])
        mine = probe.get(step, {})
        cols['lr'].append(float(f'{mine.get("lr", r.get("learning_rate", 0.0)):.4g}'))
        cols['batch'].append(int(r['dynamic/global_batch_size']))
        cols['rows'].append(int(r['dynamic/samples_seen']))
        cols['passes'].append(int(r['dynamic/global_batch_size']) // int(r['dynamic/batch_size']))
        padded = int(float(r['dynamic/padded_tokens_seen']))
        cols['padded'].append(padded - padded_before)
        padded_before = padded
        cols['loss'].append(round(float(r['loss']), 4))
        cols['grad_norm'].append(round(float(r['grad_norm']), 4) if r.get('grad_norm') is not None else None)
        rms = mine.get('update_rms')
        cols['update_rms'].append(round(rms, 4) if rms is not None else None)
        noise = mine.get('noise')
        cols['noise'].append([float(f'{noise[0]:.5g}'), noise[1], float(f'{noise[2]:.5g}'), noise[3], noise[4]]
                             if noise else None)
    return cols


def noise_scale(steps: dict[str, list]) -> float | None:
    """B_simple in rows over a run: tr(Sigma) / |G|^2 from the means over its steps of McCandlish et al.'s two unbiased
    terms (``policies.growth.noise_scale_terms``, in loss tokens; one step's pair is very noisy, and the ratio of the
    means is the run's estimate), divided by the run's mean loss tokens per row."""
    from swift_dynamic_callbacks.policies.growth import critical_batch, noise_scale_terms
    terms, tokens, rows = [], 0, 0
    for noise in steps.get('noise', []):
        if not noise or noise[1] >= noise[3]:
            continue
        terms.append(noise_scale_terms(noise[0], noise[1], noise[2], noise[3]))
        tokens, rows = tokens + noise[3], rows + noise[4]
    if not terms:
        return None
    scale = critical_batch(statistics.fmean(g for g, _ in terms), statistics.fmean(t for _, t in terms))
    return scale / (tokens / rows) if scale is not None else None


#: arms whose runs need the most memory (fixed_8: about 13 GB at its peak on one thread, fixed_4 about 8 GB)
HEAVY_ARMS = frozenset({'fixed_8'})


@contextlib.contextmanager
def heavy_run(folder: str, arm: str):
    """Hold the study's memory lock (``folder/memory.lock``, an exclusive ``flock``) while a run of a heavy arm runs;
    other arms run free. Two streams never run two heavy runs at once (two fixed_8 runs need about 26 GB: the OOM
    killer ends one, and its stream with it); the second waits."""
    if arm not in HEAVY_ARMS:
        yield
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'memory.lock'), 'w', encoding='utf-8') as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f'{arm}: waiting for another stream\'s heavy run (memory)', flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def claim(claims: str, run: str) -> bool:
    """Claims ``run`` for this process (a file in the folder ``claims`` holding its PID, made atomically): True when
    this process may run it, False while another live process holds it. A claim whose process is gone (a stream
    stopped mid-run) is taken over. Two study streams sharing ``claims`` and ``--jsonl`` never run the same run."""
    os.makedirs(claims, exist_ok=True)
    path = os.path.join(claims, run)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if claim_alive(path):
                return False
            os.remove(path)  # its process is gone: take it over
            continue
        with os.fdopen(fd, 'w') as f:
            f.write(str(os.getpid()))
        return True
    return False


def claim_alive(path: str) -> bool:
    """Whether the process that wrote the claim ``path`` still runs (a claim being written counts as alive)."""
    try:
        with open(path, encoding='utf-8') as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return False
    if pid == 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pending_claims(claims: str, jsonl: str) -> list[str]:
    """The live claims in ``claims`` without their line in ``jsonl``: runs another stream is running now."""
    if not os.path.isdir(claims):
        return []
    done = {run_key(r['arm'], r['seed'], r['adam_beta2']) for r in read_jsonl([jsonl])}
    return sorted(n for n in os.listdir(claims) if n not in done and claim_alive(os.path.join(claims, n)))


def wait_for_claims(claims: str, jsonl: str, poll: float = 30.0, *, unless=None) -> None:
    """Waits until every live claim in ``claims`` has its line in ``jsonl``: a stream picks LRs or looks at the
    reporting seeds only on every run that another stream has started. ``unless(pending)``: True when the runs
    pending cannot change what is picked (another stream runs the very runs this pick asks for): no wait."""
    while True:
        pending = pending_claims(claims, jsonl)
        if not pending or (unless is not None and unless(pending)):
            return
        print(f'waiting for the runs of another stream: {", ".join(pending)}', file=sys.stderr, flush=True)
        time.sleep(poll)


def cannot_change(pending: list[str], args: argparse.Namespace) -> bool:
    """Whether runs another stream is running (``pending`` claims) cannot change what ``--pick`` prints, so the pick
    need not wait for them: the beta2 rule reads only the baseline at ``--lrs[0]`` on the tuning seeds, ``best`` and
    ``extend`` only the tuning seeds (and an extension round's own runs change nothing of it), the futility look
    only ``--report-seeds``. The tables wait for every run."""
    keys = [parse_run_key(p) for p in pending]
    if None in keys:
        return False
    tune = set(args.tune_seeds)
    if args.pick == 'beta2':
        return all(name != run_name('baseline', args.lrs[0]) or seed not in tune for name, _, seed in keys)
    if args.pick == 'best':
        return all(seed not in tune for _, _, seed in keys)
    if args.pick == 'extend':
        asked = {(run_name(arm, float(lr)), seed) for arm, lr in
                 (x.split() for x in pick_lrs(read_jsonl(args.from_jsonl), args.tune_seeds, args.beta2, 'extend'))
                 for seed in args.tune_seeds}
        return all(seed not in tune or (name, seed) in asked for name, _, seed in keys)
    if args.pick == 'futility':
        return all(seed not in set(args.report_seeds or []) for _, _, seed in keys)
    return args.pick == 'incomplete'  # a list of runs to claim: never waits


def run_key(name: str, seed: int, beta2: float) -> str:
    """One run's name in file names (its log folder, its claim)."""
    return f'{name}-b{beta2:g}-seed{seed}'


def parse_run_key(key: str) -> tuple[str, float, int] | None:
    """``(name, beta2, seed)`` of a :func:`run_key` name; ``None`` for any other name."""
    m = re.match(r'^(.*)-b([0-9.e+-]+)-seed(\d+)$', key)
    return (m.group(1), float(m.group(2)), int(m.group(3))) if m else None


def run_name(arm: str, lr: float) -> str:
    return f'{arm}@{lr:.3g}'


def read_jsonl(paths: list[str]) -> list[dict]:
    results = []
    for path in paths:
        if os.path.exists(path):
            with open(path, encoding='utf-8') as f:
                results += [json.loads(line) for line in f if line.strip()]
    return results


def pick_beta2(results: list[dict], seeds: list[int], lr: float, *, tolerance: float = 0.003) -> str:
    """The study's beta2 rule (issue 39): ``0.95`` for every arm if the baseline at ``lr`` with beta2 0.95 is within
    ``tolerance`` (0.3 %) of 0.999 on the mean over the tuning ``seeds``; else ``0.999`` (then Adam's memory needs the
    moment rescaling the issue names). ``''`` while a run is missing."""
    name = run_name('baseline', lr)
    means = {}
    for beta2 in (0.999, 0.95):
        losses = {r['seed']: r['eval_loss'] for r in results
                  if r['arm'] == name and r['adam_beta2'] == beta2 and r['seed'] in seeds}
        if len(losses) < len(seeds):
            return ''
        means[beta2] = statistics.fmean(losses.values())
    return '0.95' if means[0.95] <= means[0.999] * (1 + tolerance) else '0.999'


def tuning_grid(results: list[dict], seeds: list[int], beta2: float) -> dict[str, dict[str, float]]:
    """``{arm: {lr: mean eval loss}}`` over the LRs run on every tuning seed at ``beta2``."""
    grid: dict[str, dict[str, dict[int, float]]] = {}
    for r in results:
        if r['adam_beta2'] == beta2 and r['seed'] in seeds:
            arm, _, lr = r['arm'].partition('@')
            grid.setdefault(arm, {}).setdefault(lr, {})[r['seed']] = r['eval_loss']
    return {arm: {lr: statistics.fmean(by.values()) for lr, by in lrs.items() if len(by) == len(seeds)}
            for arm, lrs in grid.items()}


def incomplete_rungs(results: list[dict], seeds: list[int], beta2: float) -> list[str]:
    """``"arm lr"`` lines: the LRs run at ``beta2`` on some of the tuning seeds ``seeds`` but not all (a rung another
    stream has not finished, or not even claimed yet). A stream runs them before it picks (``best`` and ``extend``
    read only complete rungs), so a pick never misses a rung the study started."""
    ran: dict[tuple[str, str], set[int]] = {}
    for r in results:
        if r['adam_beta2'] == beta2 and r['seed'] in seeds:
            arm, _, lr = r['arm'].partition('@')
            ran.setdefault((arm, lr), set()).add(r['seed'])
    return [f'{arm} {lr}' for (arm, lr), done in sorted(ran.items()) if done != set(seeds)]


def pick_lrs(results: list[dict], seeds: list[int], beta2: float, what: str) -> list[str]:
    """``best``: ``"arm lr"`` lines, each arm's LR with the lowest mean eval loss on the tuning seeds; ``extend``:
    ``"arm lr"`` lines, the next rung of :data:`LADDER` past an arm's best LR when that best is the lowest or highest
    LR it ran (the optimum is not bracketed yet)."""
    out = []
    for arm, by_lr in sorted(tuning_grid(results, seeds, beta2).items()):
        if not by_lr:
            continue
        best = min(by_lr, key=by_lr.get)
        if what == 'best':
            out.append(f'{arm} {best}')
            continue
        ran = sorted(by_lr, key=float)
        if best not in LADDER:
            continue
        i = LADDER.index(best)
        if best == ran[0] and i > 0:
            out.append(f'{arm} {LADDER[i - 1]}')
        if best == ran[-1] and i + 1 < len(LADDER):
            out.append(f'{arm} {LADDER[i + 1]}')
    return out


#: the futility look's limit, stated in advance: an arm whose mean paired difference is above it is stopped
FUTILITY_LIMIT = 0.015
#: an arm run only as another arm's control: the look that stops the other stops it too (growth_study.sh, STAGE=c)
CONTROL_OF = {'twin_c': 'seesaw_c'}


def look_means(results: list[dict], seeds: list[int], beta2: float, chosen: dict[str, str]) -> dict[str, float]:
    """``{arm: mean}``: each arm of ``chosen`` (``arm -> lr``, the baseline's LR among them) run on every one of
    ``seeds``, with its mean paired relative eval loss difference against the baseline over them."""
    by = {(r['arm'], r['seed']): r['eval_loss'] for r in results if r['adam_beta2'] == beta2}
    ref = run_name('baseline', float(chosen['baseline']))
    out = {}
    for arm, lr in chosen.items():
        name = run_name(arm, float(lr))
        deltas = [by[(name, s)] / by[(ref, s)] - 1 for s in seeds if (name, s) in by and (ref, s) in by]
        if arm != 'baseline' and len(deltas) == len(seeds):
            out[arm] = statistics.fmean(deltas)
    return out


def futility(results: list[dict], seeds: list[int], beta2: float, chosen: dict[str, str], *,
             limit: float = FUTILITY_LIMIT) -> list[str]:
    """The futility look (stated in advance): the arms whose mean paired eval loss difference against the baseline
    over ``seeds`` is above ``limit`` (+1.5 %): the study stops running them."""
    return [arm for arm, mean in look_means(results, seeds, beta2, chosen).items() if mean > limit]


def planned_seeds(arm: str, report: list[int], futility_at: int) -> list[int]:
    """The reporting seeds ``arm`` is run on: the futility look's (the first ``futility_at``) for the frontier arms,
    every one for the others."""
    return report[:futility_at] if arm in FRONTIER_ARMS else report


def stopped_at_look(results: list[dict], report: list[int], futility_at: int, *,
                    limit: float = FUTILITY_LIMIT) -> dict:
    """``{(arm, beta2): mean}``: the arms the futility look stopped (:func:`look_means` over the first ``futility_at``
    reporting seeds, each arm at the LR it ran there, above ``limit``, and no run on a later reporting seed it was
    planned to run: :func:`planned_seeds`), with that mean; a control (:data:`CONTROL_OF`) run on the look's seeds
    and no later one is stopped with the arm it controls, with that arm's mean."""
    look, later = report[:futility_at], set(report[futility_at:])
    if len(look) < futility_at:
        return {}
    out = {}
    for beta2 in {r['adam_beta2'] for r in results}:
        mine = [r for r in results if r['adam_beta2'] == beta2]
        chosen = dict(r['arm'].split('@') for r in mine if r['seed'] in look)
        if 'baseline' not in chosen:
            continue
        ran_later = {r['arm'].partition('@')[0] for r in mine if r['seed'] in later}
        means = look_means(mine, look, beta2, chosen)
        for arm, mean in means.items():
            planned_later = len(planned_seeds(arm, report, futility_at)) > len(look)
            if mean > limit and planned_later and arm not in ran_later:
                out[(arm, beta2)] = mean
        for control, arm in CONTROL_OF.items():
            if (arm, beta2) in out and control in means and control not in ran_later:
                out[(control, beta2)] = out[(arm, beta2)]
    return out


def tables(results: list[dict], tune: list[int], report: list[int] | None, futility_at: int = 6) -> None:
    """The tuning grid per beta2, then (with reporting seeds) the paired comparisons: each arm against the baseline,
    the growth arms (``growth_b``, ``seesaw_c``) against ``control_a`` (the issue's goal: lower loss than A at the
    same steps) and ``seesaw_c`` against ``twin_c``; an arm the futility look stopped
    (after the first ``futility_at`` reporting seeds) is marked so, its verdict final; the frontier arms count
    their seeds against the look's (:func:`planned_seeds`)."""
    for beta2 in sorted({r['adam_beta2'] for r in results}, reverse=True):
        seen: dict[str, dict[str, list[float]]] = {}
        for r in results:
            if r['adam_beta2'] == beta2 and r['seed'] in tune:
                arm, _, lr = r['arm'].partition('@')
                seen.setdefault(arm, {}).setdefault(lr, []).append(r['eval_loss'])
        if not seen:
            continue
        grid = tuning_grid(results, tune, beta2)
        lrs = sorted({lr for by in seen.values() for lr in by}, key=float)
        print(f'\ntuning, beta2 {beta2:g}, mean eval loss over seeds {tune} (token-weighted held-out loss); bold: the '
              'arm\'s best; "(1 of 2)": not on every tuning seed yet')
        print('| arm | ' + ' | '.join(lrs) + ' |')
        print('|---|' + '---:|' * len(lrs))
        for arm in sorted(seen):
            best = min(grid.get(arm, {}).values(), default=None)
            cells = []
            for lr in lrs:
                losses = seen[arm].get(lr)
                if not losses:
                    cells.append('–')
                elif lr not in grid.get(arm, {}):
                    cells.append(f'{statistics.fmean(losses):.4f} ({len(losses)} of {len(tune)})')
                else:
                    cells.append(f'**{grid[arm][lr]:.4f}**' if grid[arm][lr] == best else f'{grid[arm][lr]:.4f}')
            print(f'| {arm} | ' + ' | '.join(cells) + ' |')
    print('\nevery run (wall s: model load, training and the eval; B_simple: the gradient noise scale, from '
          'the means of its terms over the run):')
    print('| arm | beta2 | seed | steps | passes | eval loss | train loss | wall s | eval s | B_simple (rows) |')
    print('|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
    for r in results:
        scale = noise_scale(r.get('steps', {}))
        print(f'| {r["arm"]} | {r["adam_beta2"]:g} | {r["seed"]} | {r["optimizer_steps"]} | {r.get("passes", "-")} | '
              f'{r["eval_loss"]:.5f} | {r["train_loss"]:.4f} | {r["wall_s"]:.0f} | {r.get("eval_s", "-")} | '
              f'{f"{scale:.1f}" if scale is not None else "-"} |')
    if not report:
        return
    mine = [r for r in results if r['seed'] in report]
    stopped = stopped_at_look(mine, report, futility_at)
    # a reference other than the baseline: the growth arms it is the same-steps control of
    only = {'control_a': ('growth_b', 'seesaw_c'), 'twin_c': ('seesaw_c',)}
    for ref_arm, what in (('baseline', 'against the baseline'), ('control_a', 'the growth arms against control A'),
                          ('twin_c', 'seesaw_c against its fixed-batch twin')):
        by = {(r['arm'].partition('@')[0], r['adam_beta2'], r['seed']): r for r in mine}
        print(f'\n{what}, paired by seed over the reporting seeds (relative eval loss difference, 95 % paired-t; '
              + ('goal: >= 40 % fewer optimizer steps on every seed and the interval below +1 %'
                 if ref_arm == 'baseline' else 'goal: the interval below 0') + '):')
        print('| arm | beta2 | seeds | steps saved | mean | 95 % interval | goal |')
        print('|---|---:|---:|---:|---:|---:|---|')
        for arm, beta2 in sorted({(k[0], k[1]) for k in by}):
            if arm == ref_arm or (ref_arm in only and arm not in only[ref_arm]):
                continue
            pairs = [(by[(arm, beta2, s)], by[(ref_arm, beta2, s)]) for s in report
                     if (arm, beta2, s) in by and (ref_arm, beta2, s) in by]
            if not pairs:
                continue
            deltas = [m['eval_loss'] / t['eval_loss'] - 1 for m, t in pairs]
            saved = 1 - statistics.fmean(m['optimizer_steps'] for m, _ in pairs) / statistics.fmean(
                t['optimizer_steps'] for _, t in pairs)
            mean, low, high = bench_quality.paired_interval(deltas)
            verdict = goal(pairs, high, ref_arm == 'baseline', len(planned_seeds(arm, report, futility_at)))
            if (arm, beta2) in stopped:
                rival = CONTROL_OF.get(arm)
                verdict = (f'not shown: stopped at the futility look after {futility_at} seeds'
                           + (f' with {rival}, whose control it is ({rival}\'s mean' if rival else ' (mean')
                           + f' {stopped[(arm, beta2)]:+.2%} against the baseline, above +1.5 %)')
            print(f'| {arm} | {beta2:g} | {len(pairs)} | {saved:.0%} | {mean:+.2%} | [{low:+.2%}, {high:+.2%}] | '
                  f'{verdict} |')


def goal(pairs: list[tuple[dict, dict]], high: float, against_baseline: bool, seeds: int) -> str:
    """The issue's goal for one paired comparison: against the baseline, >= 40 % fewer optimizer steps on every
    seed and the upper end of the 95 % interval below +1 %; against a rival at the same steps, the interval below
    0. "met" / "not shown (why)", with "n of N seeds" while seeds are missing."""
    why = []
    if against_baseline and any(m['optimizer_steps'] > 0.6 * t['optimizer_steps'] for m, t in pairs):
        why.append('fewer than 40 % of the steps saved')
    if not high < (0.01 if against_baseline else 0.0):
        why.append(f'interval up to {high:+.2%}')
    verdict = 'met' if not why else f'not shown ({"; ".join(why)})'
    return verdict if len(pairs) >= seeds else f'{verdict}, {len(pairs)} of {seeds} seeds'


def gpu_seconds(clock: list[dict]) -> tuple[dict[str, float], str]:
    """``({arm: mean training seconds on the device}, device)`` from ``growth_clock.py``'s arm lines (warm-up runs
    left out)."""
    by: dict[str, list[float]] = {}
    device = ''
    for line in clock:
        if line.get('kind') == 'arm' and not line.get('warmup'):
            by.setdefault(line['arm'], []).append(line['train_s'])
            device = line.get('device', device)
    return {arm: statistics.fmean(v) for arm, v in by.items()}, device


def pass_cost(grid: dict[tuple[int, int], float], rows: float, length: float) -> float:
    """Seconds of one pass of ``rows`` rows padded to ``length`` tokens from the measured ``{(rows, length): s}``
    grid: the nearest measured row count (on a log scale), linear in length between the measured lengths, the
    nearest one outside them."""
    row = min(sorted({r for r, _ in grid}), key=lambda r: abs(math.log(r) - math.log(max(rows, 1e-9))))
    cells = sorted((n, t) for (r, n), t in grid.items() if r == row)
    if length <= cells[0][0]:
        return cells[0][1]
    for (n0, t0), (n1, t1) in zip(cells, cells[1:]):
        if length <= n1:
            return t0 + (t1 - t0) * (length - n0) / (n1 - n0)
    return cells[-1][1]


def layout_seconds(steps: dict[str, list], grid: dict[tuple[int, int], float], optimizer: float,
                   total: tuple[int, int] | None = None) -> float:
    """Seconds of a run's passes and optimizer steps priced from its pass layout: each step's passes at the grid's
    cost of (rows a pass, padded tokens a row). A line without per-step passes (the runs before they were logged)
    is priced from ``total`` = (its passes, its padded tokens), every step's rows split evenly."""
    out = 0.0
    batches, passes, padded = steps['batch'], steps.get('passes'), steps.get('padded')
    if not passes or not padded:
        n_passes, n_padded = total
        rows = sum(batches)
        passes = [max(1, round(n_passes * b / rows)) for b in batches]
        padded = [n_padded * b / rows for b in batches]
    for batch, n, tokens in zip(batches, passes, padded):
        if n:
            out += n * pass_cost(grid, batch / n, tokens / batch) + optimizer
    return out


def gpu_estimates(clock: list[dict]) -> tuple[dict[tuple[int, int], float], float, float] | None:
    """(the pass grid, the optimizer step's seconds, the calibration factor) from ``growth_clock.py`` lines, or None
    without a grid. The factor is the median over the measured arm runs of their measured training seconds over their
    own layout's price: what the Trainer and ms-swift add to the bare passes."""
    cells: dict[tuple[int, int], list[float]] = {}
    for line in clock:
        if line.get('kind') == 'pass' and line.get('seconds'):
            cells.setdefault((line['rows'], line['length']), []).append(line['seconds'])
    if not cells:
        return None
    grid = {k: statistics.median(v) for k, v in cells.items()}
    optimizer = statistics.median([x['seconds'] for x in clock if x.get('kind') == 'optimizer_step'] or [0.0])
    ratios = [line['train_s'] / layout_seconds(line, grid, optimizer) for line in clock
              if line.get('kind') == 'arm' and not line.get('warmup') and line.get('passes')]
    return grid, optimizer, statistics.median(ratios) if ratios else 1.0


def frontier(results: list[dict], tune: list[int], report: list[int], clock: list[dict], png: str | None) -> None:
    """Each arm at its best LR (chosen on the tuning seeds): steps, passes, GPU seconds (``--clock``) and mean eval
    loss over the reporting seeds every arm shown ran (so the points compare on the same seeds; an arm that ran
    none is shown without a loss); with ``png`` a figure of eval loss against optimizer steps and against GPU
    seconds (the priced estimate where there is one: the same method for every arm), the fixed micro-batches
    {1, 2, 4, 8} joined as the frontier."""
    beta2 = pick_beta2(results, tune, 2e-3) or '0.95'
    chosen = dict(line.split() for line in pick_lrs(results, tune, float(beta2), 'best'))
    seconds, device = gpu_seconds(clock)
    estimate = gpu_estimates(clock)
    names = {arm: run_name(arm, float(chosen[arm])) for arm in ARMS if arm in chosen}
    reported = {name: [r for r in results if r['arm'] == name and r['adam_beta2'] == float(beta2)
                       and r['seed'] in report] for name in names.values()}
    ran = [{r['seed'] for r in runs} for runs in reported.values() if runs]
    common = sorted(set.intersection(*ran)) if ran else []
    points = []
    print(f'\nthe frontier (beta2 {beta2}; each arm at its LR chosen on seeds {tune}; eval loss: the mean over the '
          f'reporting seeds every arm ran, {common}; GPU s: training on {device or "no GPU measured"}, '
          'scripts/growth_clock.py, '
          'measured on its seeds; est.: each run of the arm priced from its own pass layout by the measured cost of '
          f'a pass{f" x {estimate[2]:.2f} (the measured runs over their priced layouts)" if estimate else ""}):')
    print('| arm | LR | steps | passes | GPU s | GPU s est. | reporting seeds | mean eval loss |')
    print('|---|---:|---:|---:|---:|---:|---:|---:|')
    for arm, name in names.items():
        runs = [r for r in reported[name] if r['seed'] in common]
        any_run = next((r for r in results if r['arm'] == name), None)
        loss = statistics.fmean(r['eval_loss'] for r in runs) if runs else None
        priced = None
        if estimate is not None:
            grid, optimizer, factor = estimate
            priced = statistics.fmean(
                factor * layout_seconds(r['steps'], grid, optimizer, (r['passes'], r['padded_tokens']))
                for r in runs or [any_run])
        gpu = priced or seconds.get(arm)  # the figure: one method for every arm (a single measured run can be off)
        points.append((arm, any_run['optimizer_steps'], gpu, loss))
        print(f'| {arm} | {chosen[arm]} | {any_run["optimizer_steps"]} | {any_run.get("passes", "-")} | '
              f'{f"{seconds[arm]:.1f}" if arm in seconds else "-"} | {f"{priced:.1f}" if priced else "-"} | '
              f'{len(runs)} | {f"{loss:.5f}" if loss is not None else "-"} |')
    if png and any(p[3] is not None for p in points):
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        priced_note = ', priced from the passes of each run' if estimate else ''
        clock_label = f'GPU seconds ({device}{priced_note})'
        for ax, k, label in ((axes[0], 1, 'optimizer steps'), (axes[1], 2, clock_label)):
            fixed = sorted((p[k], p[3]) for p in points if p[0] in FIXED and p[3] is not None and p[k] is not None)
            if fixed:
                ax.plot(*zip(*fixed), 'o-', color='gray', label='fixed micro-batch 1, 2, 4, 8')
            for arm, steps, gpu, loss in points:
                x = steps if k == 1 else gpu
                if loss is not None and x is not None:
                    ax.annotate(arm, (x, loss), fontsize=8)
                    if arm not in FIXED:
                        ax.plot([x], [loss], 's', label=arm)
            ax.set_xscale('log')
            ticks = [x for x, _ in fixed]  # the frontier's points (a growth arm's may sit on one of them)
            ax.set_xticks(ticks, [f'{t:.3g}' for t in ticks])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(label)
            ax.set_ylabel('eval loss (500 held-out rows)')
            ax.legend(fontsize=8)
        fig.suptitle(f'each arm at its LR tuned on seeds {tune}; mean eval loss over seeds {common}', fontsize=9)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        print(f'figure: {png}')



def run_grid(args: argparse.Namespace, done: set, run) -> None:
    """Every run of ``args.seeds`` x ``args.lrs`` x ``args.arms`` whose ``(run name, seed, beta2)`` is not in
    ``done``: claimed when ``args.claims`` is set (another stream's claim skips it; a failed run gives its claim
    back), run (``run(arm, lr, seed) -> result``), its JSON line printed and appended to ``args.jsonl``."""
    for seed in args.seeds:
        for lr in args.lrs:
            for arm in args.arms:
                if (run_name(arm, lr), seed, args.beta2) in done:
                    continue
                key = run_key(run_name(arm, lr), seed, args.beta2)
                if args.claims and not claim(args.claims, key):
                    print(f'{key}: claimed by another stream, skipped', flush=True)
                    continue
                try:
                    result = run(arm, lr, seed)
                except BaseException:
                    if args.claims:  # failed: another try may run it
                        os.remove(os.path.join(args.claims, key))
                    raise
                line = json.dumps(result)
                print(line, flush=True)
                if args.jsonl:
                    with open(args.jsonl, 'a', encoding='utf-8') as f:
                        f.write(line + '\n')

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--samples', type=int, default=128, help='GSM8K train rows (one epoch), at most 500')
    parser.add_argument('--eval-rows', type=int, default=TEST_ROWS, help=f'held-out rows, at most {TEST_ROWS}')
    parser.add_argument('--seeds', type=int, nargs='+', default=[0])
    parser.add_argument('--arms', nargs='+', default=list(ARMS), choices=ARMS)
    parser.add_argument('--lrs', type=float, nargs='+', default=[2e-3], help='every arm of --arms at each LR')
    parser.add_argument('--beta2', type=float, default=0.999, help='Adam beta2 (adam_beta2) of every run')
    parser.add_argument('--model', choices=('smollm2', 'tiny'), default='smollm2')
    parser.add_argument('--ga', type=int, default=2, help='gradient_accumulation_steps of every arm')
    parser.add_argument('--max-length', type=int, default=512)
    parser.add_argument('--out', default=os.path.join(ROOT, 'output', 'bench_growth_study'))
    parser.add_argument('--jsonl', default=None, help='append every result line to this file as it comes')
    parser.add_argument('--skip-done', action='store_true', help='skip the runs (arm, LR, seed, beta2) in --jsonl')
    parser.add_argument('--claims', default=None, metavar='DIR',
                        help='claim each run in this folder first (two streams of the study share it); with '
                             '--from-jsonl: wait until every run claimed there has its line')
    parser.add_argument('--clock', nargs='*', default=None, metavar='FILE',
                        help='with --from-jsonl: growth_clock.py lines (each arm\'s GPU seconds in the frontier table)')
    parser.add_argument('--png', default=None, help='with --from-jsonl: the frontier figure (eval loss against steps '
                                                     'and against GPU seconds)')
    parser.add_argument('--prepare', action='store_true', help='train nothing: the model folder and the data files')
    parser.add_argument('--from-jsonl', nargs='+', default=None, metavar='FILE',
                        help='train nothing: the tables of these result lines (or with --pick, the study\'s choice)')
    parser.add_argument('--tune-seeds', type=int, nargs='+', default=[0, 1])
    parser.add_argument('--report-seeds', type=int, nargs='+', default=None)
    parser.add_argument('--futility-at', type=int, default=6,
                        help='with --from-jsonl: the reporting seeds of the futility look (an arm it stopped: marked)')
    parser.add_argument('--pick', choices=('beta2', 'best', 'extend', 'incomplete', 'futility'), default=None,
                        help='with --from-jsonl: beta2 (the rule on the baseline at --lrs[0]), best / extend / '
                        'incomplete ("arm lr" lines at --beta2), futility (the arms to stop, on --report-seeds, at '
                        'the LRs of best)')
    args = parser.parse_args(argv)
    if not 1 <= args.samples <= 500:
        parser.error(f'--samples: between 1 and 500, got {args.samples}')
    if not 1 <= args.eval_rows <= TEST_ROWS:
        parser.error(f'--eval-rows: between 1 and {TEST_ROWS}, got {args.eval_rows}')
    if args.skip_done and not args.jsonl:
        parser.error('--skip-done: needs --jsonl')
    if args.report_seeds and set(args.report_seeds) & set(args.tune_seeds):
        parser.error('--report-seeds and --tune-seeds must not share a seed')
    if args.from_jsonl is not None:
        if args.claims:
            wait_for_claims(args.claims, args.from_jsonl[0], unless=lambda pending: cannot_change(pending, args))
        results = read_jsonl(args.from_jsonl)
        if args.pick == 'beta2':
            print(pick_beta2(results, args.tune_seeds, args.lrs[0]))
        elif args.pick in ('best', 'extend'):
            print('\n'.join(pick_lrs(results, args.tune_seeds, args.beta2, args.pick)))
        elif args.pick == 'incomplete':
            print('\n'.join(incomplete_rungs(results, args.tune_seeds, args.beta2)))
        elif args.pick == 'futility':
            chosen = dict(line.split() for line in pick_lrs(results, args.tune_seeds, args.beta2, 'best'))
            print('\n'.join(futility(results, args.report_seeds or [], args.beta2, chosen)))
        else:
            tables(results, args.tune_seeds, args.report_seeds, args.futility_at)
            if args.report_seeds or args.clock:
                frontier(results, args.tune_seeds, args.report_seeds or [], read_jsonl(args.clock or []), args.png)
        return 0
    model, flags, train, test = prepare(args.model, args.samples, args.eval_rows, os.path.join(ROOT, '.cache', 'bench'))
    if args.prepare:
        return 0
    done = set()
    if args.skip_done:
        done = {(r['arm'], r['seed'], r['adam_beta2']) for r in read_jsonl([args.jsonl])}

    def run(arm: str, lr: float, seed: int) -> dict:
        with heavy_run(args.out, arm):
            return run_arm(arm, lr, seed, args.beta2, args, model, flags, train, test)

    run_grid(args, done, run)
    return 0


if __name__ == '__main__':
    sys.exit(main())

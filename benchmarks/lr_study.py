"""The LR schedule study (issue 49): HF's cosine (the tuned baseline of issue 39) against the pack's warmup -> hold ->
cosine, step decay at two sets of cut points, warmup-stable-decay and loss-plateau restarts, each at its own tuned LR,
on the growth study's model, rows, seeds and eval (SmolLM2-135M-Instruct LoRA, 128 GSM8K train rows once, micro-batch
1 x GA 2 = 64 optimizer steps, Adam beta2 0.95, token-weighted eval loss on 500 held-out GSM8K test rows), one JSON
line per run.

Arms (every arm: the baseline's batch, rows, order and steps; only the LR's shape differs; 10 % linear warmup each):

- ``baseline``: HF ``cosine`` (``warmup_ratio`` 0.1, to 0), plain ms-swift: issue 39's baseline, its lines reused.
- ``whc``: the pack's ``lr_schedule`` warmup 0.1 -> hold 0.2 at the peak -> cosine to ``min_ratio`` 0.01 (the pack's
  default), ``max_restarts: 0``.
- ``restarts``: ``whc`` with loss-plateau restarts at the pack's defaults (``max_restarts`` 3, ``patience`` 10,
  ``cooldown`` 5, ``smooth`` 5, ``restart_factor`` 0.5), at ``whc``'s tuned LR.
- ``step_early``: ``lr_schedule`` ``decay: steps`` x1, x1/2 from a quarter of the rows, x1/4 from half: issue 39's
  ``twin_c`` (its lines reused under this name).
- ``step_late``: the same with the cuts at half and three quarters.
- ``wsd``: HF ``warmup_stable_decay``: the peak held, then a ``1-sqrt`` cooldown to 0 over the last 20 % of the
  steps (Hagele et al. 2024's best cooldown); ``wsd_linear``: the same with a linear cooldown.

The plan, stated before the first run (docs/results-log.md has it with its outcome):
0. a reproduction check: ``baseline`` at 1.41e-3 on seed 2 again; issue 39's lines are reused only if it gives the
   same eval loss within 5e-4 (else the baseline is run again on every seed it is compared on);
1. tuning on seeds 0 and 1 (the LR ladder 2e-3 x sqrt(2)^k): ``step_late``, ``wsd`` and ``whc`` at 1.41e-3, 2e-3
   and 1e-3, then one more rung past an edge (up to 2 rounds); ``wsd_linear`` at ``wsd``'s best LR; the cut points
   (``step_early`` vs ``step_late``) and the cooldown (``wsd`` vs ``wsd_linear``) are picked on the tuning seeds'
   mean at each one's best LR: the winner is reported, the loser's tuning is its result;
2. reporting seeds 2-5: ``whc``, ``restarts`` (at ``whc``'s LR), the step winner and the WSD winner; then the
   futility look (:data:`LOOK_LIMIT`): an arm whose mean paired difference against the baseline is above +0.5 % is
   stopped; the others run seeds 6-9 (8 reporting seeds);
3. the budget: about 55 runs on one core (about 10 minutes each: 9-10 hours); a second data set (alpaca-gpt4,
   ``--data alpaca``) follows with the baseline and the two best arms, tuned there on seeds 0-1.

Usage (``scripts/lr_study.sh`` runs the study; the demo extra is needed, see ``scripts/main_job.sh``):
    python scripts/bench_lr_study.py --arms wsd --lrs 1.41e-3 --seeds 0 --jsonl docs/figures/lr_49.jsonl --skip-done
    python scripts/bench_lr_study.py --model tiny --samples 16 --eval-rows 8 --arms wsd whc --lrs 1e-3  # smoke
    python scripts/bench_lr_study.py --from-jsonl docs/figures/lr_49.jsonl --reuse docs/figures/growth_39.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import sys
from typing import Mapping

from benchmarks import growth_study as growth  # the growth study's probe, run and claim machinery
from benchmarks import quality as bench_quality

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARMS = ('baseline', 'whc', 'restarts', 'step_early', 'step_late', 'wsd', 'wsd_linear')
#: issue 39's arm names -> this study's (the same settings; their lines are reused)
REUSED = {'baseline': 'baseline', 'twin_c': 'step_early'}
WARMUP = 0.1
#: ``lr_schedule`` settings of the pack's arms
PACK = {
    'whc': {'warmup': WARMUP, 'hold': 0.2, 'max_restarts': 0},
    'restarts': {'warmup': WARMUP, 'hold': 0.2},  # the pack's defaults: 3 restarts, patience 10, cooldown 5, ...
    'step_early': dict(growth.STEP_SCHEDULE),
    'step_late': {'decay': 'steps', 'steps': {0.5: 0.5, 0.75: 0.25}, 'warmup': WARMUP, 'max_restarts': 0},
}
#: HF ``warmup_stable_decay``: the cooldown's shape and its share of the steps
WSD = {'wsd': ('1-sqrt', 0.2), 'wsd_linear': ('linear', 0.2)}
#: the futility look's limit, stated in advance: an arm whose mean paired difference is above it is stopped
LOOK_LIMIT = 0.005
ALPACA_FILE = os.path.join(ROOT, 'scripts', 'assets', 'alpaca-gpt4-en-demo.json.gz')
#: the second data set's held-out rows (the last of a fixed permutation; the train rows are its first ``--samples``)
ALPACA_TEST_ROWS = 300
#: the data sets: default held-out rows and max_length (Alpaca's answers run to 560 tokens: none is cut or dropped)
DATA = {'gsm8k': {'eval_rows': growth.TEST_ROWS, 'max_length': 512},
        'alpaca': {'eval_rows': ALPACA_TEST_ROWS, 'max_length': 1024}}


def alpaca_rows() -> list[dict]:
    """The 999 Alpaca-GPT4 rows as ``messages`` (user: the instruction, then the input after a blank line when there
    is one; assistant: the output), in a fixed permutation (seed 0): train rows from its start, held-out rows from
    its end."""
    with gzip.open(ALPACA_FILE, 'rt', encoding='utf-8') as f:
        items = json.load(f)
    rows = [{'messages': [{'role': 'user', 'content': r['instruction'] + (f'\n\n{r["input"]}' if r['input'] else '')},
                          {'role': 'assistant', 'content': r['output']}]} for r in items]
    random.Random(0).shuffle(rows)
    return rows


def prepare(data: str, model: str, samples: int, eval_rows: int, root: str) -> tuple[str, dict, str, str]:
    """The model folder, its flags, the train rows and the held-out rows of data set ``data``."""
    if data == 'gsm8k':
        return growth.prepare(model, samples, eval_rows, root)
    model_dir, flags, _, _ = growth.prepare(model, 1, 1, root)
    rows = alpaca_rows()
    if samples + eval_rows > len(rows):
        raise ValueError(f'--samples + --eval-rows: at most {len(rows)} Alpaca rows, got {samples} + {eval_rows}')
    test_rows = rows[-eval_rows:]
    test_rows.sort(key=lambda r: sum(len(m['content']) for m in r['messages']))  # shortest first (less padding)
    paths = []
    parts = ((f'alpaca-train-{samples}.jsonl', rows[:samples]), (f'alpaca-test-{eval_rows}.jsonl', test_rows))
    for name, part in parts:
        path = os.path.join(root, name)
        tmp = f'{path}.{os.getpid()}.tmp'  # whole, then renamed: a run of another stream may be reading it
        with open(tmp, 'w', encoding='utf-8') as f:
            f.writelines(json.dumps(r) + '\n' for r in part)
        os.replace(tmp, path)
        paths.append(path)
    return model_dir, flags, paths[0], paths[1]


def arm_settings(arm: str, steps: int) -> tuple[dict, dict, list[str]]:
    """(ms-swift overrides, pack settings, pack callbacks) of one arm of a run of ``steps`` optimizer steps."""
    if arm == 'baseline':
        return {}, {}, []
    if arm in PACK:
        return {}, {'lr_schedule': dict(PACK[arm])}, ['lr_schedule']
    if arm in WSD:
        shape, share = WSD[arm]
        return ({'lr_scheduler_type': 'warmup_stable_decay',
                 'lr_scheduler_kwargs': {'num_decay_steps': round(share * steps), 'decay_type': shape}}, {}, [])
    raise ValueError(f'--arms: one of {", ".join(ARMS)}, got {arm!r}')


def run_arm(arm: str, lr: float, seed: int, beta2: float, args: argparse.Namespace, model: str, flags: dict,
            train: str, test: str) -> dict:
    """One run: the growth study's baseline settings (micro-batch 1, GA ``--ga``, HF cosine with 10 % warmup) with
    this arm's LR shape, its probe and its line."""
    name = growth.run_name(arm, lr)
    out = os.path.join(args.out, growth.run_key(name, seed, beta2))
    steps = -(-args.samples // args.ga)
    overrides, pack, callbacks = arm_settings(arm, steps)
    probe = growth.make_probe()
    gargs = argparse.Namespace(samples=args.samples, ga=args.ga, max_length=args.max_length)
    kwargs, settings = growth.sft_settings('baseline', lr, seed, beta2, gargs, model, flags, train, out,
                                           [*callbacks, 'growth_probe'], val_dataset=[test],
                                           per_device_eval_batch_size=4)
    kwargs.update(overrides)  # the LR shape (HF's scheduler) replaces the baseline's cosine
    settings.update(pack)
    wall, train_rows = growth.train_run(kwargs, settings, {'growth_probe': probe})
    last = train_rows[-1]
    recorder = probe.last
    restarts = max((int(float(r.get('dynamic/lr_restarts', 0))) for r in train_rows), default=0)
    return {
        'arm': name, 'seed': seed, 'adam_beta2': beta2, 'lr': lr, 'data': args.data,
        'optimizer_steps': int(str(last['global_step/max_steps']).split('/')[0]),
        'train_loss': round(statistics.fmean(float(r['loss']) for r in train_rows[-3:]), 4),
        'eval_loss': round(recorder.eval['eval_loss'], 5),
        'eval_tokens': recorder.eval['eval_tokens'],
        'eval_rows': args.eval_rows,
        'eval_rows_seen': recorder.eval['eval_rows_seen'],
        'wall_s': round(wall, 1),
        'eval_s': round(recorder.eval['eval_s'], 1),
        'lr_restarts': restarts,
        'steps': growth.step_log(train_rows, recorder.steps),
    }


def read(paths: list[str], reuse: list[str], data: str) -> list[dict]:
    """This study's lines of data set ``data`` and the reused lines of issue 39 (``reuse``: GSM8K), renamed."""
    out = [r for r in growth.read_jsonl(paths) if r.get('data', 'gsm8k') == data]
    if data == 'gsm8k':
        for r in growth.read_jsonl(reuse):
            arm, _, lr = r['arm'].partition('@')
            if arm in REUSED:
                out.append({**r, 'arm': f'{REUSED[arm]}@{lr}', 'data': 'gsm8k', 'reused': True})
    return out


def reproduction(results: list[dict], lr: str = '0.00141', seed: int = 2) -> tuple[float, float] | None:
    """(this study's, issue 39's) eval loss of the baseline at ``lr`` on ``seed``: the check that allows the reuse."""
    name = f'baseline@{lr}'
    mine = [r['eval_loss'] for r in results if r['arm'] == name and r['seed'] == seed and not r.get('reused')]
    theirs = [r['eval_loss'] for r in results if r['arm'] == name and r['seed'] == seed and r.get('reused')]
    return (mine[0], theirs[0]) if mine and theirs else None


def best_lrs(results: list[dict], tune: list[int], beta2: float) -> dict[str, str]:
    """``{arm: LR}``: each arm's LR with the lowest mean eval loss over the tuning seeds (rungs run on all of them)."""
    return dict(line.split() for line in growth.pick_lrs(dedupe(results), tune, beta2, 'best'))


def dedupe(results: list[dict]) -> list[dict]:
    """One line per (arm, seed, beta2): this study's own over a reused one (the reproduction check's run)."""
    by: dict[tuple, dict] = {}
    for r in sorted(results, key=lambda r: not r.get('reused')):
        by[(r['arm'], r['seed'], r['adam_beta2'])] = r
    return list(by.values())


def winners(results: list[dict], tune: list[int], beta2: float) -> dict[str, str]:
    """The picks on the tuning seeds: ``{'step': step_early|step_late, 'wsd': wsd|wsd_linear}``, each the one with
    the lower mean at its best LR (a pair is picked once both have a complete rung)."""
    grid = growth.tuning_grid(dedupe(results), tune, beta2)
    out = {}
    for kind, pair in (('step', ('step_early', 'step_late')), ('wsd', ('wsd', 'wsd_linear'))):
        if all(grid.get(a) for a in pair):
            out[kind] = min(pair, key=lambda a: min(grid[a].values()))
    return out


def report_arms(results: list[dict], tune: list[int], beta2: float, data: str = 'gsm8k') -> list[str]:
    """``"arm lr"`` lines: the arms run on the reporting seeds, at their best LRs. GSM8K: ``whc``, the two picks and
    ``restarts`` at ``whc``'s LR; a second data set: every arm tuned there but the baseline (``ALPACA_ARMS``)."""
    best = best_lrs(results, tune, beta2)
    if data != 'gsm8k':
        return [f'{a} {lr}' for a, lr in best.items() if a != 'baseline']
    picks = winners(results, tune, beta2)
    arms = ['whc', *picks.values()]
    out = [f'{a} {best[a]}' for a in arms if a in best]
    if 'whc' in best:
        out.append(f'restarts {best["whc"]}')
    return out


def look(results: list[dict], seeds: list[int], beta2: float, chosen: dict[str, str]) -> list[str]:
    """The futility look: the arms of ``chosen`` whose mean paired difference against the baseline over ``seeds`` is
    above :data:`LOOK_LIMIT`."""
    return growth.futility(dedupe(results), seeds, beta2, chosen, limit=LOOK_LIMIT)


def tables(results: list[dict], tune: list[int], report: list[int], beta2: float, look_at: int,
           data: str = 'gsm8k') -> None:
    """The tuning grid, the picks, and each reported arm against the baseline paired by seed."""
    check = reproduction(results)  # before the dedupe: it compares this study's line with the reused one
    results = dedupe(results)
    grid = growth.tuning_grid(results, tune, beta2)
    lrs = sorted({lr for by in grid.values() for lr in by}, key=float)
    print(f'tuning: mean eval loss over seeds {tune} (bold: the arm\'s best)')
    print('| arm | ' + ' | '.join(lrs) + ' |')
    print('|---|' + '---:|' * len(lrs))
    for arm in sorted(grid):
        best = min(grid[arm].values(), default=None)
        cells = [('–' if lr not in grid[arm] else
                  f'**{grid[arm][lr]:.4f}**' if grid[arm][lr] == best else f'{grid[arm][lr]:.4f}') for lr in lrs]
        print(f'| {arm} | ' + ' | '.join(cells) + ' |')
    if data == 'gsm8k':
        print(f'\npicks on the tuning seeds: {winners(results, tune, beta2)}')
    if check:
        print(f'reproduction check (baseline at 1.41e-3, seed 2): {check[0]:.5f} now, {check[1]:.5f} in issue 39 '
              f'({"reuse allowed" if abs(check[0] - check[1]) <= 5e-4 else "REUSE NOT ALLOWED"})')
    chosen = {'baseline': best_lrs(results, tune, beta2).get('baseline', '0.00141'),
              **dict(line.split() for line in report_arms(results, tune, beta2, data))}
    stopped = look(results, report[:look_at], beta2, chosen) if look_at <= len(report) else []
    ref = growth.run_name('baseline', float(chosen['baseline']))
    print(f'\nagainst the tuned cosine ({ref}), paired by seed over reporting seeds {report} (relative eval loss '
          'difference, 95 % paired-t; goal: the interval below 0):')
    print('| arm | seeds | mean | 95 % interval | restarts a run | verdict |')
    print('|---|---:|---:|---:|---:|---|')
    for arm, lr in chosen.items():
        if arm == 'baseline':
            continue
        name = growth.run_name(arm, float(lr))
        pairs = paired(results, beta2, name, ref, report)
        if not pairs:
            continue
        deltas = [m['eval_loss'] / t['eval_loss'] - 1 for m, t in pairs]
        mean, low, high = bench_quality.paired_interval(deltas)
        restarts = statistics.fmean(m.get('lr_restarts', 0) for m, _ in pairs)
        verdict = 'stopped at the look' if arm in stopped and len(pairs) <= look_at else against_cosine(deltas)
        interval = f'[{low:+.2%}, {high:+.2%}]' if len(deltas) > 1 else '–'
        print(f'| {name} | {len(pairs)} | {mean:+.2%} | {interval} | {restarts:.1f} | {verdict} |')
    effect = restart_effect(results, report, beta2, chosen)
    if effect:
        print(f'\nplateau restarts against the same schedule without them ({effect[0]["arm"]} against '
              f'{effect[0]["ref"]}, paired by seed; a run without a restart is that schedule itself):')
        print('| runs | seeds | restarts a run | mean | 95 % interval |')
        print('|---|---:|---:|---:|---:|')
        for row in effect:
            interval = f'[{row["low"]:+.2%}, {row["high"]:+.2%}]' if row['seeds'] > 1 else '–'
            print(f'| {row["runs"]} | {row["seeds"]} | {row["restarts"]:.1f} | {row["mean"]:+.2%} | {interval} |')


def paired(results: list[dict], beta2: float, name: str, ref: str, seeds: list[int]) -> list[tuple[dict, dict]]:
    """``(run, reference run)`` of every seed of ``seeds`` where both ran (lines at ``beta2``; names as
    :func:`~benchmarks.growth_study.run_name` writes them)."""
    by = {(r['arm'], r['seed']): r for r in results if r['adam_beta2'] == beta2}
    return [(by[(name, s)], by[(ref, s)]) for s in seeds if (name, s) in by and (ref, s) in by]


def restart_effect(results: list[dict], report: list[int], beta2: float, chosen: Mapping[str, str]) -> list[dict]:
    """What plateau restarts change: ``restarts`` against ``whc`` at the same LR (the schedule they restart), paired
    by seed over ``report``; one row for all seeds, one for the runs where a restart fired, one for those where none
    did. Empty where either arm was not run on those seeds (a second data set runs no ``whc``)."""
    if 'restarts' not in chosen:
        return []
    lr = float(chosen['restarts'])
    name, ref = growth.run_name('restarts', lr), growth.run_name('whc', lr)
    pairs = paired(results, beta2, name, ref, report)
    rows = []
    for runs, keep in (('all', lambda n: True), ('a restart fired', lambda n: n > 0), ('none fired', lambda n: n == 0)):
        kept = [(m, t) for m, t in pairs if keep(int(m.get('lr_restarts', 0)))]
        if not kept:
            continue
        deltas = [m['eval_loss'] / t['eval_loss'] - 1 for m, t in kept]
        mean, low, high = bench_quality.paired_interval(deltas)
        rows.append({'arm': name, 'ref': ref, 'runs': runs, 'seeds': len(kept), 'mean': mean, 'low': low,
                     'high': high, 'restarts': statistics.fmean(int(m.get('lr_restarts', 0)) for m, _ in kept)})
    return rows


def pick_unchanged(pending: list[str], args: argparse.Namespace) -> bool:
    """Whether runs another stream is running (``pending`` claims, :func:`~benchmarks.growth_study.run_key` names)
    cannot change what ``--pick`` prints, so it need not wait for them: the LR picks read only the tuning seeds, the
    futility look only the tuning seeds and the look's seeds. The tables wait for every run."""
    keys = [growth.parse_run_key(p) for p in pending]
    if args.pick is None or None in keys:
        return False
    read_seeds = set(args.tune_seeds) | (set(args.report_seeds[:args.look_at]) if args.pick == 'look' else set())
    return all(seed not in read_seeds for _, _, seed in keys)


def against_cosine(deltas: list[float]) -> str:
    """What the paired differences against the tuned cosine show (the issue's goal: the 95 % interval below 0); one
    seed has no interval and shows nothing."""
    if len(deltas) < 2:
        return 'one seed: no interval yet'
    _, low, high = bench_quality.paired_interval(deltas)
    return 'below the cosine' if high < 0 else 'above the cosine' if low > 0 else 'not shown either way'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--data', choices=tuple(DATA), default='gsm8k')
    parser.add_argument('--samples', type=int, default=128)
    parser.add_argument('--eval-rows', type=int, default=None, help='held-out rows (default: 500 GSM8K, 300 Alpaca)')
    parser.add_argument('--seeds', type=int, nargs='+', default=[0])
    parser.add_argument('--arms', nargs='+', default=['baseline'], choices=ARMS)
    parser.add_argument('--lrs', type=float, nargs='+', default=[1.41e-3])
    parser.add_argument('--beta2', type=float, default=0.95)
    parser.add_argument('--model', choices=('smollm2', 'tiny'), default='smollm2')
    parser.add_argument('--ga', type=int, default=2)
    parser.add_argument('--max-length', type=int, default=None, help='default: 512 GSM8K, 1024 Alpaca')
    parser.add_argument('--out', default=os.path.join(ROOT, 'output', 'bench_lr_study'))
    parser.add_argument('--jsonl', default=None)
    parser.add_argument('--skip-done', action='store_true')
    parser.add_argument('--claims', default=None, metavar='DIR',
                        help='a folder shared by two streams on one --jsonl: neither runs a run the other runs')
    parser.add_argument('--prepare', action='store_true')
    parser.add_argument('--from-jsonl', nargs='+', default=None, metavar='FILE')
    parser.add_argument('--reuse', nargs='*', default=[], metavar='FILE', help="issue 39's lines (GSM8K)")
    parser.add_argument('--tune-seeds', type=int, nargs='+', default=[0, 1])
    parser.add_argument('--report-seeds', type=int, nargs='+', default=[2, 3, 4, 5, 6, 7, 8, 9])
    parser.add_argument('--look-at', type=int, default=4)
    parser.add_argument('--pick', choices=('best', 'extend', 'incomplete', 'report', 'look', 'winners'), default=None)
    args = parser.parse_args(argv)
    args.eval_rows = args.eval_rows or DATA[args.data]['eval_rows']
    args.max_length = args.max_length or DATA[args.data]['max_length']
    if set(args.report_seeds) & set(args.tune_seeds):
        parser.error('--report-seeds and --tune-seeds must not share a seed')
    if args.from_jsonl is not None:
        if args.claims:  # another stream's runs that could change what is printed: wait for their lines

            def unchanged(pending: list[str]) -> bool:
                return pick_unchanged(pending, args)

            growth.wait_for_claims(args.claims, args.from_jsonl[0], unless=unchanged)
        results = read(args.from_jsonl, args.reuse, args.data)
        if args.pick in ('best', 'extend', 'incomplete'):
            pick = growth.pick_lrs if args.pick != 'incomplete' else None
            lines = (growth.incomplete_rungs(dedupe(results), args.tune_seeds, args.beta2) if pick is None else
                     pick(dedupe(results), args.tune_seeds, args.beta2, args.pick))
            print('\n'.join(lines))
        elif args.pick == 'report':
            print('\n'.join(report_arms(results, args.tune_seeds, args.beta2, args.data)))
        elif args.pick == 'winners':
            print('\n'.join(f'{k} {v}' for k, v in winners(results, args.tune_seeds, args.beta2).items()))
        elif args.pick == 'look':
            chosen = {'baseline': best_lrs(results, args.tune_seeds, args.beta2).get('baseline', '0.00141'),
                      **dict(line.split() for line in report_arms(results, args.tune_seeds, args.beta2, args.data))}
            print('\n'.join(look(results, args.report_seeds[:args.look_at], args.beta2, chosen)))
        else:
            tables(results, args.tune_seeds, args.report_seeds, args.beta2, args.look_at, args.data)
        return 0
    model, flags, train, test = prepare(args.data, args.model, args.samples, args.eval_rows,
                                        os.path.join(ROOT, '.cache', 'bench'))
    if args.prepare:
        return 0
    done = set()
    if args.skip_done:
        done = {(r['arm'], r['seed'], r['adam_beta2']) for r in read([args.jsonl], args.reuse, args.data)}
    growth.run_grid(args, done, lambda arm, lr, seed: run_arm(arm, lr, seed, args.beta2, args, model, flags, train,
                                                            test))
    return 0


if __name__ == '__main__':
    sys.exit(main())

"""Print and plot the LR schedule an ``lr_schedule`` configuration gives, without training.

Reads the ``dynamic_callbacks.lr_schedule`` section of an ms-swift YAML (``--config``; the pack defaults when
omitted), and simulates plateaus at the steps given with ``--plateau`` (each becomes a restart, as the callback
would request it, up to ``max_restarts``). Writes a PNG with ``--png``.

    python scripts/plot_lr_schedule.py --steps 1000 --lr 1e-4 --plateau 400 --plateau 700 --png lr.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from swift_dynamic_callbacks.callbacks.lr_schedule import LRScheduleCallback  # noqa: E402
from swift_dynamic_callbacks.policies.lr import schedule_factor  # noqa: E402


def load_config(path: str | None) -> LRScheduleCallback:
    settings = {}
    if path:
        import yaml
        with open(path, encoding='utf-8') as f:
            document = yaml.safe_load(f) or {}
        settings = (document.get('dynamic_callbacks') or {}).get('lr_schedule') or {}
    return LRScheduleCallback(LRScheduleCallback.config_from_mapping(settings))


def simulate(cb: LRScheduleCallback, steps: int, plateaus: list[int]) -> dict:
    """The schedule mapping after the simulated plateaus (restarts as the callback makes them)."""
    c = cb.config
    for step in sorted(plateaus):
        if len(cb.restarts) >= c.max_restarts:
            print(f'plateau at step {step}: max_restarts ({c.max_restarts}) used, no restart')
            continue
        cb.peak *= c.restart_factor
        cb.restarts.append([step, cb.peak, c.rewarmup])
    return {**cb.schedule(), 'total': steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--config', help='an ms-swift YAML with a dynamic_callbacks.lr_schedule section')
    parser.add_argument('--steps', type=int, default=1000, help='optimizer steps of training (default 1000)')
    parser.add_argument('--lr', type=float, default=1e-4, help='the configured learning_rate (default 1e-4)')
    parser.add_argument('--plateau', type=int, action='append', default=[], help='simulate a plateau at this step')
    parser.add_argument('--every', type=int, default=0, help='print every N steps (default: about 20 lines)')
    parser.add_argument('--png', help='write a plot here')
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f'--steps: must be >= 1, got {args.steps}')
    cb = load_config(args.config)
    schedule = simulate(cb, args.steps, args.plateau)
    lrs = [args.lr * schedule_factor(schedule, k) for k in range(args.steps)]
    every = args.every or max(1, args.steps // 20)
    print(f'schedule: {schedule}')
    print('| step | LR | factor |\n|---:|---:|---:|')
    marks = {r[0] for r in schedule.get('restarts', ())}
    for k in range(args.steps):
        if k % every == 0 or k == args.steps - 1 or k in marks:
            print(f'| {k} | {lrs[k]:.4g} | {lrs[k] / args.lr:.4f} |' + (' restart' if k in marks else ''))
    if args.png:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot(range(args.steps), lrs, label='learning rate')
        for k in sorted(marks):
            ax.axvline(k, color='tab:red', linestyle='--', linewidth=0.8)
            ax.annotate('restart', (k, max(lrs) * 0.95), color='tab:red', fontsize=8, rotation=90, va='top')
        ax.set_xlabel('optimizer step')
        ax.set_ylabel('LR')
        shape = 'warmup / step decay' if schedule.get('decay') == 'steps' else 'warmup / hold / cosine'
        ax.set_title(f'lr_schedule: {shape}' + (' with restarts' if marks else ''))
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f'wrote {args.png}')
    return 0


if __name__ == '__main__':
    sys.exit(main())

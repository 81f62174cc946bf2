#!/usr/bin/env bash
# Issue 24's quality study: SmolLM2-135M-Instruct LoRA, 128 GSM8K train rows once, eval on 16 held-out test rows.
# 1. seed 0: every arm at several batch-1 LRs (fixed_small and growth at 5e-4, 1e-3, 2e-3, 4e-3; the other arms at
#    the LRs around the best of those);
# 2. seeds 1 and 2: every arm at the LR that was best for it on seed 0;
# 3. the table (mean ± std over the seeds of each arm at its LR) and the Pareto plot.
# Every run appends one JSON line to $JSONL and a stopped study continues where it stopped (--skip-done).
# 33 runs of 3-4 minutes: about 2.5 hours on 2 CPU cores. Needs the demo extra (scripts/main_job.sh installs it).
# Usage: bash scripts/quality_study.sh [JSONL] [PNG]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
JSONL=${1:-output/bench_quality/study128.jsonl}
PNG=${2:-output/bench_quality/pareto128.png}
mkdir -p "$(dirname "$JSONL")"
B=("$PY" scripts/bench_quality.py --samples 128 --eval-rows 16 --jsonl "$JSONL" --skip-done)
"${B[@]}" --seeds 0 --arms fixed_small fixed_large growth seesaw
"${B[@]}" --seeds 0 --skip-base --arms fixed_small growth --arm-lrs 1e-3 2e-3 4e-3
"${B[@]}" --seeds 0 --skip-base --arms fixed_large --arm-lrs 1e-3
"${B[@]}" --seeds 0 --skip-base --arms growth_token_budget growth_optimizer late_switch seesaw --arm-lrs 1e-3 2e-3
# each arm's best LR on seed 0 ("0.0005" for the base LR)
"$PY" - "$JSONL" > "$JSONL.best" <<'EOF'
import json, sys
best = {}
for line in open(sys.argv[1], encoding='utf-8'):
    row = json.loads(line)
    base, _, lr = row['arm'].partition('@')
    if row['seed'] == 0 and (base not in best or row['eval_loss'] < best[base][1]):
        best[base] = (lr or '0.0005', row['eval_loss'])
for base, (lr, _) in best.items():
    print(base, lr)
EOF
for seed in 1 2; do
  while read -r arm lr; do
    if [ "$lr" = 0.0005 ]; then
      "${B[@]}" --seeds "$seed" --arms "$arm" < /dev/null
    else
      "${B[@]}" --seeds "$seed" --skip-base --arms "$arm" --arm-lrs "$lr" < /dev/null
    fi
  done < "$JSONL.best"
done
"$PY" scripts/bench_quality.py --samples 128 --eval-rows 16 --from-jsonl "$JSONL" --png "$PNG"

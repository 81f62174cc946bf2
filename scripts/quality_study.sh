#!/usr/bin/env bash
# The quality study (issue 30): SmolLM2-135M-Instruct LoRA, 128 GSM8K train rows once, eval loss on all 100 vendored
# held-out GSM8K test rows, and greedy answers to the first 16 of them (the main job's two scores on the main job's
# rows; answers to all 100 take 11 minutes a run on 2 cores). Tuning and reporting seeds apart:
# 1. tuning, seed 0 only: fixed_small at 1e-3 / 2e-3 / 4e-3 (brackets its optimum: 5e-4 was far worse in the earlier
#    study), every pack arm at 1e-3 / 2e-3, fixed_large at 1e-3 (x2 applied);
# 2. each arm's LR: the lowest eval loss on the tuning seed;
# 3. reporting, seeds 1-5: every arm at its LR;
# 4. the tables over the reporting seeds only, paired against fixed_small with 95 % paired-t intervals.
# Every run appends one JSON line to $JSONL; a stopped study continues where it stopped (--skip-done). 77 runs of
# about 7.3 minutes (4.6 training, 1 eval, 1.5 answers): about 9.5 hours on 2 CPU cores, run in parts. Needs the
# demo extra (scripts/main_job.sh installs it). Never part of the test run (tests/test_bench_quality.py smokes the script).
# Usage: bash scripts/quality_study.sh [JSONL] [PNG]     STAGE=tune|report|table to run one stage only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
JSONL=${1:-docs/figures/quality_30.jsonl}  # committed: a study run in parts continues from it
PNG=${2:-docs/figures/quality_30.png}
STAGE=${STAGE:-all}
TUNE=(0)
REPORT=(1 2 3 4 5)
PACK_ARMS=(growth growth_token_budget growth_optimizer seesaw late_switch late_switch_plateau late_switch_half_budget
           growth_gentle growth_rewarm)
BEST=output/bench_quality/$(basename "$JSONL").best  # each arm's LR, made from the tuning runs
mkdir -p "$(dirname "$JSONL")" output/bench_quality
B=("$PY" scripts/bench_quality.py --samples 128 --eval-rows 100 --answers 16 --jsonl "$JSONL" --skip-done)
if [ "$STAGE" = all ] || [ "$STAGE" = tune ]; then
  "${B[@]}" --seeds "${TUNE[@]}" --skip-base --arms fixed_small --arm-lrs 1e-3 2e-3 4e-3
  "${B[@]}" --seeds "${TUNE[@]}" --skip-base --arms fixed_large --arm-lrs 1e-3
  "${B[@]}" --seeds "${TUNE[@]}" --skip-base --arms "${PACK_ARMS[@]}" --arm-lrs 1e-3 2e-3
fi
if [ "$STAGE" = all ] || [ "$STAGE" = report ]; then
  # each arm's LR on the tuning seeds ("arm lr" lines)
  "$PY" - "$JSONL" "${TUNE[@]}" > "$BEST" <<'EOF'
import json, statistics, sys
tune = {int(s) for s in sys.argv[2:]}
losses = {}
for line in open(sys.argv[1], encoding='utf-8'):
    row = json.loads(line)
    if row['seed'] in tune:
        losses.setdefault(row['arm'], []).append(row['eval_loss'])
best = {}
for arm, values in losses.items():
    base, _, lr = arm.partition('@')
    if base not in best or statistics.fmean(values) < best[base][1]:
        best[base] = (lr, statistics.fmean(values))
for base, (lr, _) in best.items():
    print(base, lr)
EOF
  for seed in "${REPORT[@]}"; do
    while read -r arm lr; do
      "${B[@]}" --seeds "$seed" --skip-base --arms "$arm" --arm-lrs "$lr" < /dev/null
    done < "$BEST"
  done
fi
"$PY" scripts/bench_quality.py --samples 128 --eval-rows 100 --from-jsonl "$JSONL" --report-seeds "${REPORT[@]}" \
  --tune-seeds "${TUNE[@]}" --png "$PNG"

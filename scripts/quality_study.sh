#!/usr/bin/env bash
# The quality study (issue 30): SmolLM2-135M-Instruct LoRA, 128 GSM8K train rows once, eval loss on all 100 vendored
# held-out GSM8K test rows, and greedy answers to the first 16 of them (the main job's two scores on the main job's
# rows; answers to all 100 take 11 minutes a run on 2 cores). Tuning and reporting seeds apart:
# 1. tuning, seed 0 only: fixed_small at 1e-3 / 2e-3 / 4e-3 (brackets its optimum: 5e-4 was far worse in the earlier
#    study), fixed_large at 1e-3 (x2 applied), every pack arm at 1e-3, and at 2e-3 the pack arms that saved >= 40 %
#    of the optimizer steps at 1e-3 (the others cannot meet the goal, whatever their loss);
# 2. each arm's LR: the lowest eval loss on the tuning seed;
# 3. the arms reported: fixed_small, and each pack arm that could meet the goal on the tuning seed: >= 40 % fewer
#    optimizer steps than fixed_small at an eval loss within $MARGIN (2 %) of fixed_small's best, the $KEEP (2) best
#    of them (REPORT_ALSO="arm ..." adds arms at their tuning LR; STAGE=select prints the choice);
# 4. reporting, seeds 1-5: those arms at their LR;
# 5. the tables over the reporting seeds only, paired against fixed_small with 95 % paired-t intervals (and the
#    tuning runs' own table).
# Runs go $LANES at a time, each on its own core with one thread (taskset): a run takes about 11.5 minutes on one
# thread and 7.3 on two, so two lanes make the study about 1.3 x faster. Every run appends one JSON line to $JSONL; a
# stopped study continues where it stopped (--skip-done). About 19 tuning + 15 reporting runs: about 3.3 hours on 2
# cores. Needs the demo extra (scripts/main_job.sh installs it). Never part of the test run (tests/test_bench_quality.py
# runs this script on the tiny model with two arms).
# Usage: bash scripts/quality_study.sh [JSONL] [PNG]     STAGE=tune|select|report|table: one stage only (select: print
# the reported arms and their LRs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
JSONL=${1:-docs/figures/quality_30.jsonl}  # committed: a study run in parts continues from it
PNG=${2-docs/figures/quality_30.png}  # "": no plot
STAGE=${STAGE:-all}
LANES=${LANES:-2}
MODEL=${MODEL:-smollm2}
SAMPLES=${SAMPLES:-128}
EVAL_ROWS=${EVAL_ROWS:-100}
ANSWERS=${ANSWERS:-16}
MAX_LENGTH=${MAX_LENGTH:-512}
OUT=${OUT:-output/bench_quality}  # each run's folder and this study's queue and logs
MARGIN=${MARGIN:-0.02}
KEEP=${KEEP:-2}
read -r -a TUNE <<< "${TUNE_SEEDS:-0}"
read -r -a REPORT <<< "${REPORT_SEEDS:-1 2 3 4 5}"
ALL_ARMS="growth growth_token_budget growth_optimizer seesaw late_switch late_switch_plateau late_switch_half_budget"
read -r -a PACK_ARMS <<< "${PACK_ARMS:-$ALL_ARMS growth_gentle growth_rewarm}"
read -r -a SMALL_LRS <<< "${SMALL_LRS:-1e-3 2e-3 4e-3}"
read -r -a PACK_LRS <<< "${PACK_LRS:-1e-3 2e-3}"
read -r -a LARGE_LRS <<< "${LARGE_LRS-1e-3}"
WORK=$OUT/$(basename "$JSONL")
mkdir -p "$(dirname "$JSONL")" "$WORK"
B=("$PY" scripts/bench_quality.py --model "$MODEL" --samples "$SAMPLES" --eval-rows "$EVAL_ROWS" --answers "$ANSWERS"
   --max-length "$MAX_LENGTH" --out "$OUT" --jsonl "$JSONL" --skip-done)
case $STAGE in
  all | tune | report) "${B[@]}" --prepare ;;  # the model folder and the data files, once, before the lanes share them
  select | table) ;;
  *) echo "STAGE: all, tune, select, report or table, got '$STAGE'" >&2; exit 2 ;;
esac

lane() {  # lane INDEX: runs the "arm lr seed" lines of $WORK/queue, first come first served, until none is left
  local job arm lr seed pin=()
  [ "$LANES" -gt 1 ] && pin=(env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 taskset -c "$1")
  while job=$(flock "$WORK/queue.lock" sh -c 'head -n 1 "$1"; sed -i 1d "$1"' _ "$WORK/queue") && [ -n "$job" ]; do
    read -r arm lr seed <<< "$job"
    local log=$WORK/$arm@$lr-$seed.log
    "${pin[@]}" "${B[@]}" --skip-base --seeds "$seed" --arms "$arm" --arm-lrs "$lr" < /dev/null > "$log" 2>&1 \
      || { echo "failed: $arm at $lr, seed $seed (log: $log)" >&2; return 1; }
    echo "done: $arm at $lr, seed $seed"
  done
}

run() {  # run: the "arm lr seed" lines on stdin, $LANES at a time
  local pids=() failed=0 i
  cat > "$WORK/queue"
  for ((i = 0; i < LANES; i++)); do lane "$i" & pids+=($!); done
  for i in "${pids[@]}"; do wait "$i" || failed=1; done
  return "$failed"
}

pick() {  # pick candidates|reported: the rule on the tuning runs in $JSONL (bench_quality.py study_choice)
  "$PY" scripts/bench_quality.py --from-jsonl "$JSONL" --tune-seeds "${TUNE[@]}" --pick "$1" --margin "$MARGIN" \
    --keep "$KEEP" --report-also ${REPORT_ALSO:-}
}

if [ "$STAGE" = all ] || [ "$STAGE" = tune ]; then
  for seed in "${TUNE[@]}"; do
    for lr in "${SMALL_LRS[@]}"; do echo "fixed_small $lr $seed"; done
    for lr in "${LARGE_LRS[@]}"; do echo "fixed_large $lr $seed"; done
    for arm in "${PACK_ARMS[@]}"; do echo "$arm ${PACK_LRS[0]} $seed"; done
  done | run
  # the further LRs only for the arms that could meet the goal: >= 40 % fewer optimizer steps at the first LR
  read -r -a CANDIDATES <<< "$(pick candidates | tr '\n' ' ')"
  for seed in "${TUNE[@]}"; do
    for lr in "${PACK_LRS[@]:1}"; do
      for arm in "${PACK_ARMS[@]}"; do
        if [[ " ${CANDIDATES[*]} " == *" $arm "* ]]; then echo "$arm $lr $seed"; fi
      done
    done
  done | run
fi
if [ "$STAGE" = all ] || [ "$STAGE" = select ] || [ "$STAGE" = report ]; then
  pick reported > "$WORK/reported"  # "arm lr" lines, fixed_small first
  echo "reported arms and their LRs (from seeds ${TUNE[*]}):"; cat "$WORK/reported"
  if [ "$STAGE" = select ]; then exit 0; fi
  for seed in "${REPORT[@]}"; do
    while read -r arm lr; do echo "$arm $lr $seed"; done < "$WORK/reported"
  done | run
fi
"$PY" scripts/bench_quality.py --model "$MODEL" --samples "$SAMPLES" --eval-rows "$EVAL_ROWS" --from-jsonl "$JSONL" \
  --report-seeds "${REPORT[@]}" --tune-seeds "${TUNE[@]}" ${PNG:+--png "$PNG"}

#!/usr/bin/env bash
# The growth study (issue 39): SmolLM2-135M-Instruct LoRA, 128 GSM8K train rows once, token-weighted eval loss on 500
# held-out GSM8K test rows (scripts/bench_growth_study.py: the arms, the probe, the tables). One run at a time, pinned
# to one core with one thread ($CORE, default 1: the study runs beside other work). Stages, in order:
# 1. beta2: the baseline (1 x GA 2, 64 steps) at $BASE_LR (the last study's tuned LR) with Adam beta2 0.999 and 0.95
#    on the tuning seeds; beta2 is 0.95 for every arm if 0.95 is within 0.3 % of 0.999 on their mean, else 0.999
#    (bench_growth_study.py pick_beta2);
# 2. tune, at that beta2, both tuning seeds per LR, the most decisive runs first: control A (2 x GA 2, 32 steps) at
#    its likely optimum (the baseline's LR x sqrt(2), the sqrt rule for twice the batch) and B (rows-indexed batch
#    warmup 2 -> 4 -> 8 rows a step, LR x sqrt(2) a doubling, 32 steps) at the baseline's LR, then their neighbours
#    on the x sqrt(2) ladder, the lower ones first (seed 0: A at 4e-3 was 2.5 % worse than at 2.83e-3; B at 2e-3,
#    3.7 % behind the baseline, runs at up to 2.7e-3 once it grows), then
#    the baseline's neighbours; then up to $EXTEND rounds of one more rung past any
#    arm whose best LR is the edge of what it ran (pick extend);
# 3. report: each arm at its best LR (mean over the tuning seeds) on the reporting seeds, seed by seed so the pairs
#    complete together; after $FUTILITY_AT reporting seeds the futility look (stated in advance: an arm whose mean
#    paired difference against the baseline is above +1.5 % is stopped);
#    right after that look, the frontier stage (STAGE=frontier alone): the fixed micro-batches 4 and 8 (fixed_4,
#    fixed_8: 16 and 8 steps, the other points of the fixed-batch frontier {1, 2, 4, 8} with the baseline and A) tuned
#    the same way on the tuning seeds ($F4_LRS, $F8_LRS, then one more rung past an edge) and run at their best LR on
#    the look's reporting seeds; then the remaining reporting seeds of the three arms;
# 4. the tables (bench_growth_study.py --from-jsonl), the reporting seeds apart from the tuning seeds.
# STAGE=c (not part of "all": the issue runs it after A and B when the futility look leaves room): arm C, Seesaw on a
# step schedule (seesaw_c) and its fixed-batch twin (twin_c), tuned the same way on the tuning seeds ($C_LRS, then one
# more rung past an edge), then at their best LRs on the look's reporting seeds; the same futility look (Seesaw's
# mean paired difference against the baseline above +1.5 %) stops both there, else they run the remaining seeds.
# Every run appends one JSON line to $JSONL (committed); a stopped study continues where it stopped (--skip-done):
# run the same command again. Two streams (one a core): run the command twice, CORE=1 and CORE=0: each run is
# claimed first ($CLAIMS, a folder: the other stream skips it), and a stream picks LRs or looks at the reporting
# seeds only once every claimed run has its line. About 11-12 minutes a run on one thread (figures in docs/results-log.md).
# Memory (one thread a run): about 6-8 GB a run, fixed_8 about 13 GB at its peak; two fixed_8 runs never run at once
# (bench_growth_study.py holds $OUT/memory.lock for them), so two streams need about 21 GB at most.
# Before every pick of LRs a stream first runs (or finds claimed) every rung the study started on some tuning seeds
# only (complete: the other stream may have finished one seed of it and not yet claimed the next).
# To stop both streams without losing a run: touch $OUT/stop ($STOP): each stream exits before its next run (remove the
# file to continue later).
# Never part of the test run (tests/test_bench_growth_study.py runs this script on the tiny model).
# Usage: bash scripts/growth_study.sh [JSONL]     STAGE=beta2|tune|report|table (that stage only; all: every stage)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
JSONL=${1:-docs/figures/growth_39.jsonl}
STAGE=${STAGE:-all}
MODEL=${MODEL:-smollm2}
SAMPLES=${SAMPLES:-128}
EVAL_ROWS=${EVAL_ROWS:-500}
MAX_LENGTH=${MAX_LENGTH:-512}
OUT=${OUT:-output/growth_study}
CLAIMS=${CLAIMS:-$OUT/claims}
STOP=${STOP:-$OUT/stop}
CORE=${CORE-1}  # '': not pinned
BASE_LR=${BASE_LR:-0.002}
read -r -a TUNE <<< "${TUNE_SEEDS:-0 1}"
read -r -a REPORT <<< "${REPORT_SEEDS:-2 3 4 5 6 7 8 9 10 11 12 13}"
FUTILITY_AT=${FUTILITY_AT:-6}
read -r -a A_LRS <<< "${A_LRS:-0.00283 0.002 0.004}"
read -r -a B_LRS <<< "${B_LRS:-0.002 0.00141 0.00283}"
read -r -a BASE_LRS <<< "${BASE_LRS-0.00283 0.00141}"  # the baseline's neighbours at the chosen beta2
EXTEND=${EXTEND:-2}
read -r -a F4_LRS <<< "${F4_LRS-0.00283 0.004}"  # fixed_4: the sqrt rule from the baseline's 2e-3 is 4e-3
read -r -a F8_LRS <<< "${F8_LRS-0.004 0.00566}"  # fixed_8: 5.66e-3 by the same rule
read -r -a C_LRS <<< "${C_LRS-0.00141 0.002 0.001}"  # eta: the tuned baseline's LR first (both schedules average eta/2)
MAIN='^(baseline|control_a|growth_b) '
ARM_C='^(twin_c|seesaw_c) '
FIXED='^(fixed_4|fixed_8) '
case $STAGE in
  all | beta2 | tune | report | frontier | c | table) ;;
  *) echo "STAGE: all, beta2, tune, report, frontier, c or table, got '$STAGE'" >&2; exit 2 ;;
esac
mkdir -p "$(dirname "$JSONL")" "$OUT"
S=("$PY" scripts/bench_growth_study.py --model "$MODEL" --samples "$SAMPLES" --eval-rows "$EVAL_ROWS"
   --max-length "$MAX_LENGTH" --out "$OUT" --tune-seeds "${TUNE[@]}" --claims "$CLAIMS")
PIN=()
if [ -n "$CORE" ]; then PIN=(env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 taskset -c "$CORE"); fi

one() {  # one ARM LR SEED BETA2: a run, unless its line is in $JSONL or another stream claimed it
  local log=$OUT/$1@$2-b$4-seed$3.${CORE:-all}.log
  if [ -e "$STOP" ]; then echo "$(date -u +%H:%M:%S) $STOP exists: stopped before $1 at $2, seed $3"; exit 0; fi
  "${PIN[@]}" "${S[@]}" --arms "$1" --lrs "$2" --seeds "$3" --beta2 "$4" --jsonl "$JSONL" --skip-done \
    < /dev/null > "$log" 2>&1 || { echo "failed: $1 at $2, beta2 $4, seed $3 (log: $log)" >&2; return 1; }
  if grep -q 'claimed by another stream' "$log"; then echo "$(date -u +%H:%M:%S) another stream runs $1 at $2, seed $3"
  else echo "$(date -u +%H:%M:%S) done: $1 at $2, beta2 $4, seed $3"; fi
}

pick() {  # pick beta2|best|extend|futility [BETA2]
  "${S[@]}" --from-jsonl "$JSONL" --pick "$1" --lrs "$BASE_LR" ${2:+--beta2 "$2"} \
    ${REPORT_DONE:+--report-seeds $REPORT_DONE}
}

if [ "$STAGE" != table ]; then "${PIN[@]}" "${S[@]}" --prepare; fi
if [ "$STAGE" = all ] || [ "$STAGE" = beta2 ]; then
  for seed in "${TUNE[@]}"; do
    one baseline "$BASE_LR" "$seed" 0.999
    one baseline "$BASE_LR" "$seed" 0.95
  done
fi
BETA2=${BETA2:-$(pick beta2)}
if [ "$STAGE" != table ] && [ "$STAGE" != beta2 ]; then
  [ -n "$BETA2" ] || { echo "no beta2 yet: run STAGE=beta2 first (or set BETA2)" >&2; exit 1; }
  echo "beta2 $BETA2 (baseline at $BASE_LR, 0.95 against 0.999 on seeds ${TUNE[*]})"
fi
complete() {  # complete PATTERN: the LRs of the arms matching PATTERN run on some tuning seeds only, on the others
  local more arm lr seed
  more=$(pick incomplete "$BETA2" | grep -E "$1" || true)
  while read -r arm lr; do
    if [ -n "$arm" ]; then for seed in "${TUNE[@]}"; do one "$arm" "$lr" "$seed" "$BETA2"; done; fi
  done <<< "$more"
}

extend() {  # extend PATTERN: up to $EXTEND rounds of one more rung past the edge of each arm matching PATTERN
  local i more arm lr seed
  for ((i = 0; i < EXTEND; i++)); do
    complete "$1"  # a rung the other stream started but has not claimed every seed of yet: before the pick
    more=$(pick extend "$BETA2" | grep -E "$1" || true)
    [ -n "$more" ] || break
    while read -r arm lr; do
      for seed in "${TUNE[@]}"; do one "$arm" "$lr" "$seed" "$BETA2"; done
    done <<< "$more"
  done
}

look() {  # look: the arms the futility look stops, after the first $FUTILITY_AT reporting seeds
  REPORT_DONE="${REPORT[*]:0:FUTILITY_AT}" pick futility "$BETA2"
}

report_best() {  # report_best WHAT PATTERN SEED...: the arms matching PATTERN at their best LRs on the seeds given
  local what=$1 pattern=$2 best arm lr seed
  shift 2
  complete "$pattern"
  best=$(pick best "$BETA2" | grep -E "$pattern" || true)
  echo "$what at their LRs (chosen on seeds ${TUNE[*]}):"; echo "$best"
  for seed in "$@"; do
    while read -r arm lr; do
      if [ -n "$arm" ]; then one "$arm" "$lr" "$seed" "$BETA2"; fi
    done <<< "$best"
  done
}

tune_pair() {  # tune_pair ARM LRS ARM LRS: two arms' LR lists (array names) rung by rung, on the tuning seeds
  local -n first_lrs=$2 second_lrs=$4
  local n=$(( ${#first_lrs[@]} > ${#second_lrs[@]} ? ${#first_lrs[@]} : ${#second_lrs[@]} )) i seed
  for ((i = 0; i < n; i++)); do
    for seed in "${TUNE[@]}"; do
      if [ -n "${first_lrs[i]:-}" ]; then one "$1" "${first_lrs[i]}" "$seed" "$BETA2"; fi
      if [ -n "${second_lrs[i]:-}" ]; then one "$3" "${second_lrs[i]}" "$seed" "$BETA2"; fi
    done
  done
}

if [ "$STAGE" = all ] || [ "$STAGE" = tune ]; then
  tune_pair control_a A_LRS growth_b B_LRS
  for lr in "${BASE_LRS[@]}"; do
    for seed in "${TUNE[@]}"; do one baseline "$lr" "$seed" "$BETA2"; done
  done
  extend .
fi
frontier() {  # the fixed micro-batches 4 and 8: tuned on the tuning seeds, then on the look's reporting seeds
  tune_pair fixed_4 F4_LRS fixed_8 F8_LRS
  extend "$FIXED"
  report_best 'frontier arms' "$FIXED" "${REPORT[@]:0:FUTILITY_AT}"
}

if [ "$STAGE" = frontier ]; then frontier; fi
if [ "$STAGE" = c ]; then  # arm C and its twin: tuned, then on the look's seeds, then the rest unless the look stops C
  tune_pair twin_c C_LRS seesaw_c C_LRS
  extend "$ARM_C"
  report_best 'arm C' "$ARM_C" "${REPORT[@]:0:FUTILITY_AT}"
  stopped=$(look | grep -x seesaw_c || true)
  said=${stopped:+seesaw_c and its twin}
  echo "futility look for arm C after seeds ${REPORT[*]:0:FUTILITY_AT}: stopped: ${said:-none}"
  if [ -z "$stopped" ]; then report_best 'arm C' "$ARM_C" "${REPORT[@]:FUTILITY_AT}"; fi
fi
if [ "$STAGE" = all ] || [ "$STAGE" = report ]; then
  complete "$MAIN"
  chosen=$(pick best "$BETA2" | grep -E "$MAIN")
  echo "reported arms at their LRs (beta2 $BETA2, chosen on seeds ${TUNE[*]}):"; echo "$chosen"
  stopped=""
  for ((k = 0; k < ${#REPORT[@]}; k++)); do
    if [ "$k" -eq "$FUTILITY_AT" ]; then
      stopped=$(look | tr '\n' ' ')
      echo "futility look after seeds ${REPORT[*]:0:FUTILITY_AT}: stopped: ${stopped:-none}"
      if [ "$STAGE" = all ] && [ -n "${F4_LRS[*]}${F8_LRS[*]}" ]; then frontier; fi
    fi
    while read -r arm lr; do
      if [[ " $stopped " != *" $arm "* ]]; then one "$arm" "$lr" "${REPORT[k]}" "$BETA2"; fi
    done <<< "$chosen"
  done
fi
"${S[@]}" --from-jsonl "$JSONL" --report-seeds "${REPORT[@]}" --futility-at "$FUTILITY_AT"

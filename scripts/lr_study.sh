#!/usr/bin/env bash
# The LR schedule study (issue 49; scripts/bench_lr_study.py: the arms, the plan, the tables). One run at a time, pinned
# to one core with one thread ($CORE, default 1: the study runs beside other work); every run appends one JSON line to
# $JSONL (committed); a stopped study continues where it stopped (run the same command again). touch $OUT/stop to stop
# it before its next run. The stages, in order (the plan in bench_lr_study.py's docstring):
# 0. the reproduction check (the baseline at 1.41e-3 on seed 2, against issue 39's line);
# 1. tuning on the tuning seeds: step_late, wsd, whc rung by rung, one more rung past an edge (up to 2 rounds), then
#    wsd_linear at wsd's best LR;
# 2. the reported arms (bench_lr_study.py --pick report) on the look's seeds, the futility look, the rest of the seeds
#    for the arms it leaves;
# 3. the tables.
# DATA=alpaca: the second data set (its own JSONL and OUT): $ALPACA_ARMS (the baseline among them) tuned there on the
# tuning seeds, one more rung past an edge ($EXTEND rounds), all of them at their best LR on the look's seeds, the
# futility look, the rest of the seeds, the tables.
# CLAIMS=DIR: two streams (one a core) on one JSONL: each claims a run before it runs it and skips the other's; a
# pick or the look waits for the other stream's runs that could change it, the tables for all of them. Start both
# at once: a stream started after the other's extension round picks its own round on more lines (start it with
# EXTEND=0 then).
# Usage: bash scripts/lr_study.sh [JSONL]
#        DATA=alpaca EXTEND=1 bash scripts/lr_study.sh docs/figures/lr_49_alpaca.jsonl
#        CLAIMS=output/claims CORE=0 bash scripts/lr_study.sh & CLAIMS=output/claims CORE=1 bash scripts/lr_study.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
JSONL=${1:-docs/figures/lr_49.jsonl}
REUSE=${REUSE:-docs/figures/growth_39.jsonl}
DATA=${DATA:-gsm8k}
if [ "$DATA" = gsm8k ]; then OUT=${OUT:-output/lr_study}; else OUT=${OUT:-output/lr_study_$DATA}; fi
STOP=${STOP:-$OUT/stop}
CORE=${CORE-1}
read -r -a TUNE <<< "${TUNE_SEEDS:-0 1}"
read -r -a REPORT <<< "${REPORT_SEEDS:-2 3 4 5 6 7 8 9}"
LOOK_AT=${LOOK_AT:-4}
read -r -a LRS <<< "${LRS:-0.00141 0.002 0.001}"
EXTEND=${EXTEND:-2}
mkdir -p "$(dirname "$JSONL")" "$OUT"
S=("$PY" scripts/bench_lr_study.py --data "$DATA" --out "$OUT" --tune-seeds "${TUNE[@]}" --report-seeds "${REPORT[@]}"
   --model "${MODEL:-smollm2}" --samples "${SAMPLES:-128}")
if [ -n "${EVAL_ROWS:-}" ]; then S+=(--eval-rows "$EVAL_ROWS"); fi  # default: 500 GSM8K rows, 300 Alpaca rows
CLAIMS=${CLAIMS:-}
if [ -n "$CLAIMS" ]; then S+=(--claims "$CLAIMS"); fi
PIN=()
if [ -n "$CORE" ]; then PIN=(env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 taskset -c "$CORE"); fi

one() {  # one ARM LR SEED [fresh]: a run, unless its line is in $JSONL (or, without "fresh", among the reused lines)
  local log=$OUT/$1@$2-seed$3${CLAIMS:+.$$}.log reuse=("$REUSE")  # with claims, each stream's own log
  if [ -e "$STOP" ]; then echo "$(date -u +%H:%M:%S) $STOP exists: stopped before $1 at $2, seed $3"; exit 0; fi
  if [ "${4:-}" = fresh ]; then reuse=(); fi
  "${PIN[@]}" "${S[@]}" --arms "$1" --lrs "$2" --seeds "$3" --jsonl "$JSONL" --reuse "${reuse[@]}" \
    --skip-done < /dev/null > "$log" 2>&1 \
    || { echo "failed: $1 at $2, seed $3 (log: $log)" >&2; return 1; }
  if grep -q 'claimed by another stream' "$log"; then echo "$(date -u +%H:%M:%S) the other stream runs $1 at $2, seed $3"
  else echo "$(date -u +%H:%M:%S) done: $1 at $2, seed $3"; fi
}
pick() { "${S[@]}" --from-jsonl "$JSONL" --reuse "$REUSE" --look-at "$LOOK_AT" --pick "$1"; }

tune() {  # ARM...: each at every LR of $LRS on the tuning seeds
  for lr in "${LRS[@]}"; do for arm in "$@"; do for seed in "${TUNE[@]}"; do one "$arm" "$lr" "$seed"; done; done; done
}
extend() {  # REGEX: the arms it matches, one more rung past an edge of their tuning, up to $EXTEND rounds
  local more
  for ((i = 0; i < EXTEND; i++)); do
    more=$(pick extend | grep -E "$1" || true)
    [ -n "$more" ] || break
    while read -r arm lr; do for seed in "${TUNE[@]}"; do one "$arm" "$lr" "$seed"; done; done <<< "$more"
  done
}
report() {  # "ARM LR" lines: on the look's seeds, the futility look, the rest of the seeds for the arms it leaves
  local stopped
  echo "reported arms at their LRs (chosen on seeds ${TUNE[*]}):"; echo "$1"
  for seed in "${REPORT[@]:0:LOOK_AT}"; do
    while read -r arm lr; do one "$arm" "$lr" "$seed"; done <<< "$1"
  done
  stopped=$(pick look | xargs)
  echo "futility look after seeds ${REPORT[*]:0:LOOK_AT}: stopped: ${stopped:-none}"
  for seed in "${REPORT[@]:LOOK_AT}"; do  # a baseline among the lines runs on: it is every arm's control
    while read -r arm lr; do
      if [[ " $stopped " != *" $arm "* ]]; then one "$arm" "$lr" "$seed"; fi
    done <<< "$1"
  done
}

"${PIN[@]}" "${S[@]}" --prepare
if [ "$DATA" != gsm8k ]; then  # the second data set: every arm tuned there, then reported at its best LR
  read -r -a ARMS <<< "${ALPACA_ARMS:-baseline step_late restarts}"
  tune "${ARMS[@]}"
  extend .
  report "$(pick best | grep '^baseline '; pick report)"
  "${S[@]}" --from-jsonl "$JSONL" --look-at "$LOOK_AT"
  exit 0
fi
one baseline 0.00141 2 fresh  # the reproduction check: run even though issue 39 has its line
tune step_late wsd whc
extend '^(step_late|wsd|whc) '
wsd_lr=$(pick best | awk '$1 == "wsd" {print $2}')
for seed in "${TUNE[@]}"; do one wsd_linear "$wsd_lr" "$seed"; done
report "$(pick report)"  # issue 39's baseline lines are reused on every seed
"${S[@]}" --from-jsonl "$JSONL" --reuse "$REUSE" --look-at "$LOOK_AT"

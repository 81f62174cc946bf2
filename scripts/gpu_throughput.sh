#!/usr/bin/env bash
# The throughput benchmark on one GPU (scripts/bench_throughput.py --device cuda): a random-weight model of a real
# shape (default the Qwen2.5-1.5B shape, bf16, sdpa, LoRA), 512 rows of the data mix, per-device batch 4 x GA 4
# (global batch 16), max_length 2048; plain ms-swift's random order, group_by_length and BatchRebalanceSampler, the
# pack's balanced steps in micro-batches and in passes cut by pass_tokens, then the bare PEFT loop as the physical
# reference; then a profiled window of random, group_by_length and pack_passes (wall vs GPU busy, the host-device
# synchronisations and who makes them). Every arm's figures are printed and appended to $OUT/throughput.jsonl as soon
# as it ends. Not run in CI (no GPU there). Record the output in docs/benchmarks.md ("Throughput").
#
# On a machine without network (../shared/gpu/README.md): bring the wheels and the data mix into the working tree
#   bash ../shared/gpu/fetch_wheels.sh .gpu/whl && mkdir -p .gpu/data && cp -r ../shared/data/{gsm8k,alpaca-gpt4-en-demo,lima,glaive-toolcall-en-demo} .gpu/data/
# and run  WHEELS=.gpu/whl DATA=.gpu/data bash scripts/gpu_throughput.sh  (the wheels go to /tmp/site, PYTHONPATH).
# Usage: bash scripts/gpu_throughput.sh [extra bench_throughput.py args, e.g. --model random:qwen2.5-7b --repeats 1]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [ -z "${WHEELS:-}" ]; then PY=.venv/bin/python; fi
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
. scripts/gpu_common.sh
require_gpus 1 scripts/gpu_throughput.sh
OUT=${OUT:-output/gpu_throughput}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
"$PY" scripts/bench_throughput.py --device cuda --procs 1 --model random:qwen2.5-1.5b --rows 512 --batch 4 --ga 4 \
  --max-length 2048 --repeats 2 --threads 4 --pass-tokens 16384 \
  --arms random group_by_length batch_rebalance pack_balanced pack_passes bare_loop \
  --profile-arms random group_by_length pack_passes \
  ${DATA:+--data "$DATA"} --work /tmp/bench_throughput --jsonl "$OUT/throughput.jsonl" "$@" 2>&1 | tee "$OUT/log.txt"

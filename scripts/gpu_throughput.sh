#!/usr/bin/env bash
# The throughput benchmark on one GPU (scripts/bench_throughput.py --device cuda): a random-weight model of a real
# shape (default the Qwen2.5-1.5B shape, bf16, sdpa, LoRA), 512 rows of the data mix, per-device batch 4 x GA 4
# (global batch 16), max_length 2048. Phase "proof" (under a minute): scripts/packed_proof.py, the padded
# micro-batch against its packed forms on every attention that loads (loss and LoRA gradient; flex_attention's
# backward only runs on CUDA). Phase "main" (about 6 minutes): plain ms-swift's random order and group_by_length,
# the pack's balanced steps in micro-batches, in passes cut by pass_tokens, and padding-free passes
# (integration.packed_attention: auto runs them with flash-attn where installed, else flex_attention: the table names
# which, with its first step's time, the compiles), 2 repeats alternated, then the bare PEFT loop as the physical
# reference (no arm starts after 6 minutes); PROFILE=1 adds a profiled window of random, group_by_length and
# pack_passes (wall vs GPU busy, the host-device synchronisations and who makes them; about a minute). Phase
# "liger" (about 2 minutes, needs liger-kernel): pack_passes with ms-swift's use_liger_kernel (fused linear
# cross-entropy: no fp32 logits) at pass_tokens P and 2 P, for the peak memory and whether twice the pass fits.
# P (PASS_TOKENS): 16384 on a card with 100 GB or more (H200), else 8192 (16384 peaked at 85 GB on the H200).
# Every arm's figures are printed and appended to $OUT/throughput.jsonl (phase liger: $OUT/liger-<tokens>.jsonl) as
# soon as it ends. PHASES="proof main liger" (default) picks them; within one 10-minute call run PHASES="proof main",
# then PHASES=liger. Not run in CI (no GPU there). Record the output in docs/benchmarks.md ("Throughput").
#
# On a machine without network (../shared/gpu/README.md): bring the wheels and the data mix into the working tree
#   bash ../shared/gpu/fetch_wheels.sh .gpu/whl && mkdir -p .gpu/data && cp -r ../shared/data/{gsm8k,alpaca-gpt4-en-demo,lima,glaive-toolcall-en-demo} .gpu/data/
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/whl liger-kernel==0.8.5
# and run  WHEELS=.gpu/whl DATA=.gpu/data bash scripts/gpu_throughput.sh  (the wheels go to /tmp/site, PYTHONPATH).
# Usage: bash scripts/gpu_throughput.sh [extra bench_throughput.py args for phase main, e.g. --model random:qwen2.5-7b]
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
PHASES=${PHASES:-proof main liger}
# a pass of 16,384 tokens peaked at 85 GB on the 1.5B shape (H200, stop 33): 8,192 on a card with less than 100 GB
gib=$("$PY" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)')
PASS_TOKENS=${PASS_TOKENS:-$([ "$gib" -ge 100 ] && echo 16384 || echo 8192)}
echo "GPU memory ${gib} GiB: pass_tokens $PASS_TOKENS (liger phase: $PASS_TOKENS and $((2 * PASS_TOKENS)))"
common=(--device cuda --procs 1 --model random:qwen2.5-1.5b --rows 512 --batch 4 --ga 4 --max-length 2048
        --threads 4 ${DATA:+--data "$DATA"} --work /tmp/bench_throughput)
if [[ " $PHASES " == *" proof "* ]]; then  # padded vs packed: loss and LoRA gradient on every attention that loads
  "$PY" scripts/packed_proof.py --model random:qwen2.5-1.5b --device cuda --work /tmp/bench_throughput \
    --jsonl "$OUT/proof.jsonl" 2>&1 | tee "$OUT/proof.txt" || true
fi
if [[ " $PHASES " == *" main "* ]]; then
  profile=()
  if [ -n "${PROFILE:-}" ]; then profile=(--profile-arms random group_by_length pack_passes); fi
  "$PY" scripts/bench_throughput.py "${common[@]}" --repeats 2 --pass-tokens "$PASS_TOKENS" --deadline 360 \
    --arms random group_by_length pack_balanced pack_passes pack_passes_padding_free bare_loop "${profile[@]}" \
    --jsonl "$OUT/throughput.jsonl" "$@" 2>&1 | tee "$OUT/log.txt"
fi
if [[ " $PHASES " == *" liger "* ]]; then
  if "$PY" -c 'import liger_kernel' 2>/dev/null; then
    for tokens in "$PASS_TOKENS" $((2 * PASS_TOKENS)); do
      "$PY" scripts/bench_throughput.py "${common[@]}" --repeats 1 --pass-tokens "$tokens" --arms pack_passes \
        --swift use_liger_kernel=true --jsonl "$OUT/liger-$tokens.jsonl" 2>&1 | tee -a "$OUT/log.txt" || true
    done
  else
    echo "phase liger skipped: liger-kernel is not installed (see the header)" | tee -a "$OUT/log.txt"
  fi
fi

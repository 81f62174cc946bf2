#!/usr/bin/env bash
# The throughput benchmark on one GPU (scripts/bench_throughput.py --device cuda): a random-weight model of a real
# shape (default the Qwen2.5-1.5B shape, bf16, sdpa, LoRA), 512 rows of the data mix, global batch 16 (per-device
# 4 x GA 4 unless an arm says otherwise), max_length 2048, one repeat. Every arm's figures are printed and appended to
# $OUT/*.jsonl as soon as it ends; an arm that fails prints its cause ("[arm-skipped] ...: failed ...": the exception)
# and the next one runs; the child processes' stderr is in $OUT/child.log.
# Phases (PHASES, default "proof main": about 8 minutes, one device call with timeout 600):
# - proof (under a minute): scripts/packed_proof.py, the padded micro-batch against its packed forms on every
#   attention that loads (loss and LoRA gradient; flex_attention's backward only runs on CUDA).
# - main (about 7 minutes: no arm starts after 4, then the OOM phase): an unmeasured warm-up, then plain ms-swift's
#   random order (4 x 4), group_by_length at the largest per-device batch that fits the global batch (16 x 1, else 8 x
#   2, else 4 x 4: the first that runs), the pack's pass_tokens at P, pass_tokens: auto (its choice in the notes under
#   the table), padding-free passes (packed_attention: auto: flash-attn where installed, else flex_attention; its first
#   step's time and what torch compiled in the notes), the bare PEFT loop; then the OOM phase: pass_tokens 2 P with 75 %
#   of the GPU (it runs out of memory and recovers in tokens) against a run planned from the start at the budget it
#   recovered to, with the same memory (the "[oom]" lines: tokens/s after the recovery, goal >= 0.9 x).
# - growth (about 2 minutes; issue 39): scripts/growth_clock.py, the growth study's arms (SmolLM2-135M shape, random
#   weights, bf16) timed under ms-swift on seeds $GROWTH_SEEDS (default 2 3) and the cost of one pass by rows x padded
#   length: $OUT/growth_clock.jsonl (commit it as docs/figures/growth_39_clock.jsonl). Needs the shape folder
#   $GROWTH_SHAPE (default .gpu/smollm2-135m-shape: the study's model folder without its weights, see below).
# MAIN_ARMS replaces phase main's arms, DEADLINE its --deadline (240).
# - oom (about 8 minutes, a call of its own): phase main's OOM comparison alone, as 3 alternating pairs (the run
#   that meets the OOM, then a run planned at the budget it recovered to), compared over the second halves step by
#   step with the allocator's retries and inactive split bytes; twice: as main runs it, then with
#   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the H200 run recovered to 0.80 x the planned run in one pair:
#   a fragmented caching allocator near the limit would show in the retries and between the two settings).
# - 7b (about 6 minutes, a second call): the Qwen2.5-7B shape, pass_tokens P / 2 and auto against group_by_length at
#   the largest per-device batch that fits (16 x 1 down to 2 x 8).
# - liger (about 2 minutes, needs liger-kernel): pass_tokens P and 2 P with ms-swift's use_liger_kernel (fused linear
#   cross-entropy: no fp32 logits), for the peak memory and whether twice the pass fits.
# - sharded (issue 47, about 8 minutes, one call of its own; needs the DeepSpeed wheels, see below): 256 rows on the
#   1.5B shape, one process, every arm's figures printed as it ends, in this order: without an engine
#   group_by_length at the largest per-device batch that fits, pass_tokens: auto with and without padding-free; under
#   FSDP2 (torchrun with one process: the engine's code paths on CUDA) group_by_length at the largest that fits and
#   pass_tokens P; under ZeRO-3 pass_tokens: auto alone (does it fit now, with its activation factor measured on
#   2026-11-28; group_by_length under ZeRO-3 ran then). The largest that fits: 16 x 1, 8 x 2, 4 x 4 tried in turn (on
#   a card under 100 GiB from 8 x 2: 16 x 2,048 padded tokens need over 80 GiB). No arm starts after
#   SHARDED_DEADLINE (330 s). PROFILE=1 then adds a profiled window (steps 2-3, about 2 minutes) of pass_tokens P and
#   group_by_length 4 x 4 under ZeRO-3 (on 2026-11-28 a ZeRO-3 step cost about 4.4 s with 1.4 passes as with 4, where
#   a step without an engine takes 0.4-1.3 s), with DeepSpeed's forward / backward / step timers of every step and
#   every invalidation of its parameter-fetch trace in $OUT/child.log (the bench's +zero3_timed engine). Ratios
#   compare arms under the same engine;
#   "[bench] ... asked for" flags an arm whose trainer ran another engine. Lines in $OUT/log-sharded.txt.
#   Measured on an H100 on 2026-11-28 (ZeRO-3 only; the rest past the deadline): docs/throughput.md.
# - activation (about 3 minutes; needs the DeepSpeed wheels): scripts/bench_activation_bytes.py on CUDA, the 1.5B
#   shape (28 layers, its vocabulary, bf16, LoRA): the bytes a pass holds a token without an engine, under FSDP2 and
#   under ZeRO-3 (one process each), by storages and by the CUDA allocator: the check of pass_tokens: auto's ZeRO-3
#   factor of 1.5 (on CPU ZeRO-3 and FSDP2 hold the same bytes a token as no engine: docs/engines.md). A call of its
#   own (timeout_s 300), before the sharded one.
# - vision (about 4 minutes; issue 65): scripts/bench_vision_bytes.py on CUDA, Qwen2.5-VL's and Qwen3.5's vision
#   towers at their widths with 32 blocks, 28 decoder layers at the 1.5B widths, the Qwen vocabulary, bf16, passes of
#   4,096 tokens with 0-512 media tokens, the tower frozen and trained: the cost model's prediction against the
#   storages and against max_memory_allocated (on CPU within 1.3 %: docs/multimodal.md). A call of its own
#   (timeout_s 480).
# P (PASS_TOKENS): 16384 on a card with 100 GB or more (H200), else 8192 (16384 peaked at 85 GB on the H200).
# PROFILE=1 adds a profiled window of random, group_by_length and pack_passes to phase main (about a minute).
# Not run in CI (no GPU there). Record the output in docs/throughput.md ("On a GPU").
#
# On a machine without network (../shared/gpu/README.md): bring the wheels and the data mix into the working tree
#   bash ../shared/gpu/fetch_wheels.sh .gpu/whl && mkdir -p .gpu/data && cp -r ../shared/data/{gsm8k,alpaca-gpt4-en-demo,lima,glaive-toolcall-en-demo} .gpu/data/
#   mkdir -p .gpu/smollm2-135m-shape && cp .cache/bench/smollm2-135m-instruct/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/smollm2-135m-shape/   # after one study run (or bench_growth_study.py --prepare)
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/whl liger-kernel==0.8.5
#   DEEPSPEED=1 PYTHON=.venv/bin/python bash ../shared/gpu/fetch_wheels.sh .gpu/whl      # phase sharded
# and run, each as one device call (carry [".gpu"], timeout_s 600; the wheels go to /tmp/site, PYTHONPATH):
#   WHEELS=.gpu/whl DATA=.gpu/data OUT=$OUT bash scripts/gpu_throughput.sh                 # proof, main, OOM
#   WHEELS=.gpu/whl DATA=.gpu/data OUT=$OUT PHASES=7b bash scripts/gpu_throughput.sh       # the 7B shape
#   WHEELS=.gpu/whl DATA=.gpu/data OUT=$OUT PHASES=liger bash scripts/gpu_throughput.sh
#   WHEELS=.gpu/whl DATA=.gpu/data OUT=$OUT PHASES=activation bash scripts/gpu_throughput.sh  # timeout_s 300
#   WHEELS=.gpu/whl DATA=.gpu/data OUT=$OUT PHASES=sharded bash scripts/gpu_throughput.sh     # timeout_s 560
#   WHEELS=.gpu/whl DATA=.gpu/data OUT=$OUT PHASES=vision bash scripts/gpu_throughput.sh      # timeout_s 480
# Usage: bash scripts/gpu_throughput.sh [extra bench_throughput.py args for phase main]
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
PHASES=${PHASES:-proof main}
WORK=/tmp/bench_throughput
# a pass of 16,384 tokens peaked at 85 GB on the 1.5B shape (H200, stop 33): 8,192 on a card with less than 100 GB
gib=$("$PY" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)')
PASS_TOKENS=${PASS_TOKENS:-$([ "$gib" -ge 100 ] && echo 16384 || echo 8192)}
echo "GPU memory ${gib} GiB: pass_tokens $PASS_TOKENS (OOM and liger phases: $((2 * PASS_TOKENS)))"
GBL='group_by_length@16x1|group_by_length@8x2|group_by_length@4x4'  # the largest per-device batch that runs
common=(--device cuda --procs 1 --rows 512 --batch 4 --ga 4 --max-length 2048 --threads 4 --repeats 1 --warmup
        ${DATA:+--data "$DATA"} --work "$WORK")
finish() { cp "$WORK/child.log" "$OUT/child.log" 2>/dev/null || true; }
trap finish EXIT
if [[ " $PHASES " == *" proof "* ]]; then  # padded vs packed: loss and LoRA gradient on every attention that loads
  timeout 120 "$PY" scripts/packed_proof.py --model random:qwen2.5-1.5b --device cuda --work "$WORK" \
    --jsonl "$OUT/proof.jsonl" 2>&1 | tee "$OUT/proof.txt" || echo "proof: failed or timed out (rc $?)"
fi
if [[ " $PHASES " == *" growth "* ]]; then  # the growth study's clock (issue 39); every arm's cause of failure printed
  read -r -a seeds <<< "${GROWTH_SEEDS:-2 3}"
  timeout "${GROWTH_TIMEOUT:-240}" "$PY" scripts/growth_clock.py --device cuda \
    --shape "${GROWTH_SHAPE:-.gpu/smollm2-135m-shape}" --seeds "${seeds[@]}" --deadline "${GROWTH_DEADLINE:-150}" \
    --work /tmp/growth_clock --jsonl "$OUT/growth_clock.jsonl" > "$OUT/growth_clock.log" 2>&1 \
    || echo "growth: failed or timed out (rc $?)"
  grep -E '^\||^\[arm-skipped\]|^optimizer|^cost|^each|Error:' "$OUT/growth_clock.log" | tail -60 || true
fi
if [[ " $PHASES " == *" main "* ]]; then
  profile=()
  if [ -n "${PROFILE:-}" ]; then profile=(--profile-arms random group_by_length pack_passes); fi
  TORCH_LOGS=recompiles "$PY" scripts/bench_throughput.py "${common[@]}" --model random:qwen2.5-1.5b \
    --pass-tokens "$PASS_TOKENS" --deadline "${DEADLINE:-240}" \
    --arms ${MAIN_ARMS:-random "$GBL" pack_passes pack_passes_auto pack_passes_padding_free bare_loop} \
    --oom-fraction 0.75 --oom-repeats 1 --oom-pass-tokens $((2 * PASS_TOKENS)) "${profile[@]}" \
    --jsonl "$OUT/throughput.jsonl" "$@" 2>&1 | tee "$OUT/log.txt"
fi
if [[ " $PHASES " == *" oom "* ]]; then
  for conf in '' 'expandable_segments:True'; do
    echo "[oom phase] PYTORCH_CUDA_ALLOC_CONF=${conf:-(unset)}" | tee -a "$OUT/log-oom.txt"
    envs=(env -u PYTORCH_CUDA_ALLOC_CONF)
    if [ -n "$conf" ]; then envs=(env PYTORCH_CUDA_ALLOC_CONF="$conf"); fi
    "${envs[@]}" "$PY" scripts/bench_throughput.py "${common[@]}" --model random:qwen2.5-1.5b \
      --pass-tokens "$PASS_TOKENS" --arms pack_passes --oom-only --oom-fraction 0.75 \
      --oom-pass-tokens $((2 * PASS_TOKENS)) \
      --jsonl "$OUT/throughput-oom.jsonl" 2>&1 | grep -E '^\[oom|^\[bench\]|^\[arm' | tee -a "$OUT/log-oom.txt" || true
  done
fi
if [[ " $PHASES " == *" activation "* ]]; then  # what a pass holds a token under each engine (issue 47, auto's factor)
  timeout 270 "$PY" scripts/bench_activation_bytes.py --device cuda --layers 28 --vocab 151936 --tokens 2048 4096 \
    2>&1 | tee "$OUT/log-activation.txt" || echo "activation: failed or timed out (rc $?)"
fi
if [[ " $PHASES " == *" vision "* ]]; then  # a VL pass's bytes against the cost model's vision tower (issue 65)
  timeout 420 "$PY" scripts/bench_vision_bytes.py --device cuda --dtype bfloat16 --layers 28 --depth 32 \
    --vocab 151936 --tokens 4096 2>&1 | tee "$OUT/log-vision.txt" || echo "vision: failed or timed out (rc $?)"
fi
if [[ " $PHASES " == *" sharded "* ]]; then
  if [ "$gib" -ge 100 ]; then chain=(16x1 8x2 4x4); else chain=(8x2 4x4); fi  # 16 x 2,048 tokens: over 80 GiB
  gbl() { local IFS='|' out=(); for layout in "${chain[@]}"; do out+=("group_by_length@$layout${engine:++$engine}"); done
          echo "${out[*]}"; }
  engine=; plain=("$(gbl)" pack_passes_auto pack_passes_auto_padding_free)
  engine=fsdp2; fsdp2=("$(gbl)" pack_passes+fsdp2)
  zero3=(pack_passes_auto+zero3)
  profile=()
  if [ -n "${PROFILE:-}" ]; then
    profile=(--profile-rows 48 --profile-arms pack_passes+zero3_timed 'group_by_length@4x4+zero3_timed')
  fi
  timeout 500 "$PY" scripts/bench_throughput.py --device cuda --procs 1 --rows 256 --batch 4 --ga 4 --max-length 2048 \
    --threads 4 --repeats 1 ${DATA:+--data "$DATA"} --work "$WORK" --model random:qwen2.5-1.5b \
    --pass-tokens "$PASS_TOKENS" --deadline "${SHARDED_DEADLINE:-330}" --arms "${plain[@]}" "${fsdp2[@]}" "${zero3[@]}" \
    "${profile[@]}" --jsonl "$OUT/throughput-sharded.jsonl" 2>&1 | tee "$OUT/log-sharded.txt" \
    || echo "sharded: failed or timed out (rc $?)"
fi
if [[ " $PHASES " == *" 7b "* ]]; then
  # a pass of 8,192 tokens peaked at 97.6 GiB on the 7B shape (H200): 4,096 on a card with less than 100 GiB
  "$PY" scripts/bench_throughput.py "${common[@]}" --model random:qwen2.5-7b --pass-tokens $((PASS_TOKENS / 2)) \
    --deadline 300 \
    --arms "$GBL|group_by_length@2x8" pack_passes pack_passes_auto --jsonl "$OUT/throughput-7b.jsonl" 2>&1 | tee "$OUT/log-7b.txt"
fi
if [[ " $PHASES " == *" liger "* ]]; then
  if "$PY" -c 'import liger_kernel' 2>/dev/null; then
    for tokens in "$PASS_TOKENS" $((2 * PASS_TOKENS)); do
      "$PY" scripts/bench_throughput.py "${common[@]}" --model random:qwen2.5-1.5b --pass-tokens "$tokens" \
        --arms pack_passes --swift use_liger_kernel=true --jsonl "$OUT/liger-$tokens.jsonl" 2>&1 \
        | tee -a "$OUT/log.txt" || true
    done
  else
    echo "phase liger skipped: liger-kernel is not installed (see the header)" | tee -a "$OUT/log.txt"
  fi
fi

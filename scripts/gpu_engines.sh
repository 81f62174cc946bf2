#!/usr/bin/env bash
# The engine checks on GPUs with NCCL (needs 2 or more CUDA devices): the same tests as `pytest -m engines` (DDP,
# FSDP2 without the CPU lift, DeepSpeed ZeRO-2/3; both ranks' weights equal, and equal to one process over the same
# samples per step), then the DDP cost of the pack for LoRA and a full fine-tune (scripts/bench_engines.py).
# Not run in CI (no GPU there). Record its output in the README ("Distributed and engines").
# Usage: bash scripts/gpu_engines.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
. scripts/gpu_common.sh
require_gpus 2 scripts/gpu_engines.sh
export SDC_ENGINE_DEVICE=cuda
"$PY" -m pytest -q -m engines -p no:cacheprovider "$@"
"$PY" scripts/bench_engines.py --device cuda --steps 30 --repeats 3

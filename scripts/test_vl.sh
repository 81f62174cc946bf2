#!/usr/bin/env bash
# The vision-language tests (tiny Qwen2-VL / Qwen2.5-VL `swift sft` runs, pytest marker `vl`) in their own venv
# (.venv-vl). ms-swift's Qwen-VL templates import qwen-vl-utils, which imports torchvision; PyPI's torchvision for
# x86_64 is a CUDA build that does not load next to the CPU torch the main environment pins (torch 2.13.0+cpu:
# "operator torchvision::nms does not exist"), so this environment takes torch 2.14.1 with its torchvision 0.29.1
# (both CUDA builds from PyPI, which run on a CPU; about 5 GB), and DeepSpeed for the ZeRO-2 run. docs/development.md says why and how on other machines.
# Usage (from anywhere): bash scripts/test_vl.sh [extra pytest args] (`-m vl` runs the slow ones too: ZeRO-2)
# VL_VENV=path chooses another environment; VL_SETUP_ONLY=1 builds it and runs no test (.ci/run builds it while the
# main tests run).
set -euo pipefail
cd "$(dirname "$0")/.."
VL_VENV=${VL_VENV:-.venv-vl}
PINS=(
  'torch==2.14.1'
  'torchvision==0.29.1'
  'ms-swift==4.6.0'
  'qwen-vl-utils==0.0.14'
  'deepspeed==0.19.8'
  pytest pytest-xdist hypothesis pyyaml
)

pins_ok() {
  "$VL_VENV/bin/python" - <<'PY' >/dev/null 2>&1
from importlib.metadata import version
want = {'torch': '2.14.1', 'torchvision': '0.29.1', 'ms-swift': '4.6.0', 'qwen-vl-utils': '0.0.14',
        'deepspeed': '0.19.8'}
bad = {k: version(k) for k in want if version(k).split('+')[0] != want[k]}
import pytest, xdist, hypothesis, yaml, torchvision.ops  # noqa: F401
raise SystemExit(1 if bad else 0)
PY
}

start=$(date +%s)
if [ ! -x "$VL_VENV/bin/python" ]; then
  python3 -m venv "$VL_VENV"
fi
if ! pins_ok; then
  "$VL_VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  compile=()  # PIP_SKIP_COMPILE=1: as in scripts/setup_env.sh
  if [ "${PIP_SKIP_COMPILE:-0}" = 1 ]; then compile=(--no-compile); fi
  "$VL_VENV/bin/python" -m pip install -q "${compile[@]}" "${PINS[@]}"
fi
if [ "${VL_SETUP_ONLY:-0}" = 1 ]; then  # the pins only: the pack's own editable install writes into this checkout
  "$VL_VENV/bin/python" -c 'import torchvision.ops, qwen_vl_utils'
  echo "[test_vl] pins installed in $(( $(date +%s) - start ))s"
  exit 0
fi
"$VL_VENV/bin/python" -m pip install -q --no-deps -e .
"$VL_VENV/bin/python" -c 'import torch, torchvision.ops, qwen_vl_utils, transformers, swift; print("torch", torch.__version__, "torchvision", torchvision.__version__, "transformers", transformers.__version__, "ms-swift", swift.__version__)'
echo "[test_vl] environment ready in $(( $(date +%s) - start ))s"

source scripts/pytest_env.sh load  # a test a worker
"$VL_VENV/bin/python" -m pytest tests -m 'vl and not slow' -q -p no:cacheprovider --durations=10 "${PYTEST_WORKERS[@]}" "$@"

#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the pack with its dependencies.
# torch is pinned in the same pip command as ms-swift so pip takes the CPU wheel instead of a CUDA build.
# Usage: source scripts/setup_env.sh   (VENV=path to choose another environment)
set -euo pipefail
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# PIP_SKIP_COMPILE=1 (.ci/run): no bytecode compiled at install (pip compiles every module of every package: 80 of the
# 130 s this install takes on 2 cores); Python writes the .pyc of the modules a run imports instead, unless
# PYTHONDONTWRITEBYTECODE is set (.ci/run clears it).
compile=()
if [ "${PIP_SKIP_COMPILE:-0}" = 1 ]; then compile=(--no-compile); fi
"$VENV/bin/python" -m pip install -q "${compile[@]}" 'torch==2.13.0' 'ms-swift==4.6.0' pytest pytest-xdist hypothesis pyyaml 'ruff==0.17.5' -e '.[grpo]'

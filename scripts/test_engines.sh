#!/usr/bin/env bash
# The multi-process engine tests: DDP, FSDP2 and DeepSpeed ZeRO-2/3 on 2 CPU processes (gloo), each compared with one
# process over the same samples per step (pytest marker `engines`; about 15 minutes on 2 cores; `slow` ones out: `-m engines` runs them too, on TEST_WORKERS
# processes: scripts/pytest_env.sh).
# Sets up the venv like scripts/test.sh, plus the `deepspeed` extra (deepspeed==0.19.8).
# Usage: bash scripts/test_engines.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV=$VENV bash scripts/setup_env.sh
compile=()  # PIP_SKIP_COMPILE=1: as in scripts/setup_env.sh
if [ "${PIP_SKIP_COMPILE:-0}" = 1 ]; then compile=(--no-compile); fi
"$VENV/bin/python" -m pip install -q "${compile[@]}" 'torch==2.13.0' -e '.[deepspeed]'
"$VENV/bin/python" -c 'import deepspeed' 2>/dev/null || { echo "deepspeed failed to import" >&2; exit 1; }
# a test a worker (test_engines.py's module fixture that several tests copy is built once: engine_runs.build_once)
source scripts/pytest_env.sh load
"$VENV/bin/python" -m pytest -q -m 'engines and not slow' --durations=20 "${PYTEST_WORKERS[@]}" "$@"

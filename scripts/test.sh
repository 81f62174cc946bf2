#!/usr/bin/env bash
# The whole test suite (CPU): sets up .venv, lints with ruff (settings in pyproject.toml), then runs pytest (slow and
# GPU tests are excluded by default) on TEST_WORKERS processes, a test file each (scripts/pytest_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV=$VENV bash scripts/setup_env.sh
"$VENV/bin/ruff" check .
source scripts/pytest_env.sh loadfile
"$VENV/bin/python" -m pytest -q --durations=30 "${PYTEST_WORKERS[@]}" "$@"

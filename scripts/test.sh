#!/usr/bin/env bash
# The whole test suite (CPU): sets up .venv, lints with ruff (settings in pyproject.toml), then runs pytest (slow and
# GPU tests are excluded by default).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV=$VENV bash scripts/setup_env.sh
"$VENV/bin/ruff" check .
"$VENV/bin/python" -m pytest -q --durations=30 "$@"

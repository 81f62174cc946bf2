#!/usr/bin/env bash
# End-to-end tests (real tiny `swift sft` LoRA runs, incl. batch growth) and the padding-free tests under transformers 4.57.6, in their own venv (.venv-tf457).
# The pins are the combination checked with `pip check` and the e2e tests: ms-swift 4.6.0 accepts transformers
# 4.57.6 as is; peft / trl / accelerate are pinned to the releases pip resolves for it today, so a later release
# that drops 4.57 support cannot break this job. torch is pinned in the same pip command so pip takes the CPU wheel.
# Usage (from anywhere): bash scripts/test_transformers_457.sh [extra pytest args]
# TF457_VENV=path chooses another environment (not VENV: .ci/run exports that for the main venv); TF457_SETUP_ONLY=1
# builds the environment and runs no test (.ci/run does that while the main venv is being built).
set -euo pipefail
cd "$(dirname "$0")/.."
TF457_VENV=${TF457_VENV:-.venv-tf457}
PINS=(
  'torch==2.13.0'
  'ms-swift==4.6.0'
  'transformers==4.57.6'
  'peft==0.20.0'
  'trl==0.29.1'
  'accelerate==1.15.0'
  pytest pytest-xdist hypothesis pyyaml
)

# Reinstall the pins only when the venv is new or does not hold them (a rerun costs nothing then).
pins_ok() {
  "$TF457_VENV/bin/python" - <<'EOF' >/dev/null 2>&1
from importlib.metadata import version
want = {'torch': '2.13.0', 'ms-swift': '4.6.0', 'transformers': '4.57.6', 'peft': '0.20.0', 'trl': '0.29.1',
        'accelerate': '1.15.0'}
bad = {k: version(k) for k in want if version(k).split('+')[0] != want[k]}
import pytest, xdist, hypothesis, yaml  # noqa: F401
raise SystemExit(1 if bad else 0)
EOF
}

start=$(date +%s)
if [ ! -x "$TF457_VENV/bin/python" ]; then
  python3 -m venv "$TF457_VENV"
fi
if ! pins_ok; then
  "$TF457_VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  compile=()  # PIP_SKIP_COMPILE=1: as in scripts/setup_env.sh
  if [ "${PIP_SKIP_COMPILE:-0}" = 1 ]; then compile=(--no-compile); fi
  "$TF457_VENV/bin/python" -m pip install -q "${compile[@]}" "${PINS[@]}"
fi
if [ "${TF457_SETUP_ONLY:-0}" = 1 ]; then  # the pins only: the pack's own editable install writes into this checkout
  "$TF457_VENV/bin/python" -m pip check
  echo "[test_transformers_457] pins installed in $(( $(date +%s) - start ))s"
  exit 0
fi
"$TF457_VENV/bin/python" -m pip install -q --no-deps -e .
"$TF457_VENV/bin/python" -m pip check
"$TF457_VENV/bin/python" -c 'import transformers, swift; print("transformers", transformers.__version__, "ms-swift", swift.__version__)'
echo "[test_transformers_457] environment ready in $(( $(date +%s) - start ))s"

source scripts/pytest_env.sh load  # a test a worker
# the e2e runs (with the two files' unit tests: about a second) and, as padding-free rows rely on transformers'
# packed-sequence masks (position_ids), every equality / no-cross-attention test: one session (one start of the workers)
"$TF457_VENV/bin/python" -m pytest tests/test_e2e_swift.py tests/test_batch_growth.py tests/test_padding_free.py -q \
  -p no:cacheprovider "${PYTEST_WORKERS[@]}" "$@"

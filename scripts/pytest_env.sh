# Sourced by the test scripts (scripts/test.sh, test_engines.sh, test_transformers_457.sh): how pytest uses this
# machine. Sets PYTEST_WORKERS (an array of pytest arguments) and exports the environment every test process inherits.
#
# - TEST_WORKERS: pytest-xdist worker processes (default: the CPU count, at most 4; 1 runs the tests in the pytest
#   process itself). Each worker then runs torch on one thread (OMP_NUM_THREADS=1 unless set): on the tiny models two
#   threads made a single process only 1.16x faster than one (figures: docs/development.md).
# - glibc malloc keeps the memory it frees (MALLOC_*, unless set): by default a large block (over 128 KB, a threshold
#   that rises to at most 32 MB) is a fresh mmap, zeroed by the kernel on first touch and unmapped when freed; a
#   training step allocates and frees hundreds of them, and that kernel time was about a third of the e2e tests' CPU
#   time. Test speed only: nothing a test checks depends on it.
# Usage: source scripts/pytest_env.sh <dist>   (<dist>: pytest-xdist's --dist mode: loadfile or load;
# not loadgroup, which does not group under pytest 9.2)
_dist=${1:-loadfile}
TEST_WORKERS=${TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 1); echo $(( n < 4 ? n : 4 )))}
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-4294967296}
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-4294967296}
export MALLOC_TOP_PAD_=${MALLOC_TOP_PAD_:-1073741824}
if [ "$TEST_WORKERS" -gt 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  PYTEST_WORKERS=(-n "$TEST_WORKERS" --dist "$_dist")
else
  PYTEST_WORKERS=()
fi
unset _dist

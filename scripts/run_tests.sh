#!/usr/bin/env bash
# The README's test command: installs what the tests need, then runs the unit and functional
# suites. GPU-only tests skip on CPU with a reason. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Test files run in TEST_WORKERS pytest-xdist processes (default: the CPU count, at most 4; 1:
# one process). Each test holds one thread (tests/conftest.py), so on 2 cores two files at a
# time cut the suite by about a fifth. A file stays on one worker (--dist loadfile): its module
# fixtures, some of them multi-rank runs, are made once. Debugging arguments need the tests in
# this process: with them (or pytest's own -n) no workers are started.
workers=${TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
if ! [[ $workers =~ ^[0-9]+$ ]]; then
  echo "run_tests.sh: TEST_WORKERS must be a whole number of processes, got '$workers' (1: no workers)" >&2
  exit 2
fi
[ -n "${TEST_WORKERS:-}" ] || [ "$workers" -le 4 ] || workers=4
for arg in "$@"; do
  case $arg in
    --pdb | --trace | -s | --capture=no | -n* | --numprocesses* | no:xdist) workers=1 ;;
  esac
done
source scripts/python_env.sh
bash scripts/setup_env.sh
# The megatron-core reference venv for the Megatron-LM interchange tests (they skip, saying
# so, without it; creating it needs PyPI). Already there: a no-op. MCORE_VENV=off: not made.
export MCORE_VENV=${MCORE_VENV:-$PWD/.venv-mcore}
if [ "$MCORE_VENV" != off ] && ! bash scripts/setup_mcore_venv.sh; then
  echo "WARNING: no megatron-core venv (PyPI unreachable?); the Megatron-LM interchange tests skip" >&2
fi
# pytest-xdist missing (an extras set without it): one process, said once.
if [ "$workers" -gt 1 ] && ! "$PYTHON" -c "import xdist" 2>/dev/null; then
  echo "WARNING: pytest-xdist is not installed; the tests run in one process" >&2
  workers=1
fi
parallel=()
[ "$workers" -le 1 ] || parallel=(-n "$workers" --dist loadfile)
set +e
# No path given: pytest runs pyproject.toml's testpaths (tests/); a path narrows it.
"$PYTHON" -m pytest -q -p no:cacheprovider -p no:benchmark --timeout 900 \
  ${parallel[@]+"${parallel[@]}"} "$@"
status=$?
set -e
# pytest exits 5 when it collected nothing: that is a broken suite, not a pass.
if [ "$status" -eq 5 ]; then
  echo "ERROR: pytest collected no tests" >&2
  exit 1
fi
exit "$status"

#!/usr/bin/env bash
# The project's whole test suite, from a fresh CPU machine: sets up the venv, then runs pytest.
# Usage: bash tools/run_tests.sh [pytest args...]
# pytest's exit code 5 (no tests collected) is turned into a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh --tests
VENV="${MEGATRON_RL_VENV:-.venv}"
export OMP_NUM_THREADS=1
set +e
"$VENV/bin/python" -m pytest tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "ERROR: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"

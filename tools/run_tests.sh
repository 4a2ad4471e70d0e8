#!/usr/bin/env bash
# The project's whole test suite, from a fresh CPU machine, at both ends of the supported megatron-core range:
#   leg 1: the full suite on megatron-core 0.16.1 in .venv (with SGLang: the real-server tests);
#   leg 2: every test marked `mcore` on megatron-core 0.19.2 in .venv-mcore019 (no SGLang): each test file that
#          imports megatron, itself or through a project module that does (tests/conftest.py imports_megatron),
#          and the files that mark themselves (megatron only in the ranks they start).
# Each leg runs in two passes: the tests marked `serial` (a wall-clock bound is their claim: tests/conftest.py
# WALL_CLOCK_BOUND) one at a time with nothing beside them, then the rest on MEGATRON_RL_TEST_WORKERS pytest-xdist
# workers (default 2; whole files per worker, so a module's server or model is built once; longest files first,
# tests/conftest.py). Much of the suite waits
# on servers, launchers, deadlines and forked ranks, so two workers overlap one test's waiting with another's work.
# MEGATRON_RL_TEST_WORKERS=1: one pass, one process, as before. Each pass prints its 25 slowest tests
# (--durations=25), each with its own pytest temporary directory.
# MEGATRON_RL_TEST_SIDE_BY_SIDE=1 runs leg 2 beside leg 1, leg 2's output after leg 1's; off by default: on 2 cores
# the legs compete for the same cores.
# Usage: bash tools/run_tests.sh [pytest args...]      (the args go to both legs)
#   MEGATRON_RL_VENV / MEGATRON_RL_VENV_NEWEST   the two venvs (default .venv / .venv-mcore019)
#   MEGATRON_RL_MCORE_NEWEST=0.19.x              the newest leg's release (default 0.19.2)
#   MEGATRON_RL_TEST_LEGS=both|oldest|newest     which legs run (default both)
#   MEGATRON_RL_TEST_WORKERS=N                   xdist workers of each leg's first pass (default 2; 1: one pass)
# Both legs always run; the command fails if either fails. pytest's exit code 5 (no tests collected) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=0.16.1
NEWEST="${MEGATRON_RL_MCORE_NEWEST:-0.19.2}"
OLD_VENV="${MEGATRON_RL_VENV:-.venv}"
NEW_VENV="${MEGATRON_RL_VENV_NEWEST:-.venv-mcore019}"
LEGS="${MEGATRON_RL_TEST_LEGS:-both}"
case "$LEGS" in both|oldest|newest) ;; *)
  echo "tools/run_tests.sh: MEGATRON_RL_TEST_LEGS='$LEGS' (expected both, oldest or newest)" >&2; exit 2 ;;
esac
export OMP_NUM_THREADS=1
# bytecode is cached: every test starts many Python processes (ranks, launchers, servers), each importing the
# project, and pytest rewrites the asserts of every test module at each collection unless it may cache them
unset PYTHONDONTWRITEBYTECODE

WORKERS="${MEGATRON_RL_TEST_WORKERS:-2}"
case "$WORKERS" in ''|*[!0-9]*|0)
  echo "tools/run_tests.sh: MEGATRON_RL_TEST_WORKERS='$WORKERS' (expected a number >= 1)" >&2; exit 2 ;;
esac

# the files of the serial pass (tests/conftest.py WALL_CLOCK_BOUND): it collects those alone, not the whole tree
mapfile -t SERIAL_FILES < <(sed -n '/^WALL_CLOCK_BOUND = (/,/^)/p' tests/conftest.py | grep -o '"tests/[^":]*\.py' \
                             | tr -d '"' | sort -u)
if [ "${#SERIAL_FILES[@]}" -eq 0 ]; then
  echo "tools/run_tests.sh: no file named in tests/conftest.py WALL_CLOCK_BOUND" >&2; exit 2
fi

run_pass() {  # run_pass NAME PYTHON PYTEST_ARGS... ; prints and returns pytest's status
  local name="$1" py="$2"; shift 2
  echo "=== tools/run_tests.sh: $name"
  local log
  log="$(mktemp "$TMP_ROOT/pass.XXXXXX")"
  set +e
  "$py" -m pytest --durations=25 "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  set -e
  # pytest's short summary lines of what failed, kept for the recap at the very end (CI shows the tail)
  grep -E '^(FAILED|ERROR) ' "$log" | sed "s|^|[$name] |" >> "$RECAP" || true
  echo "=== tools/run_tests.sh: $name: exit code $rc"
  return "$rc"
}

run_leg() {  # run_leg NAME PYTHON MARK BASETEMP PYTEST_ARGS... ; prints and returns the leg's status (no test -> 1)
  local name="$1" py="$2" mark="$3" base="$4"; shift 4
  local and="${mark:+$mark and }" rc=0 rc_serial=0
  echo "=== tools/run_tests.sh: $name: $("$py" -c 'from importlib.metadata import version as v; print("megatron-core", v("megatron-core"))')"
  if [ "$WORKERS" -eq 1 ]; then
    run_pass "$name" "$py" tests ${mark:+-m "$mark"} --basetemp="$base" "$@" || rc=$?
  else
    # the serial pass first: a selection without wall-clock tests then ends on the pass that ran tests
    run_pass "$name, serial (wall-clock bounds)" "$py" "${SERIAL_FILES[@]}" -m "${and}serial" \
      --basetemp="$base-serial" "$@" || rc_serial=$?
    run_pass "$name, $WORKERS workers" "$py" tests -n "$WORKERS" --dist loadfile --no-loadscope-reorder -m "${and}not serial" \
      --basetemp="$base" "$@" || rc=$?
    if [ "$rc_serial" -eq 5 ] && [ "$rc" -eq 0 ]; then   # a selection without wall-clock tests (e.g. one file)
      echo "=== tools/run_tests.sh: $name: no serial test in this selection"
      rc_serial=0
    fi
    if [ "$rc" -eq 0 ]; then rc=$rc_serial; fi
  fi
  if [ "$rc" -eq 5 ]; then
    echo "ERROR: $name: pytest collected no tests" >&2
    rc=1
  fi
  echo "=== tools/run_tests.sh: $name: exit code $rc"
  return "$rc"
}

# both venvs first: leg 1's cross-release checkpoint test (tests/integration/test_mcore_cross_checkpoint.py) uses both.
# Side by side: much of a set-up is waiting on downloads and single-threaded steps (the editable install is
# serialised in tools/setup_env.sh by flock; without flock, one after the other); the newest venv's output follows
# the oldest's.
LEG2_PID=""
SETUP_PID=""
cleanup() {  # an interrupted run takes the background set-up and leg 2 with it
  for pid in "$SETUP_PID" "$LEG2_PID"; do
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null || true; fi
  done
}
trap cleanup EXIT
SETUP_LOG="$(mktemp -t megatron_rl_setup.XXXXXX)"
rc_setup_new=0
if command -v flock > /dev/null; then
  MEGATRON_RL_VENV="$NEW_VENV" bash tools/setup_env.sh --dev --mcore "$NEWEST" > "$SETUP_LOG" 2>&1 &
  SETUP_PID=$!
fi
rc_setup_old=0
MEGATRON_RL_VENV="$OLD_VENV" bash tools/setup_env.sh --tests --mcore "$OLDEST" || rc_setup_old=$?
if [ -n "$SETUP_PID" ]; then
  wait "$SETUP_PID" || rc_setup_new=$?
  SETUP_PID=""
else
  MEGATRON_RL_VENV="$NEW_VENV" bash tools/setup_env.sh --dev --mcore "$NEWEST" > "$SETUP_LOG" 2>&1 || rc_setup_new=$?
fi
cat "$SETUP_LOG"
rm -f "$SETUP_LOG"
if [ "$rc_setup_old" -ne 0 ] || [ "$rc_setup_new" -ne 0 ]; then
  echo "tools/run_tests.sh: venv set-up failed ($OLD_VENV: exit $rc_setup_old; $NEW_VENV: exit $rc_setup_new)" >&2
  exit 1
fi
export MEGATRON_RL_VENV="$OLD_VENV" MEGATRON_RL_VENV_NEWEST="$NEW_VENV"
rc_old=0
rc_new=0
TMP_ROOT="$(mktemp -d -t megatron_rl_tests.XXXXXX)"
RECAP="$TMP_ROOT/recap.txt"
: > "$RECAP"
LEG2_LOG="$TMP_ROOT/leg2.log"
leg1() { run_leg "leg 1 (full suite, megatron-core $OLDEST)" "$OLD_VENV/bin/python" "" "$TMP_ROOT/leg1" "$@"; }
leg2() { run_leg "leg 2 (-m mcore, megatron-core $NEWEST)" "$NEW_VENV/bin/python" mcore "$TMP_ROOT/leg2" "$@"; }
if [ "$LEGS" = both ] && [ "${MEGATRON_RL_TEST_SIDE_BY_SIDE:-0}" = 1 ]; then
  echo "=== tools/run_tests.sh: leg 2 runs beside leg 1; its output follows leg 1's"
  leg2 "$@" > "$LEG2_LOG" 2>&1 &
  LEG2_PID=$!
  leg1 "$@" || rc_old=$?
  wait "$LEG2_PID" || rc_new=$?
  LEG2_PID=""
  cat "$LEG2_LOG"
else
  if [ "$LEGS" != newest ]; then leg1 "$@" || rc_old=$?; fi
  if [ "$LEGS" != oldest ]; then leg2 "$@" || rc_new=$?; fi
fi
if [ -s "$RECAP" ]; then
  echo "=== tools/run_tests.sh: what failed, every pass (pytest's short summary lines):"
  cat "$RECAP"
fi
rm -rf "$TMP_ROOT"
echo "tools/run_tests.sh: megatron-core $OLDEST leg: exit $rc_old; megatron-core $NEWEST leg: exit $rc_new"
if [ "$rc_old" -ne 0 ]; then exit "$rc_old"; fi
exit "$rc_new"

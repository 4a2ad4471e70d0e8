#!/usr/bin/env bash
# Knowing before users do: the newest versions setup.py's ranges admit, in fresh venvs, against the lock.
#   1. sets up .venv-latest as the test command's main venv would be (--tests, megatron-core 0.16.1) but with
#      MEGATRON_RL_LOCK=none: whatever the registry serves today within setup.py's ranges;
#   2. prints every distribution whose version differs from tools/lock/tests.txt (or that only one side has);
#   3. runs a smoke subset in it: the quickstart for a few steps (its own run directory), the unit tests, the
#      shadowing test and one real SGLang-server test. Exit status: the smoke's (0: the newest set works so far).
# --write-lock: after a passing smoke, writes tools/lock/ anew from fresh venvs: tests.txt from .venv-latest;
#   main.txt (the quickstart's lean venv) and tests-mcore019.txt (--dev --mcore 0.19.2) each set up fresh under
#   the new tests.txt (less megatron-core for 0.19), so a package the venvs share has one version in all three.
#   Then run the whole suite on the new lock (bash tools/run_tests.sh, which installs it) before committing it.
# Usage: bash tools/latest.sh [--write-lock] [--no-smoke]      (docs/dependencies.md)
#   MEGATRON_RL_LATEST_VENV  the venv (default .venv-latest); it is set up from scratch each time
set -euo pipefail
cd "$(dirname "$0")/.."
WRITE=0
SMOKE=1
for a in "$@"; do
  case "$a" in
    --write-lock) WRITE=1 ;;
    --no-smoke) SMOKE=0 ;;
    *) echo "tools/latest.sh: unknown option '$a' (expected --write-lock, --no-smoke)" >&2; exit 2 ;;
  esac
done
if [ "$WRITE" = 1 ] && [ "$SMOKE" = 0 ]; then
  echo "tools/latest.sh: --write-lock needs the smoke (a lock is only written from a set that passed it)" >&2; exit 2
fi
VENV="${MEGATRON_RL_LATEST_VENV:-.venv-latest}"
export OMP_NUM_THREADS=1
rm -rf "$VENV"
echo "=== tools/latest.sh: setting up $VENV with the newest versions setup.py admits"
MEGATRON_RL_LOCK=none MEGATRON_RL_VENV="$VENV" bash tools/setup_env.sh --tests --mcore 0.16.1
echo "=== tools/latest.sh: versions that differ from tools/lock/tests.txt (what CI runs)"
if [ -f tools/lock/tests.txt ]; then
  "$VENV/bin/python" tools/lockfile.py diff tools/lock/tests.txt
else
  echo "(no tools/lock/tests.txt yet)"
fi
rc=0
export MEGATRON_RL_LOCK=none   # the smoke's tests know this venv is not the lock's (tests/unit/test_lockfile.py)
if [ "$SMOKE" = 1 ]; then
  RUN=runs/latest_smoke
  echo "=== tools/latest.sh: smoke 1/3: the quickstart, 4 steps ($RUN)"
  MEGATRON_RL_VENV="$VENV" bash tools/quickstart.sh trainer.steps=4 "trainer.run_dir=$RUN" \
    || rc=$?
  echo "=== tools/latest.sh: smoke 2/3: the unit tests"
  MEGATRON_RL_VENV="$VENV" "$VENV/bin/python" -m pytest -q -n 2 tests/unit -m "not serial" -p no:cacheprovider \
    --basetemp="$(mktemp -d)/unit" || rc=$?
  echo "=== tools/latest.sh: smoke 3/3: the shadowing test and a real SGLang server"
  MEGATRON_RL_VENV="$VENV" "$VENV/bin/python" -m pytest -q tests/integration/test_no_shadowing.py \
    tests/integration/test_launch_sglang_cpu.py -p no:cacheprovider --basetemp="$(mktemp -d)/integ" || rc=$?
  echo "=== tools/latest.sh: smoke: exit code $rc"
fi
if [ "$WRITE" = 1 ]; then
  if [ "$rc" -ne 0 ]; then echo "tools/latest.sh: the smoke failed: no lock written" >&2; exit "$rc"; fi
  unset MEGATRON_RL_LOCK
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  "$VENV/bin/python" tools/lockfile.py write "$TMP/tests.txt" --name "tests (tools/setup_env.sh --tests --mcore 0.16.1)"
  grep -v '^megatron-core==' "$TMP/tests.txt" > "$TMP/tests-no-mcore.txt"
  rm -rf "$VENV-main" "$VENV-mcore019"
  MEGATRON_RL_LOCK="$TMP/tests.txt" MEGATRON_RL_VENV="$VENV-main" bash tools/setup_env.sh
  "$VENV-main/bin/python" tools/lockfile.py write "$TMP/main.txt" --name "main job (tools/setup_env.sh)"
  MEGATRON_RL_LOCK="$TMP/tests-no-mcore.txt" MEGATRON_RL_VENV="$VENV-mcore019" bash tools/setup_env.sh --dev --mcore 0.19.2
  "$VENV-mcore019/bin/python" tools/lockfile.py write "$TMP/tests-mcore019.txt" \
    --name "megatron-core 0.19 leg (tools/setup_env.sh --dev --mcore 0.19.2)"
  mkdir -p tools/lock
  cp "$TMP/tests.txt" "$TMP/main.txt" "$TMP/tests-mcore019.txt" tools/lock/
  rm -rf "$VENV-main" "$VENV-mcore019"
  echo "=== tools/latest.sh: wrote tools/lock/{main,tests,tests-mcore019}.txt; now run bash tools/run_tests.sh on them" \
       "(it installs them) before committing"
fi
exit "$rc"

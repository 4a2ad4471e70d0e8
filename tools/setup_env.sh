#!/usr/bin/env bash
# Create (or reuse) the project virtualenv for a CPU machine and install megatron-rl into it.
# Order matters: torch==2.13.0 (CPU build) first, then everything else under a constraint that
# keeps it, otherwise the resolver picks a multi-GB CUDA torch.
# Locked: the set-ups CI runs install exactly the versions of tools/lock/ (main.txt: no flag; tests.txt: --tests;
# tests-mcore019.txt: --dev --mcore 0.19.2; tools/lockfile.py picks one by flags and Python) as a constraint, and
# the venv is checked against it at the end (exit 1 where it differs). MEGATRON_RL_LOCK=none installs the newest
# versions setup.py's ranges admit instead (tools/latest.sh); MEGATRON_RL_LOCK=FILE uses FILE. docs/dependencies.md.
# Installs with uv (`uv pip install`, the venv's own uv, pip's indexes and settings: tools/pkg_install.sh),
# which resolves the same packages as pip for a fraction of its CPU time; with pip where uv is unavailable
# or MEGATRON_RL_INSTALLER=pip.
# Usage: bash tools/setup_env.sh [--tests | --dev] [--mcore VERSION]
#   (no flag)      what the main job needs and nothing more: the project and its install_requires
#                  (the quickstart uses this, so CI proves the main job's dependencies on their own)
#   --tests        also the `dev` extra (pytest, triton, ...) and SGLang the lean CPU way (the test
#                  suite's real-server tests need it; the quickstart's embedded engine does not)
#   --dev          the `dev` extra without SGLang (the megatron-core 0.19 leg of tools/run_tests.sh)
#   --mcore V      megatron-core==V (setup.py admits 0.16.1 <= V < 0.20), installed before the project so
#                  the resolver keeps it; also $MEGATRON_RL_MCORE. Without it the resolver picks the newest
#                  release the Python admits (0.16.1 on Python 3.11, 0.19.x on 3.12+).
# The venv is $MEGATRON_RL_VENV; by default ./.venv, or ./.venv-mcoreMMM with --mcore (0.19.2 -> .venv-mcore019,
# 0.16.1 -> .venv-mcore016), so a second megatron-core lives next to the main venv.
# megatron-core 0.17+ wheels say Requires-Python >=3.12, but 0.19.2's wheel is a cp311 build that imports
# and passes the suite on Python 3.11: there it is installed with pip's --ignore-requires-python (uv has no
# such switch and refuses the wheel), plus triton (0.19 imports it at `import megatron.core`).
set -euo pipefail
# a relative MEGATRON_RL_LOCK=FILE is the caller's, not the repository root's
case "${MEGATRON_RL_LOCK:-}" in ""|auto|none|/*) ;; *) MEGATRON_RL_LOCK="$PWD/$MEGATRON_RL_LOCK" ;; esac
cd "$(dirname "$0")/.."
MODE=""
MCORE="${MEGATRON_RL_MCORE:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --tests|--dev) MODE="$1"; shift ;;
    --mcore)
      [ $# -ge 2 ] || { echo "tools/setup_env.sh: --mcore needs a version (e.g. --mcore 0.19.2)" >&2; exit 2; }
      MCORE="$2"; shift 2 ;;
    *) echo "tools/setup_env.sh: unknown option '$1' (expected --tests, --dev, --mcore VERSION)" >&2; exit 2 ;;
  esac
done
if [ -n "$MCORE" ] && ! [[ "$MCORE" =~ ^0\.(1[6-9])\.[0-9]+$ ]] || [ "$MCORE" = "0.16.0" ]; then
  echo "tools/setup_env.sh: --mcore '$MCORE': the project supports megatron-core 0.16.1 through 0.19.x" >&2
  exit 2
fi
if [ -n "$MCORE" ]; then
  MINOR="${MCORE#0.}"; MINOR="${MINOR%%.*}"
  VENV="${MEGATRON_RL_VENV:-.venv-mcore0$MINOR}"
else
  VENV="${MEGATRON_RL_VENV:-.venv}"
fi
mkdir -p "$VENV"
# one set-up of a venv at a time: two quickstarts started together would both install -e . into it and the
# second fails midway (a removed console script); the later one waits here, then its install steps are no-ops.
# flock is util-linux (every Linux image); where it is missing (macOS) set-ups are not serialised.
if command -v flock > /dev/null; then
  exec 9>"$VENV/.megatron_rl_setup.lock"
  flock 9
else
  echo "tools/setup_env.sh: flock not found: do not run two set-ups of $VENV at once" >&2
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
LOCK=""
LOCK_KIND=""
case "${MEGATRON_RL_LOCK:-auto}" in
  auto) SELECTED="$("$VENV/bin/python" tools/lockfile.py select -- "$MODE" "$MCORE")"   # "KIND PATH" or ""
        LOCK_KIND="${SELECTED%% *}"
        LOCK="${SELECTED#* }"
        if [ -z "$SELECTED" ]; then
          echo "tools/setup_env.sh: no lock in tools/lock/ for this set-up (${MODE:-main job}, megatron-core ${MCORE:-default}, $("$VENV/bin/python" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])')): installing the newest versions setup.py admits (not what CI tested)" >&2
        fi ;;
  none) echo "tools/setup_env.sh: MEGATRON_RL_LOCK=none: the newest versions setup.py admits (not what CI tested)" >&2 ;;
  *) LOCK="$MEGATRON_RL_LOCK"; LOCK_KIND=subset
     [ -f "$LOCK" ] || { echo "tools/setup_env.sh: MEGATRON_RL_LOCK=$LOCK: no such file" >&2; exit 2; } ;;
esac
LOCKC=(-c /dev/null)   # never empty: bash 3.2 (macOS) calls an empty array unbound under set -u
if [ -n "$LOCK" ]; then LOCKC=(-c "$LOCK"); fi
export MEGATRON_RL_LOCK_FILE="$LOCK"   # tools/pkg_install.sh (uv's version) and tools/install_sglang_cpu.sh read it
source tools/pkg_install.sh
pkg_install_init "$VENV"   # sets PY, PIP (pip), INSTALL (uv, or pip without it) and INSTALLER (which)
stage() { echo "tools/setup_env.sh [$VENV]: $*"; }   # one progress line per stage (a first set-up takes minutes)
stage "pip and torch==2.13.0 (CPU)${LOCK:+, locked by $LOCK}"
"${INSTALL[@]}" --upgrade pip "${LOCKC[@]}"
"${INSTALL[@]}" "torch==2.13.0" "${LOCKC[@]}"
CONSTRAINTS=(-c tools/constraints-cpu.txt "${LOCKC[@]}")
requirements_of() {  # DIST [EXTRA...]: DIST's installed requirements for this Python, with those EXTRAs' and no
  # other (markers evaluated, then dropped), less megatron-core (installed on its own, pinned)
  "$PY" - "$@" <<'PY'
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
dist, extras = sys.argv[1], [""] + sys.argv[2:]
for line in requires(dist) or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") != "megatron-core" and (req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras)):
        req.marker = None
        print(req)
PY
}
SKIP_PY_CHECK=""
if [ -n "$MCORE" ]; then
  EXTRA=()
  if [ "$MINOR" -ge 17 ] && ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    EXTRA=(--ignore-requires-python)   # cp311 wheel whose metadata says >=3.12 (see above)
    SKIP_PY_CHECK=1
  fi
  TRITON=()
  if [ "$MINOR" -ge 19 ]; then TRITON=("triton>=3.0"); fi
  # pip, not uv: --ignore-requires-python (see above) for the one package, without its dependencies
  "${PIP[@]}" --no-deps "${EXTRA[@]}" "megatron-core==$MCORE"
  # its own requirements, resolved for this Python (with --ignore-requires-python the resolver would also
  # take numpy sdists that need 3.12+); extras' requirements are left out
  REQS="$VENV/.megatron_rl_mcore_requires.txt"
  requirements_of megatron-core > "$REQS"
  "${INSTALL[@]}" -r "$REQS" "${TRITON[@]}" -c tools/constraints-cpu.txt "${LOCKC[@]}"
  # keep exactly this megatron-core while the project and its extras install
  PIN="$VENV/.megatron_rl_mcore_pin.txt"
  echo "megatron-core==$MCORE" > "$PIN"
  CONSTRAINTS+=(-c "$PIN")
fi
install_project() {  # . or .[EXTRA]
  if [ -n "$SKIP_PY_CHECK" ] && [ "$INSTALLER" = uv ]; then
    # uv checks the installed megatron-core's Requires-Python too (pip does not): the project without
    # dependencies, then its requirements and its extra's, megatron-core (in place, pinned) left out
    "${INSTALL[@]}" --no-deps -e "$1" "${CONSTRAINTS[@]}"
    local extra="${1#.}"; extra="${extra#[}"; extra="${extra%]}"
    requirements_of megatron-rl $extra > "$VENV/.megatron_rl_requires.txt"
    "${INSTALL[@]}" -r "$VENV/.megatron_rl_requires.txt" "${CONSTRAINTS[@]}"
  else
    "${INSTALL[@]}" -e "$1" "${CONSTRAINTS[@]}"
  fi
}
editable() {  # install -e: it writes megatron_rl.egg-info into the source tree, so one venv at a time does it
  # (tools/run_tests.sh sets its two venvs up side by side); the lock is the tree's, not the venv's
  if command -v flock > /dev/null; then
    ( flock 8; install_project "$1" ) 8>".megatron_rl_editable.lock"
  else
    install_project "$1"
  fi
}
stage "megatron-rl${MODE:+ ($MODE)} and its requirements${MCORE:+, megatron-core $MCORE}"
case "$MODE" in
  "") editable . ;;
  --dev) editable ".[dev]" ;;
  --tests)
    editable ".[dev]"
    # SGLang without its ~11 GB of CUDA packages (the real-server tests and rollout.engine=sglang on
    # CPU); idempotent: a stamp file makes re-runs instant.
    stage "SGLang, the lean CPU install"
    bash tools/install_sglang_cpu.sh "$VENV" ;;
esac
if [ -n "$LOCK" ]; then
  COMPLETE=()
  if [ "$LOCK_KIND" = complete ]; then COMPLETE=(--complete); fi
  "$PY" tools/lockfile.py check "$LOCK" "${COMPLETE[@]+"${COMPLETE[@]}"}"
fi
"$PY" -W ignore - <<'PY'
import torch, megatron.core
print(f"megatron-rl env ready: torch {torch.__version__}, megatron-core {megatron.core.__version__}")
PY

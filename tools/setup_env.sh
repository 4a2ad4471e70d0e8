#!/usr/bin/env bash
# Create (or reuse) the project virtualenv for a CPU machine and install megatron-rl into it.
# Order matters: torch==2.13.0 (CPU build) first, then everything else under a constraint that
# keeps it, otherwise pip resolves a multi-GB CUDA torch.
# Usage: bash tools/setup_env.sh [--tests]   (venv at $MEGATRON_RL_VENV, default ./.venv)
#   (no flag)  what the main job needs and nothing more: the project and its install_requires
#              (the quickstart uses this, so CI proves the main job's dependencies on their own)
#   --tests    also the `dev` extra (pytest, triton, ...) and SGLang the lean CPU way (the test
#              suite's real-server tests need it; the quickstart's embedded engine does not)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MEGATRON_RL_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==2.13.0"
case "${1:-}" in
  "") "$PY" -m pip install -q -e . -c tools/constraints-cpu.txt ;;
  --tests)
    "$PY" -m pip install -q -e ".[dev]" -c tools/constraints-cpu.txt
    # SGLang without its ~11 GB of CUDA packages (the real-server tests and rollout.engine=sglang on
    # CPU); idempotent: a stamp file makes re-runs instant. pip prints expected "sglang requires ..." lines.
    bash tools/install_sglang_cpu.sh "$VENV" ;;
  *) echo "tools/setup_env.sh: unknown option '$1' (expected nothing or --tests)" >&2; exit 2 ;;
esac
"$PY" - <<'PY'
import torch, megatron.core
print(f"megatron-rl env ready: torch {torch.__version__}, megatron-core {megatron.core.__version__}")
PY

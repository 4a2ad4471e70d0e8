#!/usr/bin/env bash
# Lean, CPU-only install of SGLang into an existing venv (what it needs on CPU: README, "Two commands").
#
# `pip install sglang` pulls ~11 GB of CUDA packages and a different torch. Instead this script:
#   1. installs the sglang wheel itself with --no-deps (version $SGLANG_VERSION, default 0.5.23), and
#      mistral-common with --no-deps too (it caps numpy<2.4; the project has numpy 2.4.x);
#   2. reads sglang's own requirement list from its installed metadata and drops
#      (a) torch and the CUDA-only / GPU-kernel packages (EXCLUDE below) and
#      (b) the version pins on packages the project shares with sglang (RELAX below: sglang 0.5.23
#          pins transformers==5.19.0, tokenizers==0.23.2, python-dateutil<3, torch==2.14.1, kernels<0.15; the
#          project keeps the versions already installed — the real-server tests prove they work);
#   3. installs the rest under tools/constraints-cpu.txt (torch==2.13.0) PLUS a constraint that
#      freezes every shared package already installed in the venv at its current version, so this
#      script can never change torch / numpy / transformers / tokenizers / megatron-core under
#      the rest of the project (the install fails loudly instead).
# On CPU the server additionally needs two import-only stand-ins (sgl_kernel, torchvision); they
# live in megatron_rl/platform/sglang_cpu/ and are put on PYTHONPATH only for the server process
# by megatron_rl/rollout/sglang_server.py — nothing is installed for them here.
#
# Idempotent: a stamp file in the venv records the sglang version and this script's hash; when it
# matches and sglang's package directory exists, the script exits at once (~0.03 s).
# Installs with uv where it can (tools/pkg_install.sh), else pip; pip then prints "ERROR: pip's dependency
# resolver ... sglang requires X": expected -- those are exactly the excluded CUDA packages and relaxed pins.
# Measured (2 busy cores): ~20 s with uv from a cold cache (~45-215 s with pip, warm cache), ~1.0 GB added to the
# project venv (102 packages).
#
# Usage: bash tools/install_sglang_cpu.sh [VENV]   (default: $MEGATRON_RL_VENV or .venv, relative to
#        the repository root like tools/setup_env.sh; an explicit VENV argument is relative to the cwd)
#        SGLANG_VERSION=0.5.23 FORCE=1 bash tools/install_sglang_cpu.sh /path/to/venv
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -ge 1 ]; then
  VENV="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
else
  VENV="${MEGATRON_RL_VENV:-.venv}"
  case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
fi
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
PY="$VENV/bin/python"
CONSTRAINTS="$ROOT/tools/constraints-cpu.txt"
# the lock tools/setup_env.sh installs under (tools/lock/; empty: none), a constraint of every step here
# run on its own (no MEGATRON_RL_LOCK_FILE in the environment): the test venv's lock, as tools/setup_env.sh --tests
if [ -z "${MEGATRON_RL_LOCK_FILE+set}" ] && [ -x "$PY" ]; then
  SELECTED="$("$PY" "$ROOT/tools/lockfile.py" select -- --tests 0.16.1)"
  MEGATRON_RL_LOCK_FILE="${SELECTED#* }"
fi
LOCKC=(-c /dev/null)   # never empty (bash 3.2 and set -u)
if [ -n "${MEGATRON_RL_LOCK_FILE:-}" ]; then LOCKC=(-c "$MEGATRON_RL_LOCK_FILE"); fi
if [ ! -x "$PY" ]; then
  echo "ERROR: no python at $PY (create the venv first, e.g. bash tools/setup_env.sh)" >&2
  exit 1
fi

STAMP="$VENV/.megatron_rl_sglang_cpu.stamp"
LOCK_SUM=none
if [ -n "${MEGATRON_RL_LOCK_FILE:-}" ]; then LOCK_SUM="$(sha256sum "$MEGATRON_RL_LOCK_FILE" | cut -c1-16)"; fi
WANT="sglang=$SGLANG_VERSION script=$(sha256sum "$0" | cut -c1-16) lock=$LOCK_SUM"
if [ "${FORCE:-0}" != "1" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
   && [ -n "$(ls -d "$VENV"/lib/python3*/site-packages/sglang 2>/dev/null)" ]; then
  echo "sglang $SGLANG_VERSION (lean CPU install) already present in $VENV"
  exit 0
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "ERROR: torch is not importable in $VENV; install torch==2.13.0 first (tools/setup_env.sh)" >&2
  exit 1
fi
source "$ROOT/tools/pkg_install.sh"
pkg_install_init "$VENV"   # INSTALL: uv (pip's indexes and settings), or pip without it

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
start=$(date +%s)

# 1. The wheel itself and NODEPS packages (whose own pins conflict with the project's: mistral-common
#    caps numpy<2.4 while the project has numpy 2.4.x; sglang uses it only for Mistral tokenizers),
#    without dependencies; their requirement lists are filtered and installed in step 2.
NODEPS="mistral-common==1.13.1"
"${INSTALL[@]}" --no-deps "sglang==$SGLANG_VERSION" $NODEPS -c "$CONSTRAINTS" "${LOCKC[@]}"

# 2. Its requirement list minus torch/CUDA-only packages, shared pins relaxed; plus a freeze of
#    the shared packages already installed.
"$PY" - "$TMP/req.txt" "$TMP/freeze.txt" <<'PY'
import re
import sys
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement

# torch itself and packages that are CUDA builds, GPU kernels, or only needed by GPU/vision paths.
EXCLUDE = {
    "torch", "torchvision", "torchaudio", "torchcodec", "timm", "torch-memory-saver",
    "sglang-kernel", "sgl-kernel", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache",
    "flash-attn", "flash-attn-4", "cuda-python", "nvshmem4py-cu13", "sgl-deep-ep",
    "sgl-deep-gemm", "sgl-flash-mla", "tilelang", "quack-kernels", "humming-kernels", "numba",
    "apache-tvm-ffi", "nvidia-cutlass-dsl", "nvidia-mathdx", "deepseek-recipe", "py-spy",
}
# Shared with megatron-core / the project: keep whatever the venv already has (pins dropped).
# kernels: sglang 0.5.23 asks for kernels<0.15 (Hugging Face's hub kernels, imported only by its CUDA FA3 path),
# transformers >= 5.25 for kernels>=0.19.1 (imported at `import transformers`): the venv keeps transformers'.
RELAX = {"transformers", "tokenizers", "python-dateutil", "numpy", "safetensors",
         "huggingface-hub", "pydantic", "triton", "pillow", "packaging", "kernels"}
# Frozen at their installed version while sglang's dependencies are installed.
FREEZE = RELAX | {"torch", "megatron-core", "pydantic-core", "requests", "pyyaml", "regex"}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


out = []
lines = list(requires("sglang") or [])
for extra_pkg in ("mistral-common",):  # the NODEPS packages of step 1
    lines += [l for l in requires(extra_pkg) or [] if norm(Requirement(l).name) != "numpy"]
for line in lines:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # extras and other-platform requirements
    name = norm(req.name)
    if name in EXCLUDE or name.startswith("nvidia-"):
        continue
    if name in ("mistral-common",):
        continue  # installed with --no-deps in step 1
    if name in RELAX:
        out.append(req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else ""))
    else:
        req.marker = None
        out.append(str(req))
out = sorted(set(out))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
frozen = []
for name in sorted(FREEZE):
    try:
        frozen.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
open(sys.argv[2], "w").write("\n".join(frozen) + "\n")
PY
"${INSTALL[@]}" -r "$TMP/req.txt" -c "$CONSTRAINTS" -c "$TMP/freeze.txt" "${LOCKC[@]}"

# 3. Sanity: sglang imports with the project's torch (the stand-ins are not needed for this).
"$PY" - <<'PY'
import importlib.metadata as md
import torch
print(f"sglang {md.version('sglang')} installed (lean CPU): torch {torch.__version__}, "
      f"transformers {md.version('transformers')}, numpy {md.version('numpy')}")
PY
echo "$WANT" > "$STAMP"
echo "install_sglang_cpu: done in $(( $(date +%s) - start )) s"

# Package installs into a venv for tools/setup_env.sh and tools/install_sglang_cpu.sh (sourced, not run).
#
# `pkg_install_init VENV` sets two arrays and a name:
#   PIP      "$PY" -m pip install -q ...  (kept for what only pip does: --ignore-requires-python)
#   INSTALL  uv's `uv pip install --python "$PY"` with pip's settings, or PIP where uv cannot be had;
# and INSTALLER, which of the two INSTALL is (uv | pip), for the steps whose semantics differ between them.
# uv resolves like pip (same requirements, constraints, indexes; the set-ups' package sets and versions are the
# same) at a fraction of pip's CPU time: on 2 cores the lean venv takes ~12 CPU-s instead of ~54. uv comes from
# `pip install uv` into the venv (once; ~2 CPU-s); where that fails (no uv wheel for the platform, no index),
# everything installs with pip, as it did before uv.
# uv reads UV_* variables, not pip's configuration: pip's effective settings (`pip config list`: its config
# files and PIP_* variables, the variables winning) are handed to uv -- index-url, extra-index-url, find-links,
# constraint, no-index, trusted-host, pre, cert, default-timeout, proxy -- and --index-strategy
# unsafe-best-match takes the best version across all indexes, as pip does (uv's default stops at the first
# index that has the package).
# Bytecode: neither compiles the installed .py files up front (pip: --no-compile; uv never does unless told):
# Python compiles and caches what a run imports on first import -- unless PYTHONDONTWRITEBYTECODE forbids the
# cache; then every process would compile its imports at each start, so both compile everything at install.
pkg_install_init() {
  local venv="$1"
  PY="$venv/bin/python"
  PIP=("$PY" -m pip install -q)
  if [ -z "${PYTHONDONTWRITEBYTECODE:-}" ]; then PIP+=(--no-compile); fi
  INSTALL=("${PIP[@]}")
  INSTALLER=pip
  if [ "${MEGATRON_RL_INSTALLER:-uv}" = "pip" ]; then return 0; fi
  # uv's own version is locked too (MEGATRON_RL_LOCK_FILE, set by tools/setup_env.sh; empty: the newest)
  local uv_pin=""
  if [ -n "${MEGATRON_RL_LOCK_FILE:-}" ]; then
    uv_pin="$(sed -n 's/^uv==//p' "$MEGATRON_RL_LOCK_FILE")"
  fi
  if [ ! -x "$venv/bin/uv" ] || { [ -n "$uv_pin" ] && [ "$("$venv/bin/uv" --version | cut -d' ' -f2)" != "$uv_pin" ]; }; then
    if ! "${PIP[@]}" "uv${uv_pin:+==$uv_pin}" > /dev/null 2>&1; then
      echo "note: could not pip install uv${uv_pin:+==$uv_pin} into $venv; installing with pip (slower)" >&2
      return 0
    fi
  fi
  local cfg UV_ARGS=()
  cfg="$(pip_settings_for_uv "$PY")" \
    || { echo "note: could not read pip's configuration; installing with pip (slower)" >&2; return 0; }
  eval "$cfg"
  INSTALL=("$venv/bin/uv" pip install -q --python "$PY" "${UV_ARGS[@]}")
  INSTALLER=uv
  if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then INSTALL+=(--compile-bytecode); fi
}

pip_settings_for_uv() {  # PY: shell lines that set UV_ARGS (uv pip install's options) and export the variables
  # uv reads for pip's effective settings of PY's pip
  "$1" - <<'PY'
import ast
import shlex
import subprocess
import sys

# pip's effective install options: env (PIP_*) over the [install] section over [global]
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                        check=True).stdout
rank = {"global": 0, "install": 1, ":env:": 2}
best = {}
for line in listed.splitlines():
    key, sep, value = line.partition("=")
    section, _, name = key.partition(".")
    if not sep or section not in rank:
        continue
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        continue
    if name not in best or rank[section] >= best[name][0]:
        best[name] = (rank[section], str(value))
opt = {name: value for name, (_, value) in best.items()}
truthy = lambda v: v.strip().lower() in ("1", "true", "yes", "on")
args = ["--index-strategy", "unsafe-best-match"]
for name, flag in (("index-url", "--index-url"), ("extra-index-url", "--extra-index-url"),
                   ("find-links", "--find-links"), ("constraint", "-c"), ("trusted-host", "--allow-insecure-host")):
    for item in opt.get(name, "").split():
        args += [flag, item]
if truthy(opt.get("no-index", "")):
    args.append("--no-index")
if truthy(opt.get("pre", "")):
    args += ["--prerelease", "allow"]
print("UV_ARGS=(" + " ".join(shlex.quote(a) for a in args) + ")")
for name, var in (("cert", "SSL_CERT_FILE"), ("default-timeout", "UV_HTTP_TIMEOUT"), ("proxy", "ALL_PROXY")):
    if opt.get(name):
        print(f"export {var}=${{{var}:-{shlex.quote(opt[name])}}}")
PY
}

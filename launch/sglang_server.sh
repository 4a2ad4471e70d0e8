#!/usr/bin/env bash
# Start one SGLang server (python -m sglang.launch_server) for a model; the process replaces this shell
# (exec), so the caller's pid IS the server's pid and can be stopped by it.
#
# Usage:
#   launch/sglang_server.sh --model DIR [options] [-- extra sglang.launch_server flags]
#
# GPU (tensor parallel over 8 GPUs of this node, reachable from the trainers):
#   launch/sglang_server.sh --model /ckpt/Qwen2.5-7B --host 0.0.0.0 --port 30000 --tp 8
# CPU, for development (tiny models; see megatron_rl/platform/sglang_cpu/README.md):
#   launch/sglang_server.sh --model /tmp/tiny_qwen2 --device cpu --port 30000
#
# Options (environment variable in brackets):
#   --model DIR            HF checkpoint directory (config.json, weights, tokenizer)      [SGLANG_MODEL]
#   --host H               bind address (default 127.0.0.1; 0.0.0.0 to serve other nodes) [SGLANG_HOST]
#   --port P               HTTP port (default 30000)                                     [SGLANG_PORT]
#   --device cuda|cpu      default cuda                                                  [SGLANG_DEVICE]
#   --tp N                 tensor-parallel GPUs of this server (cuda only, default 1)    [SGLANG_TP]
#   --mem-fraction F       --mem-fraction-static: weights + KV cache share of GPU memory
#                          (default 0.85 on cuda -- use ~0.4 when colocated with training -- 0.3 on cpu, where
#                          SGLang measures host memory that other processes move; the CPU KV pool is capped
#                          by --max-total-tokens 65536 instead: megatron_rl/rollout/sglang_server.py)
#                                                                                        [SGLANG_MEM_FRACTION]
#   --dtype D              default bfloat16                                              [SGLANG_DTYPE]
#   --routed-experts       return each token's routed experts (--enable-return-routed-experts; MoE models,
#                          needed by actor.routing_replay: r3; launch/slurm.sbatch adds it for r3 jobs)
#                                                                                  [SGLANG_ROUTED_EXPERTS=1]
#   --delta-loader         register megatron-rl's delta-sync loader (--custom-weight-loader; needed by
#                          rollout.weight_sync_delta; launch/slurm.sbatch adds it for such jobs; megatron_rl must
#                          be importable by the server's python)                   [SGLANG_DELTA_LOADER=1]
#   --lora-rank R          serve LoRA adapters up to rank R (--enable-lora --max-lora-rank R; on cpu also
#                          --lora-backend torch_native); needed by rollout.lora_sync: adapter (launch/slurm.sbatch
#                          adds it for such jobs)                                       [SGLANG_LORA_RANK]
#   --lora-targets LIST    --lora-target-modules, comma-separated SGLang names or 'all' (default all)
#                                                                                        [SGLANG_LORA_TARGETS]
#   --log FILE             append the server's stdout+stderr to FILE                     [SGLANG_LOG]
#   -h, --help             this help
# Environment:
#   MEGATRON_RL_SGLANG_PYTHON  interpreter that has sglang installed (default: the repository's .venv/bin/python
#                              when it exists, as launch/torchrun.sh does, else python3 on PATH)
#   DRY_RUN=1                  print the environment and command instead of running them
#
# CPU mode sets SGLANG_USE_CPU_ENGINE=1 (mandatory: without it the build imports vllm and the engine
# hangs), passes --device cpu --skip-server-warmup --sleep-on-idle (an idle CPU scheduler would otherwise
# busy-poll a core), and prepends megatron_rl/platform/sglang_cpu (import
# stand-ins for sgl_kernel and a text-only torchvision) to this server's PYTHONPATH only.
# The server runs without the launcher's rendezvous variables (torchrun's RANK/WORLD_SIZE/MASTER_*/TORCHELASTIC_*,
# Slurm's SLURM_*/PMI_*/PMIX_*: megatron_rl/parallel/child_env.py strips them and execs the server, same pid);
# with them SGLang's scheduler waits forever at "Init parallel begin".
# Readiness: poll GET http://HOST:PORT/health until it answers 200 (launch/slurm.sbatch does this).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "launch/sglang_server.sh: error: $*" >&2; exit 2; }
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")

MODEL=${SGLANG_MODEL:-}
HOST=${SGLANG_HOST:-127.0.0.1}
PORT=${SGLANG_PORT:-30000}
DEVICE=${SGLANG_DEVICE:-cuda}
TP=${SGLANG_TP:-1}
MEM_FRACTION=${SGLANG_MEM_FRACTION:-}
DTYPE=${SGLANG_DTYPE:-bfloat16}
LOG=${SGLANG_LOG:-}
ROUTED=${SGLANG_ROUTED_EXPERTS:-0}
DELTA=${SGLANG_DELTA_LOADER:-0}
LORA_RANK=${SGLANG_LORA_RANK:-}
LORA_TARGETS=${SGLANG_LORA_TARGETS:-all}
if [[ -n "${MEGATRON_RL_SGLANG_PYTHON:-}" ]]; then PY=$MEGATRON_RL_SGLANG_PYTHON
elif [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"  # tools/setup_env.sh's venv, as torchrun.sh
else PY=python3; fi
EXTRA=()

need() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --model) need "$@"; MODEL=$2; shift 2 ;;
    --host) need "$@"; HOST=$2; shift 2 ;;
    --port) need "$@"; PORT=$2; shift 2 ;;
    --device) need "$@"; DEVICE=$2; shift 2 ;;
    --tp) need "$@"; TP=$2; shift 2 ;;
    --mem-fraction) need "$@"; MEM_FRACTION=$2; shift 2 ;;
    --dtype) need "$@"; DTYPE=$2; shift 2 ;;
    --log) need "$@"; LOG=$2; shift 2 ;;
    --routed-experts) ROUTED=1; shift ;;
    --delta-loader) DELTA=1; shift ;;
    --lora-rank) need "$@"; LORA_RANK=$2; shift 2 ;;
    --lora-targets) need "$@"; LORA_TARGETS=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown option '$1' (extra sglang flags go after --; see --help)" ;;
  esac
done

[[ -n "$MODEL" ]] || die "--model DIR is required"
[[ "${DRY_RUN:-0}" == 1 || -f "$MODEL/config.json" ]] || die "--model '$MODEL' is not an HF model directory (no config.json)"
[[ "$PORT" =~ ^[0-9]+$ ]] || die "--port must be an integer, got '$PORT'"
[[ "$TP" =~ ^[0-9]+$ && "$TP" -ge 1 ]] || die "--tp must be an integer >= 1, got '$TP'"

CMD=("$PY" -m sglang.launch_server --model-path "$MODEL" --host "$HOST" --port "$PORT" --dtype "$DTYPE")
ENV=()
case "$DEVICE" in
  cuda)
    CMD+=(--tp-size "$TP" --mem-fraction-static "${MEM_FRACTION:-0.85}")
    ;;
  cpu)
    [[ "$TP" == 1 ]] || die "--tp $TP: the CPU engine runs tensor parallel size 1 only"
    CMD+=(--device cpu --skip-server-warmup --sleep-on-idle --mem-fraction-static "${MEM_FRACTION:-0.3}"
          --max-total-tokens 65536)   # a later --max-total-tokens among the extra flags wins
    ENV+=(SGLANG_USE_CPU_ENGINE=1 "PYTHONPATH=$REPO/megatron_rl/platform/sglang_cpu${PYTHONPATH:+:$PYTHONPATH}"
          "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
    ;;
  *) die "--device must be cuda or cpu, got '$DEVICE'" ;;
esac
if [[ "$ROUTED" == 1 ]]; then CMD+=(--enable-return-routed-experts); fi
# the loader of delta syncs (rollout.weight_sync_delta; megatron_rl/weight_sync/server_loader.py), imported by the
# server only when a delta sync calls it. Only on request: a custom loader turns off SGLang's fast start-up weight
# load on CUDA (model_runner_components/startup_weight_load.py)
if [[ "$DELTA" == 1 ]]; then CMD+=(--custom-weight-loader megatron_rl.weight_sync.server_loader.load_weight_delta); fi
# LoRA adapters loaded by path per version (rollout.lora_sync: adapter; megatron_rl/rollout/sglang_lora_flags.py)
if [[ -n "$LORA_RANK" ]]; then
  [[ "$LORA_RANK" =~ ^[0-9]+$ && "$LORA_RANK" -ge 1 ]] || die "--lora-rank must be an integer >= 1, got '$LORA_RANK'"
  read -r -a LORA_TARGET_LIST <<< "${LORA_TARGETS//,/ }"
  CMD+=(--enable-lora --max-lora-rank "$LORA_RANK" --lora-target-modules "${LORA_TARGET_LIST[@]}")
  if [[ "$DEVICE" == cpu ]]; then CMD+=(--lora-backend torch_native); fi
fi
CMD+=("${EXTRA[@]+"${EXTRA[@]}"}")

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  echo "${ENV[*]+${ENV[*]} }$(printf '%q ' "${CMD[@]}" | sed 's/ $//')"
  exit 0
fi
for kv in "${ENV[@]+"${ENV[@]}"}"; do export "${kv?}"; done
CLEAN=("$PY" "$REPO/megatron_rl/parallel/child_env.py" --)  # stdlib-only script: exec without launcher variables
if [[ -n "$LOG" ]]; then
  mkdir -p "$(dirname "$LOG")"
  exec "${CLEAN[@]}" "${CMD[@]}" >>"$LOG" 2>&1
fi
exec "${CLEAN[@]}" "${CMD[@]}"

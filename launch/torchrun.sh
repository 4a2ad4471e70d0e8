#!/usr/bin/env bash
# Launch megatron-rl training with torchrun on one node or many (c10d rendezvous), one log file per rank.
#
# Usage:
#   launch/torchrun.sh [options] --config PATH [key.sub=value ...]
#
# Single node (8 GPUs):
#   launch/torchrun.sh --config configs/qwen2.5_7b_1x8.yaml actor.load_hf=/ckpt/Qwen2.5-7B
# Multi-node, c10d rendezvous (run the same line on every node; node ranks are assigned by the rendezvous):
#   launch/torchrun.sh --nnodes 2 --rdzv-endpoint node01:29400 --rdzv-id job42 --config configs/qwen3_30b_a3b_2x8.yaml
# Multi-node, static ranks (give each node its rank):
#   launch/torchrun.sh --nnodes 2 --node-rank 1 --master-addr node01 --master-port 29500 --config ...
#
# Options (each also settable by the environment variable in brackets):
#   --nproc-per-node N    processes (GPUs) per node                   [NPROC_PER_NODE, default: the config's
#                                                                      cluster.gpus_per_node (overrides applied);
#                                                                      unreadable: GPUs visible, else 1]
#   --nnodes N            number of nodes                             [NNODES, default 1]
#   --node-rank R         this node's rank: static rendezvous         [NODE_RANK]
#   --master-addr A       static rendezvous host                      [MASTER_ADDR]
#   --master-port P       static rendezvous port                      [MASTER_PORT, default 29500]
#   --rdzv-endpoint H:P   c10d rendezvous endpoint                    [RDZV_ENDPOINT, default MASTER_ADDR:29400]
#   --rdzv-id ID          c10d rendezvous id (same on every node)     [RDZV_ID, default SLURM_JOB_ID or "megatron-rl"]
#   --log-dir DIR         per-rank logs: DIR[/<host> when nnodes > 1]/<run id>/attempt_0/<local rank>/{stdout,stderr}.log
#                                                                     [LOG_DIR, default logs/torchrun; logs/ is
#                                                                      git-ignored]
#   --max-restarts N      torchrun worker restarts                    [MAX_RESTARTS, default 0]
#   --resume              continue the run in trainer.run_dir from its newest complete checkpoint (also
#                         accepted after --config, among the overrides); none there: a new run at step 0
#   --resume=required     the same, but a trainer.run_dir without a complete checkpoint is refused (exit 2)
#   --config PATH         job YAML (required); everything after it is passed to megatron_rl.train as overrides
#   -h, --help            this help
# Environment:
#   OMP_NUM_THREADS       threads per rank (default 1: more oversubscribes the cores; the data loader is light)
#   PYTHON                interpreter whose torchrun is used (default: the repository's .venv/bin/python when
#                         it exists -- the one tools/setup_env.sh builds -- else python3 on PATH)
#   DRY_RUN=1             print the command instead of running it
#   CHECK=0               skip the config check before torchrun starts
#
# Mode: single node and no rendezvous flags -> `torchrun --standalone`; --node-rank given -> static
# (--master-addr/--master-port); otherwise -> c10d rendezvous at --rdzv-endpoint.
#
# Before torchrun starts, the config is validated for the job's world size (`python -m megatron_rl.train
# --check-world-size N`: values, layout, a trainer.run_dir holding another run's outputs, a reward that cannot
# import): a problem exits 2 with the message alone, in seconds.
#
# Stopping (Ctrl-C, or SIGTERM / SIGINT to this script): the request is written to a stop file the ranks read
# every half second and the signal is forwarded to them; they finish the step, checkpoint, print one line and
# exit 0 (ranks still starting: after their first step) -- and so does this script, which says in one line when
# every rank of its node has confirmed the stop. A stop before any rank has started (a multi-node rendezvous
# still waiting) ends torchrun at once and exits 128 + signal (130 for Ctrl-C): there is nothing to checkpoint.
# A second signal stops them at once (exit 128 + signal). The torchrun agent runs in its own session with
# SIGINT / SIGTERM ignored (its own handler would re-signal the ranks, SIGKILL them after 30 s and print a
# traceback); inside a Slurm step, which signals every process of the step itself, no signal is forwarded.
# A job never outlives this script: the kernel kills the agent when the script ends (kill -9, a closed
# terminal, a crash), and each rank exits when its agent or this script has ended.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "launch/torchrun.sh: error: $*" >&2; exit 2; }

NPROC_PER_NODE=${NPROC_PER_NODE:-}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-}
MASTER_ADDR=${MASTER_ADDR:-}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-megatron-rl}}
LOG_DIR=${LOG_DIR:-logs/torchrun}
MAX_RESTARTS=${MAX_RESTARTS:-0}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
CONFIG=""
OVERRIDES=()
RESUME=()

need() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --nproc-per-node) need "$@"; NPROC_PER_NODE=$2; shift 2 ;;
    --nnodes) need "$@"; NNODES=$2; shift 2 ;;
    --node-rank) need "$@"; NODE_RANK=$2; shift 2 ;;
    --master-addr) need "$@"; MASTER_ADDR=$2; shift 2 ;;
    --master-port) need "$@"; MASTER_PORT=$2; shift 2 ;;
    --rdzv-endpoint) need "$@"; RDZV_ENDPOINT=$2; shift 2 ;;
    --rdzv-id) need "$@"; RDZV_ID=$2; shift 2 ;;
    --log-dir) need "$@"; LOG_DIR=$2; shift 2 ;;
    --max-restarts) need "$@"; MAX_RESTARTS=$2; shift 2 ;;
    --resume|--resume=required) RESUME=("$1"); shift ;;
    --config) need "$@"; CONFIG=$2; shift 2; OVERRIDES=("$@"); break ;;
    *) die "unknown option '$1' (options come before --config; see --help)" ;;
  esac
done

[[ -n "$CONFIG" ]] || die "--config PATH is required (see --help)"
[[ -f "$CONFIG" ]] || die "config file '$CONFIG' does not exist"
KEPT=()
for ov in "${OVERRIDES[@]+"${OVERRIDES[@]}"}"; do
  if [[ "$ov" == --resume || "$ov" == --resume=required ]]; then RESUME=("$ov"); continue; fi
  [[ "$ov" == *=* && "$ov" != -* ]] || die "override '$ov' is not key.sub=value (or --resume)"
  KEPT+=("$ov")
done
OVERRIDES=("${KEPT[@]+"${KEPT[@]}"}")
is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }
if ! is_int "$NNODES" || (( NNODES < 1 )); then die "--nnodes must be an integer >= 1, got '$NNODES'"; fi
NPROC_FROM="--nproc-per-node / NPROC_PER_NODE"
if [[ -z "$NPROC_PER_NODE" ]]; then
  # the job the config describes: its cluster.gpus_per_node (a config it cannot read: the check below names why)
  FROM_CONFIG=$("$PYTHON" -m megatron_rl.config.cluster_ranks "$CONFIG" "${OVERRIDES[@]+"${OVERRIDES[@]}"}" \
                2>/dev/null || true)
  VISIBLE=0   # GPUs this node shows (counted once)
  if command -v nvidia-smi >/dev/null 2>&1; then
    VISIBLE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  is_int "$VISIBLE" || VISIBLE=0
  if is_int "$FROM_CONFIG" && (( FROM_CONFIG >= 1 )); then
    if (( VISIBLE > 0 && FROM_CONFIG > VISIBLE )); then
      die "cluster.gpus_per_node=$FROM_CONFIG in $CONFIG but this node shows $VISIBLE GPU(s): run on a node with" \
          "$FROM_CONFIG, or set --nproc-per-node $VISIBLE (NPROC_PER_NODE) with a layout that fits it"
    fi
    NPROC_PER_NODE=$FROM_CONFIG
    NPROC_FROM="cluster.gpus_per_node of $CONFIG"
    echo "launch/torchrun.sh: $NPROC_PER_NODE rank(s) per node: cluster.gpus_per_node of $CONFIG" \
         "(--nproc-per-node N or NPROC_PER_NODE=N to change)" >&2
  else
    NPROC_PER_NODE=$(( VISIBLE > 0 ? VISIBLE : 1 ))
    NPROC_FROM="the GPUs visible (else 1), the config's cluster.gpus_per_node being unreadable"
  fi
fi
if ! is_int "$NPROC_PER_NODE" || (( NPROC_PER_NODE < 1 )); then die "--nproc-per-node must be an integer >= 1"; fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if (( NNODES > 1 )); then LOG_DIR="$LOG_DIR/$(hostname -s)"; fi

CMD=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
     --max-restarts "$MAX_RESTARTS" --log-dir "$LOG_DIR" --tee 3)
if [[ -n "$NODE_RANK" ]]; then
  if ! is_int "$NODE_RANK" || (( NODE_RANK >= NNODES )); then die "--node-rank must be in [0, $NNODES), got '$NODE_RANK'"; fi
  [[ -n "$MASTER_ADDR" ]] || die "--node-rank needs --master-addr (static rendezvous)"
  CMD+=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
elif [[ "$NNODES" == 1 && -z "$RDZV_ENDPOINT" ]]; then
  CMD+=(--standalone)
else
  if [[ -z "$RDZV_ENDPOINT" ]]; then
    [[ -n "$MASTER_ADDR" ]] || die "multi-node needs --rdzv-endpoint HOST:PORT (or --master-addr, or --node-rank for static ranks)"
    RDZV_ENDPOINT="$MASTER_ADDR:29400"
  fi
  CMD+=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID")
fi
TRAIN_ARGS=(--config "$CONFIG" "${OVERRIDES[@]+"${OVERRIDES[@]}"}" "${RESUME[@]+"${RESUME[@]}"}")
CMD+=(-m megatron_rl.train "${TRAIN_ARGS[@]}")

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  echo "OMP_NUM_THREADS=$OMP_NUM_THREADS $(printf '%q ' "${CMD[@]}" | sed 's/ $//')"
  exit 0
fi
# config errors in seconds, the message alone, before any rank starts
if [[ "${CHECK:-1}" == 1 ]]; then
  rc=0
  PROBLEMS=$("$PYTHON" -m megatron_rl.train --check-world-size $(( NNODES * NPROC_PER_NODE )) "${TRAIN_ARGS[@]}" 2>&1) \
    || rc=$?
  PROBLEMS=$(grep -v "known, harmless library notices are hidden" <<< "$PROBLEMS" || true)
  if [[ -n "$PROBLEMS" ]]; then printf '%s\n' "$PROBLEMS" >&2; fi   # a user module's own output, on success too
  if (( rc != 0 )); then
    if grep -q "world size: " <<< "$PROBLEMS"; then
      echo "launch/torchrun.sh: checked at world size $(( NNODES * NPROC_PER_NODE )) = $NNODES node(s) x" \
         "$NPROC_PER_NODE rank(s) per node ($NPROC_FROM); set --nproc-per-node N / NPROC_PER_NODE=N and" \
         "--nnodes N / NNODES=N for another size" >&2
    fi
    exit $rc
  fi
fi
mkdir -p "$LOG_DIR"

# The launcher's link to its job (megatron_rl.lifeline): a private directory holding the stop request and the
# ranks' acknowledgements, removed at exit.
LINK=$(mktemp -d "${TMPDIR:-/tmp}/megatron-rl-launch.XXXXXX")
SLEEPER=""
trap 'rm -rf "$LINK"; [[ -z "$SLEEPER" ]] || kill "$SLEEPER" 2>/dev/null' EXIT
# torchrun in its own session with SIGINT / SIGTERM ignored (inherited through exec), killed by the kernel when
# this script ends (PR_SET_PDEATHSIG); its ranks inherit the ignored signals until their stop watcher is installed
# (a stop sent before that waits in the stop file), exit when the agent or this script ends, and take a stop from
# the signal forwarded below or from the stop file
# torchrun's --signals-to-handle (env PET_SIGNALS_TO_HANDLE; older torch reads TORCHELASTIC_SIGNALS_TO_HANDLE): by
# default the agent installs handlers for SIGINT / SIGTERM, and a handled signal is reset to default in the ranks it
# starts -- a Ctrl-C before a rank's stop watcher exists would be a KeyboardInterrupt there
( trap '' INT TERM
  export PET_SIGNALS_TO_HANDLE=SIGHUP,SIGQUIT TORCHELASTIC_SIGNALS_TO_HANDLE=SIGHUP,SIGQUIT \
         MEGATRON_RL_LAUNCHER_PID=$$ MEGATRON_RL_STOP_FILE="$LINK/stop"
  exec "$PYTHON" -m megatron_rl.lifeline --parent $$ -- "${CMD[@]}" ) < /dev/null &
AGENT=$!
STOPS=0       # signals received
SENT=0        # stop requests delivered
STOP_SIG=""   # name of the last signal received
STOP_AT=0     # when the first request was delivered (for the confirmation line)
CONFIRMED=0   # 1 once the confirmation line was printed
EARLY_STOP=0  # 128 + signal when a stop came before any rank started (the launcher's exit status)
# shellcheck disable=SC2317,SC2329  # invoked by the INT / TERM traps: note the request, the loop below delivers it
on_stop() { STOPS=$(( STOPS + 1 )); STOP_SIG=$1; }
children_of() {  # pids whose parent is $1, from /proc (no procps needed: slim containers lack `ps`)
  local stat fields
  for stat in /proc/[0-9]*/stat; do
    fields=$(< "$stat") 2>/dev/null || continue   # ended meanwhile
    fields=${fields##*) }                         # after "pid (comm) ": state ppid ...
    fields=${fields#* }
    [[ "${fields%% *}" == "$1" ]] && { stat=${stat#/proc/}; echo "${stat%/stat}"; }
  done
  return 0
}
deliver_stop() {  # the stop file first (a rank reads it even if the signal is lost), then the signal itself
  local ranks
  SENT=$STOPS
  printf '%s %s\n' "$SENT" "$(kill -l "$STOP_SIG")" > "$LINK/stop.tmp" && mv -f "$LINK/stop.tmp" "$LINK/stop"
  (( SENT == 1 )) && STOP_AT=$SECONDS
  if (( SENT > 1 )); then echo "launch/torchrun.sh: second SIG$STOP_SIG: the ranks exit now, without checkpoint" >&2; fi
  [[ -n "${SLURM_STEP_ID:-}" ]] && return 0  # Slurm signals every process of the step itself
  ranks=$(children_of "$AGENT")
  if [[ -z "$ranks" ]]; then  # no rank yet (rendezvous): nothing to checkpoint; end the agent (a rank it starts
    # meanwhile exits with it: it watches its agent), exit 128 + signal
    echo "launch/torchrun.sh: SIG$STOP_SIG before any rank started: torchrun stopped, nothing to checkpoint" >&2
    kill -KILL "$AGENT" 2>/dev/null || true
    CONFIRMED=1
    EARLY_STOP=$(( 128 + $(kill -l "$STOP_SIG") ))
    return 0
  fi
  # shellcheck disable=SC2086
  kill -s "$STOP_SIG" $ranks 2>/dev/null || true
}
confirm_stop() {  # one line once every rank of this node acknowledged, or what is missing after a while
  local acks
  acks=$(find "$LINK" -maxdepth 1 -name 'ack.*' ! -name '*.tmp' 2>/dev/null | wc -l)
  if (( acks >= NPROC_PER_NODE )); then
    echo "launch/torchrun.sh: SIG$STOP_SIG reached all $acks ranks on $(hostname -s): they checkpoint after this step and exit (a second signal stops them at once)" >&2
    CONFIRMED=1
  elif (( SECONDS - STOP_AT >= 60 )); then
    echo "launch/torchrun.sh: SIG$STOP_SIG: $acks of $NPROC_PER_NODE ranks on $(hostname -s) confirmed after 60 s (the others take it when they reach their signal handler; a second signal stops them at once)" >&2
    CONFIRMED=1
  fi
}
trap 'on_stop INT' INT
trap 'on_stop TERM' TERM
while kill -0 "$AGENT" 2>/dev/null; do
  if (( STOPS > SENT )); then deliver_stop; fi
  if (( SENT == 1 && CONFIRMED == 0 )); then confirm_stop; fi
  # shellcheck disable=SC2217  # the sleeper never reads: its stdin is /dev/null, not the launcher's terminal
  sleep 0.5 < /dev/null &
  SLEEPER=$!
  wait "$SLEEPER" 2>/dev/null || true  # returns at once when a trapped signal arrives
done
set +e
wait "$AGENT"
rc=$?
if (( EARLY_STOP )); then exit "$EARLY_STOP"; fi
exit "$rc"

#!/usr/bin/env bash
# The main job on the embedded default, from a fresh CPU machine, in one command:
#   1. set up .venv (torch==2.13.0 CPU first, then megatron-rl),
#   2. build the tiny task model + char tokenizer into runs/tiny_cpu/init_model (first run only),
#   3. train on 4 gloo ranks (TP2 x PP2) with launch/torchrun.sh and configs/tiny_cpu.yaml,
#   4. write the run report (PNG plots + report.md) into runs/tiny_cpu/report,
#   5. answer every string (held-out ones apart) greedily with the trained model: runs/tiny_cpu/results.{md,json}.
# Usage: bash tools/quickstart.sh [key.sub=value ...] [--resume]     e.g. trainer.steps=50
# A demo: each run starts over in runs/tiny_cpu (trainer.overwrite=true: the previous run's metrics,
# checkpoints and report are removed; the model in runs/tiny_cpu/init_model is kept) unless --resume
# (or trainer.resume=true) continues it, or trainer.overwrite=false is given.
# About 3 minutes of training on 2 idle cores (200 steps, ~0.9 s each: docs/results.md), plus the set-up of .venv on a
# first run. Logs per rank: runs/tiny_cpu/logs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
VENV="${MEGATRON_RL_VENV:-.venv}"
PY="$VENV/bin/python"
# the model configs/tiny_cpu.yaml loads (actor.load_hf), built once; the run's own directory follows trainer.run_dir
"$PY" -m megatron_rl.tasks runs/tiny_cpu/init_model --task copy --hidden-size 128 --num-layers 2 --seed 0
RUN_DIR=runs/tiny_cpu
export OMP_NUM_THREADS=1
START=(trainer.overwrite=true)
for a in "$@"; do
  case "$a" in
    --resume|--resume=*|trainer.resume=*|trainer.overwrite=*) START=() ;;
    trainer.run_dir=*) RUN_DIR="${a#trainer.run_dir=}" ;;
  esac
done
PYTHON="$PY" NPROC_PER_NODE=4 LOG_DIR="$RUN_DIR/logs" bash launch/torchrun.sh --config configs/tiny_cpu.yaml \
  "${START[@]+"${START[@]}"}" "$@"
"$PY" -m megatron_rl.cli report "$RUN_DIR" --out "$RUN_DIR/report"
# the held-out strings and every string of each length, answered greedily by the trained model
"$PY" tools/quickstart_results.py "$RUN_DIR" > /dev/null
echo "report: $RUN_DIR/report/report.md"
echo "greedy answers per length, held-out strings apart: $RUN_DIR/results.md"

#!/usr/bin/env bash
# The base of configs/tiny_lora_cpu.yaml: the quickstart's model (configs/tiny_cpu.yaml) trained full-parameter for
# LORA_BASE_STEPS (default 80) of its steps on 4 gloo ranks, its last checkpoint exported to HF.
# Usage: bash tools/lora_base.sh [OUT_DIR]      (default runs/tiny_lora_cpu/base_model; kept if it exists)
# Then:  launch/torchrun.sh --config configs/tiny_lora_cpu.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/tiny_lora_cpu/base_model}"
STEPS="${LORA_BASE_STEPS:-80}"
PY="${PYTHON:-${MEGATRON_RL_VENV:-.venv}/bin/python}"
if [ -f "$OUT/config.json" ]; then
  echo "lora_base: $OUT exists (kept; remove it to build another, e.g. with LORA_BASE_STEPS)"; exit 0
fi
FULL="$(dirname "$OUT")/full"
case "$FULL" in /*) ;; *) FULL="$PWD/$FULL" ;; esac   # the config's paths are relative to configs/
"$PY" -m megatron_rl.tasks runs/tiny_cpu/init_model --task copy --hidden-size 128 --num-layers 2 --seed 0
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
PYTHON="$PY" NPROC_PER_NODE=4 LOG_DIR="$FULL/logs" bash launch/torchrun.sh --config configs/tiny_cpu.yaml \
  trainer.run_dir="$FULL" trainer.steps="$STEPS" trainer.save_interval="$STEPS" trainer.overwrite=true \
  trainer.progress=false
"$PY" -c 'import sys; from megatron_rl.actor.hf_io import export_checkpoint_to_hf as e
from megatron_rl.trainer.job import latest_checkpoint as l; e(l(sys.argv[1]), sys.argv[2])' "$FULL" "$OUT"
echo "lora_base: $OUT (the quickstart's model after $STEPS full-parameter steps)"

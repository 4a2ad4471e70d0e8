#!/usr/bin/env bash
# Runs the three jobs whose metrics must not change when the trainer is refactored, into OUT_DIR:
#   sync    configs/tiny_cpu.yaml                              (TP2 x PP2, embedded engine, KL reference)
#   async   configs/tiny_cpu.yaml rollout.mode=async max_staleness=1
#   moe_r3  configs/tiny_moe_cpu.yaml                          (TP2+SP x EP2, routing replay r3)
# Usage: bash tools/step_equivalence.sh OUT_DIR [STEPS]   then   python tools/metrics_equal.py A/sync B/sync ...
# Run it once on the commit before a change and once after; every metric but timing/* and perf/* must be equal.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash tools/step_equivalence.sh OUT_DIR [STEPS]}
STEPS=${2:-12}
PY=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=1
"$PY" -m megatron_rl.tasks "$OUT/models/copy" --task copy --hidden-size 128 --num-layers 2 --seed 0 >/dev/null
"$PY" -m megatron_rl.tasks "$OUT/models/moe" --task copy --moe --seed 0 >/dev/null
run() {  # name config overrides...
  local name=$1 config=$2; shift 2
  PYTHON="$PY" NPROC_PER_NODE=4 LOG_DIR="$OUT/$name/logs" bash launch/torchrun.sh --config "$config" \
    trainer.run_dir="$OUT/$name" trainer.steps="$STEPS" trainer.overwrite=true trainer.progress=false "$@" \
    >"$OUT/$name.out" 2>&1 || { echo "step_equivalence: $name failed (see $OUT/$name.out)"; exit 1; }
  echo "step_equivalence: $name -> $OUT/$name/metrics.jsonl"
}
run sync configs/tiny_cpu.yaml actor.load_hf="$OUT/models/copy"
run async configs/tiny_cpu.yaml actor.load_hf="$OUT/models/copy" rollout.mode=async rollout.max_staleness=1
run moe_r3 configs/tiny_moe_cpu.yaml actor.load_hf="$OUT/models/moe"

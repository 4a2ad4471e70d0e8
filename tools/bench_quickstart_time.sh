#!/usr/bin/env bash
# The quickstart's wall time against its setting without dynamic sampling, in pairs on the same machine.
#
#   bash tools/bench_quickstart_time.sh [PAIRS]        (default 3 pairs; ~6 min a pair on 2 idle cores)
#
# Each pair runs, one after the other, the whole 200-step quickstart job (launch/torchrun.sh, 4 ranks, then its
# report) twice from the model tools/quickstart.sh builds:
#   A  the baseline: configs/tiny_cpu.yaml without dynamic sampling and with the length mix as the strings occur
#      (algorithm.filter_groups.enable=false data.task_kwargs.length_floor=0.0: the 32-prompt setting the
#      quickstart shipped before, one generation round per step)
#   B  configs/tiny_cpu.yaml as shipped
# and prints each run's wall time, each pair's ratio B / A and their median. Pairs run in turn (A B A B ...) so
# that a machine whose speed drifts over minutes moves both sides of a pair alike; run it with nothing else on the
# machine. The runs go to runs/bench_quickstart_time/ (overwritten). Uses the repository's .venv (tools/setup_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS="${1:-3}"
[[ "$PAIRS" =~ ^[1-9][0-9]*$ ]] || { echo "tools/bench_quickstart_time.sh: PAIRS='$PAIRS' (expected a number >= 1)" >&2; exit 2; }
PY="${MEGATRON_RL_VENV:-.venv}/bin/python"
OUT=runs/bench_quickstart_time
export OMP_NUM_THREADS=1
unset PYTHONDONTWRITEBYTECODE
"$PY" -m megatron_rl.tasks runs/tiny_cpu/init_model --task copy --hidden-size 128 --num-layers 2 --seed 0 > /dev/null
mkdir -p "$OUT"
BASELINE=(algorithm.filter_groups.enable=false data.task_kwargs.length_floor=0.0)

one() {  # one NAME [overrides...] -> prints the run's wall seconds
  local name="$1"; shift
  local start end
  start=$(date +%s.%N)
  PYTHON="$PY" NPROC_PER_NODE=4 LOG_DIR="$OUT/$name/logs" bash launch/torchrun.sh --config configs/tiny_cpu.yaml \
    trainer.overwrite=true "trainer.run_dir=$OUT/$name" trainer.progress=false "$@" > "$OUT/$name.log" 2>&1 \
    || { echo "tools/bench_quickstart_time.sh: run $name failed (log: $OUT/$name.log)" >&2; exit 1; }
  "$PY" -m megatron_rl.cli report "$OUT/$name" --out "$OUT/$name/report" > /dev/null 2>&1
  end=$(date +%s.%N)
  "$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$end"
}

RATIOS=()
for i in $(seq 1 "$PAIRS"); do
  a=$(one "A$i" "${BASELINE[@]}")
  b=$(one "B$i")
  r=$("$PY" -c "import sys; print(f'{float(sys.argv[2]) / float(sys.argv[1]):.3f}')" "$a" "$b")
  RATIOS+=("$r")
  echo "pair $i: baseline ${a} s, shipped ${b} s, ratio ${r}"
done
"$PY" -c "import statistics, sys; r = [float(x) for x in sys.argv[1:]]; \
print(f'median ratio shipped / baseline: {statistics.median(r):.3f} over {len(r)} pairs ({min(r):.3f}-{max(r):.3f})')" \
  "${RATIOS[@]}"

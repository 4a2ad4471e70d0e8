"""Async vs sync rollouts on the quickstart job, measured in one run (a benchmark, not a test).

Runs ``configs/tiny_cpu.yaml`` (TP2 x PP2 on 4 gloo ranks, embedded bf16 engine, copy task) twice with
``launch/torchrun.sh``: ``rollout.mode=sync`` and ``rollout.mode=async rollout.max_staleness=K``, same seed
and steps, then prints per mode: steps/s, the mean share of step wall time in which rank 0's producer
generated while the trainer worked (``perf/rollout_overlap_frac``), the share of lagged tokens, and the
reward curve (first- / last-quarter means and every 10th step), plus async/sync ratios.

On a 2-core CPU both sides compete for the same cores (4 trainer ranks + the producer thread), so the
measured speed-up understates what a GPU cluster gains, where the engine has its own GPUs: there the
overlap fraction is the share of step time that async hides.

Usage: python tools/bench_async.py [--steps 60] [--staleness 1] [--out runs/bench_async]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(mode_args, run_dir, model_dir, steps):
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", NPROC_PER_NODE="4",
               LOG_DIR=os.path.join(run_dir, "logs"))
    t0 = time.time()
    r = subprocess.run(["bash", os.path.join(ROOT, "launch", "torchrun.sh"), "--config",
                        os.path.join(ROOT, "configs", "tiny_cpu.yaml"), f"actor.load_hf={model_dir}",
                        f"trainer.run_dir={run_dir}", f"trainer.steps={steps}", "trainer.save_interval=0",
                        "trainer.progress=false", *mode_args], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if r.returncode != 0:
        sys.exit(f"run {mode_args} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh], wall


def summary(name, ms, wall):
    q = max(1, len(ms) // 4)
    rew = [m["reward/mean"] for m in ms]
    step_s = sum(m["timing/step_s"] for m in ms)
    out = {"steps_per_s": len(ms) / step_s, "wall_s": wall,
           "overlap": sum(m.get("perf/rollout_overlap_frac", 0.0) for m in ms) / len(ms),
           "lagged": sum(m.get("rollout_corr/lagged_token_fraction", 0.0) for m in ms) / len(ms),
           "reward_first_q": sum(rew[:q]) / q, "reward_last_q": sum(rew[-q:]) / q}
    print(f"{name:>8}: {out['steps_per_s']:.3f} steps/s (loop time), job wall {wall:.0f} s, overlap "
          f"{out['overlap']:.2f} of step time, lagged tokens {out['lagged']:.2f}, reward "
          f"{out['reward_first_q']:.3f} -> {out['reward_last_q']:.3f} (first / last quarter)")
    print(f"{'':>8}  reward every 10th step: " + " ".join(f"{r:.2f}" for r in rew[::10]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_async"))
    a = p.parse_args(argv)
    model_dir = os.path.join(a.out, "model")
    if not os.path.isdir(model_dir):
        subprocess.run([sys.executable, "-m", "megatron_rl.tasks", model_dir, "--task", "copy", "--hidden-size",
                        "128", "--num-layers", "2", "--seed", "0"], cwd=ROOT, check=True)
    sync = summary("sync", *run(["rollout.mode=sync"], os.path.join(a.out, "sync"), model_dir, a.steps))
    asy = summary(f"async k={a.staleness}",
                  *run(["rollout.mode=async", f"rollout.max_staleness={a.staleness}"], os.path.join(a.out, "async"),
                       model_dir, a.steps))
    print(f"async / sync: steps/s x{asy['steps_per_s'] / sync['steps_per_s']:.2f}, last-quarter reward "
          f"{asy['reward_last_q']:.3f} vs {sync['reward_last_q']:.3f} "
          f"(difference {asy['reward_last_q'] - sync['reward_last_q']:+.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

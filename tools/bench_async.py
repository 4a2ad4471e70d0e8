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

``--owned``: instead, the trainer's side of an async weight sync alone -- a version's buckets collected on rank 0
(``weight_sync/shm_owned.py``) at PP2 and EP2, with ``sender_transport`` shm and gloo in one run (and ``stages``: the
path of before and of NCCL jobs, ``shm_owned.collect_from_stages``), at two model sizes (``--sizes``): the fixed cost per collection and the cost per byte as a multiple of a same-run memcpy's.
``OMP_NUM_THREADS=1 python tools/bench_async.py --owned [--sizes 256,768] [--repeats 4] [--layouts pp2,ep2]``
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
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


def _owned_body(rank, world, job, transports, repeats):
    """Every rank: seconds (rank 0's wall, every thread's CPU) of collecting one version's owned buckets."""
    import torch

    from megatron_rl.actor import MegatronActor
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.plan import actor_spec
    from megatron_rl.trainer.sync_settings import weight_sync_settings
    from megatron_rl.weight_sync.publisher import bucket_payload, deferred_publisher
    from megatron_rl.weight_sync.shm_owned import collect_from_stages

    initialize_model_parallel(job.parallel, seed=0, model=job.model)
    actor = MegatronActor(actor_spec(job))
    out = {}
    for transport in transports:
        settings = dataclasses.replace(weight_sync_settings(job), sender_transport=transport)
        make = deferred_publisher(settings, actor).make
        if transport == "stages":  # before: every stage's buckets over the default group (gloo on a CPU)
            settings = weight_sync_settings(job)
            make = lambda v: bucket_payload(actor, settings, collect_from_stages, v)  # noqa: E731
        walls, cpus, nbytes = [], [], 0
        for i in range(repeats + 1):  # the first is a warm-up (segments, pair groups, the reach probe)
            torch.distributed.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            payload = make(f"step-{i + 1}")
            if i:
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            nbytes = payload.report().bytes if payload is not None else 0
            del payload
        src = torch.ones(max(nbytes, 1), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        copies = []
        for _ in range(5):
            c0, t0 = time.process_time(), time.perf_counter()
            dst.copy_(src)
            copies.append((time.perf_counter() - t0, time.process_time() - c0))
        out[transport] = {"bytes": nbytes, "wall": min(walls), "cpus": cpus, "copy": min(copies)}
    return out


def owned_main(a) -> int:
    """``--owned`` (see the module doc)."""
    from megatron_rl.config import job_config_from_dict
    from megatron_rl.convert.hf_config import model_config_from_hf
    from megatron_rl.testing.distributed import run_ranks
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    root = tempfile.mkdtemp(prefix="bench_async_owned_")
    sizes = [int(x) for x in a.sizes.split(",")]
    cases = [("dense PP2", "dense", {"pipeline_model_parallel_size": 2}, "pp2"),
             ("MoE EP2", "moe", {"expert_model_parallel_size": 2}, "ep2")]
    cases = [c for c in cases if c[3] in a.layouts.split(",")]
    points = {}
    for hidden in sizes:  # the same tensors, each larger: the fixed cost stays, the bytes grow
        shape = dict(hidden_size=hidden, num_hidden_layers=4, num_attention_heads=hidden // 64, num_key_value_heads=4,
                     vocab_size=8192)
        for label, kind, parallel, _ in cases:
            extra = (dict(intermediate_size=hidden * 11 // 4) if kind == "dense" else
                     dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden, tie_word_embeddings=False))
            hf = build_tiny_hf_model(os.path.join(root, f"{kind}{hidden}"), arch="qwen2" if kind == "dense"
                                     else "qwen3_moe", seed=0, **shape, **extra)
            with open(os.path.join(hf, "config.json")) as fh:
                model = dataclasses.asdict(model_config_from_hf(json.load(fh)))
            job = job_config_from_dict({"model": model, "actor": {"load_hf": hf, "micro_batch_size": 1},
                                        "rollout": {"mode": "async", "weight_sync": "tensor",
                                                    "weight_sync_bucket_mb": a.bucket_mb},
                                        "parallel": parallel})
            out = run_ranks(_owned_body, 2, job, ("shm", "gloo", "stages"), a.repeats, timeout=3000)
            for t, r0 in out[0].items():
                cpu = min(sum(o[t]["cpus"][i] for o in out) for i in range(a.repeats))  # both ranks' CPU seconds
                points.setdefault((label, t), []).append((r0["bytes"], r0["wall"], cpu, *r0["copy"]))
    print(f"owned-bucket collection (async rollouts), hidden {sizes[0]} and {sizes[1]}, bucket {a.bucket_mb} MiB; "
          "wall: rank 0's seconds (fastest of --repeats), cpu: both ranks' CPU seconds; per byte: the slope between "
          "the sizes as a multiple of a memcpy's")
    print(f"{'layout':10s} {'transport':>9s} {'MiB':>13s} {'wall fixed ms':>13s} {'wall x memcpy/B':>15s} "
          f"{'cpu fixed ms':>12s} {'cpu x memcpy/B':>14s}")
    for (label, t), ((b1, w1, c1, m1, k1), (b2, w2, c2, m2, k2)) in points.items():
        wall_b, cpu_b = (w2 - w1) / (b2 - b1), (c2 - c1) / (b2 - b1)
        copy_b, copy_cpu_b = min(m1 / b1, m2 / b2), max(min(k1 / b1, k2 / b2), 1e-12)
        print(f"{label:10s} {t:>9s} {b1 / 2**20:6.1f}/{b2 / 2**20:6.1f} {(w1 - wall_b * b1) * 1e3:13.1f} "
              f"{wall_b / copy_b:15.2f} {(c1 - cpu_b * b1) * 1e3:12.1f} {cpu_b / copy_cpu_b:14.2f}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_async"))
    p.add_argument("--owned", action="store_true", help="the owned-bucket collection alone, shm vs gloo")
    p.add_argument("--sizes", default="256,768", help="--owned: the two model sizes (hidden) of the linear fit")
    p.add_argument("--layouts", default="pp2,ep2", help="--owned: a comma list of pp2,ep2")
    p.add_argument("--repeats", type=int, default=4, help="--owned: timed collections per transport")
    p.add_argument("--bucket-mb", type=float, default=16.0, help="--owned: rollout.weight_sync_bucket_mb")
    a = p.parse_args(argv)
    if a.owned:
        return owned_main(a)
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

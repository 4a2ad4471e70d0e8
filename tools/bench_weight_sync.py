"""Benchmark the trainer -> engine weight sync per mode (``rollout.weight_sync``), disk vs in memory, in one run.

    OMP_NUM_THREADS=1 python tools/bench_weight_sync.py [--hidden 1024] [--layers 6] [--vocab 16384] [--tp 2]
        [--bucket-mb 64] [--sglang]

A random-weight Qwen2 of a real shape (hidden / layers / vocab; fp32 in the trainer, ~400 MB at the
defaults) on ``--tp`` gloo ranks syncs into the embedded engine (bf16) by disk (HF export + reload) and by
tensor (buckets in process), and with ``--sglang`` into a CPU SGLang server by disk, distributed (gloo) and
tensor. Per mode: seconds of the sync (median of ``--repeats``, verification included), bytes moved, buckets,
and the peak extra host memory of the sync on each trainer rank (the kernel's VmHWM, reset before the sync;
large allocations forced to mmap so freed buckets leave RSS).
"""
import argparse
import ctypes
import dataclasses
import json
import os
import re
import statistics
import tempfile
import time

import torch


def _rss_kb(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


def _body(rank, world, job, modes, url, repeats):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.weight_sync.publisher import build_weight_publisher

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    initialize_model_parallel(job.parallel, seed=0, model=job.model)
    actor = MegatronActor(job)
    out = {}
    for engine_kind, mode in modes:
        rc = dataclasses.replace(job.rollout, engine=engine_kind, weight_sync=mode,
                                 sglang_urls=[url] if url else [], weight_sync_dir=tempfile.mkdtemp())
        cfg = dataclasses.replace(job, rollout=rc)
        engine = None
        if rank == 0:
            engine = (EmbeddedEngine(job.actor.load_hf, dtype="bfloat16") if engine_kind == "embedded"
                      else SGLangEngine(url, weight_sync_timeout=600))
        times, peaks, m = [], [], {}
        for i in range(repeats + 1):  # the first is a warm-up
            torch.distributed.barrier()
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            base = _rss_kb("VmRSS")
            t0 = time.perf_counter()
            m = build_weight_publisher(cfg, actor, engine).publish(f"step-{i + 1}")
            if i:
                times.append(time.perf_counter() - t0)
                peaks.append((_rss_kb("VmHWM") - base) * 1024)
        if engine is not None:
            engine.close()
        out[f"{engine_kind}/{mode}"] = {"s": statistics.median(times), "peak": max(peaks), **m}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sglang", action="store_true", help="also a CPU SGLang server: disk / distributed / tensor")
    a = p.parse_args(argv)
    from megatron_rl.config import job_config_from_dict
    from megatron_rl.convert.hf_config import model_config_from_hf
    from megatron_rl.rollout.sglang_server import find_free_port, launch_sglang_server
    from megatron_rl.testing.distributed import run_ranks
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    root = tempfile.mkdtemp(prefix="bench_ws_")
    hf = build_tiny_hf_model(os.path.join(root, "model"), arch="qwen2", seed=0, hidden_size=a.hidden,
                             intermediate_size=a.hidden * 11 // 4, num_hidden_layers=a.layers,
                             num_attention_heads=a.hidden // 64, num_key_value_heads=4,
                             vocab_size=a.vocab)
    with open(os.path.join(hf, "config.json")) as fh:
        model = dataclasses.asdict(model_config_from_hf(json.load(fh)))
    job = job_config_from_dict({"model": model, "actor": {"load_hf": hf, "micro_batch_size": 1},
                                "rollout": {"weight_sync_bucket_mb": a.bucket_mb},
                                "parallel": {"tensor_model_parallel_size": a.tp}})
    fp32_mb = os.path.getsize(os.path.join(hf, "model.safetensors")) / 2**20
    print(f"model: qwen2 hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}: {fp32_mb:.0f} MiB fp32 "
          f"(trainer, TP{a.tp}), engine bf16; bucket {a.bucket_mb} MiB")
    modes = [("embedded", "disk"), ("embedded", "tensor")]
    server = None
    try:
        if a.sglang:
            server = launch_sglang_server(hf, port=find_free_port(), device="cpu", max_total_tokens=1024,
                                          ready_timeout=600)
            modes += [("sglang", "disk"), ("sglang", "distributed"), ("sglang", "tensor")]
        out = run_ranks(_body, a.tp, job, modes, server.url if server else None, a.repeats, timeout=3000)
    finally:
        if server is not None:
            server.terminate()
    print(f"{'engine/mode':22s} {'sync s':>8s} {'MiB moved':>10s} {'buckets':>8s} {'verified':>8s} "
          + " ".join(f"{'peak MiB r' + str(r):>12s}" for r in range(a.tp)))
    for key in out[0]:
        r0 = out[0][key]
        print(f"{key:22s} {r0['s']:8.2f} {r0['weight_sync/bytes'] / 2**20:10.1f} {r0['weight_sync/buckets']:8.0f} "
              f"{r0['weight_sync/verified']:8.0f} " + " ".join(f"{o[key]['peak'] / 2**20:12.1f}" for o in out))


if __name__ == "__main__":
    main()

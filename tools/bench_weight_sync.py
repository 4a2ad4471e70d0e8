"""Benchmark the trainer -> engine weight sync: the fixed and per-byte cost of a sync (``--senders``), the modes.

    OMP_NUM_THREADS=1 python tools/bench_weight_sync.py --senders [--sglang] [--experts 8] [--sizes 256,768]
        [--verify-interval 1] [--layers 6] [--vocab 16384] [--repeats 2] [--layouts pp2,ep2] [--transports shm,gloo]
    OMP_NUM_THREADS=1 python tools/bench_weight_sync.py [--hidden 1024] [--layers 6] [--vocab 16384] [--tp 2]
        [--bucket-mb 64] [--sglang] [--delta-lrs 1e-6,1e-4]

``--senders``: every layout runs at two model sizes (``--sizes``: hidden; the same tensors, each larger) and the line
through the two points gives the fixed cost of a sync (intercept) and its cost per byte (slope) vs a memcpy's (a host ``copy_`` of
the sync's bytes on rank 0 after each sync, under the same load): for rank 0's wall time and for the CPU seconds of
every rank together (what the sync costs the machine, not the time it waited for a CPU: the figure to read on a
shared machine); each point is the fastest of ``--repeats`` syncs. Layouts: a dense Qwen2 on 1 rank, at TP2 (one
sender) and PP2 (two senders); a Qwen3-MoE at DP2 (one sender) and EP2 (two senders); in memory (embedded engine:
tensor; ``--sglang``: distributed into a CPU server). ``--verify-interval 0`` leaves verification out.

The mode comparison: a Qwen2 (fp32 trainer) on ``--tp`` gloo ranks syncs into the embedded engine (bf16) by disk
and tensor (``--sglang``: a CPU SGLang server by disk, distributed and tensor): seconds, bytes, buckets, peak extra
host memory per rank. ``--delta-lrs``: full vs delta sync after real train steps at each learning rate, each
against a same-run memcpy of its bytes. Measured numbers: docs/weight_sync.md.
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
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.trainer.sync_settings import weight_sync_settings
    from megatron_rl.weight_sync.publisher import build_weight_publisher

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    initialize_model_parallel(job.parallel, seed=0, model=job.model)
    actor = MegatronActor(actor_spec(job))
    out = {}
    for engine_kind, mode, *transport in modes:
        rc = dataclasses.replace(job.rollout, engine=engine_kind, weight_sync=mode,
                                 sglang_urls=[url] if url else [], weight_sync_dir=tempfile.mkdtemp())
        cfg = dataclasses.replace(job, rollout=rc)
        settings = weight_sync_settings(cfg)
        if transport:  # --transports: forced (the job's own choice otherwise); flat: all_gather_into_tensor for TP
            settings = dataclasses.replace(settings, sender_transport="gloo" if transport[0] == "gloo" else "shm",
                                           tp_gather=transport[0])
        engine = None
        if rank == 0:
            engine = (EmbeddedEngine(job.actor.load_hf, dtype="bfloat16") if engine_kind == "embedded"
                      else SGLangEngine(url, weight_sync_timeout=600))
        times, cpus, peaks, copies, m = [], [], [], [], {}
        for i in range(repeats + 1):  # the first is a warm-up
            torch.distributed.barrier()
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            base = _rss_kb("VmRSS")
            c0 = time.process_time()
            t0 = time.perf_counter()
            m = build_weight_publisher(settings, actor, engine).publish(f"step-{i + 1}")
            if i:
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)  # every thread of this rank, not the time it waited for a CPU
                peaks.append((_rss_kb("VmHWM") - base) * 1024)
                copies.append(_memcpy_s(m["weight_sync/bytes"], 1, cpu=True))  # the floor, under the same load
        if engine is not None:
            engine.close()
        out["/".join([engine_kind, mode, *transport])] = {"s": statistics.median(times), "min_s": min(times), "peak": max(peaks),
                                        "cpus": cpus, "copy_s": min(c for c, _ in copies),
                                        "copy_cpu": min(c for _, c in copies), **m}
    return out


def _memcpy_s(nbytes, repeats=5, cpu=False):
    """Seconds of one host copy of ``nbytes`` bytes (median), the floor of moving them in process; ``cpu``: the
    fastest copy's (wall seconds, CPU seconds)."""
    src = torch.empty(max(int(nbytes), 1), dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)  # its pages touched: the copy alone is timed
    times = []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        dst.copy_(src)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    if cpu:
        return min(times)
    return statistics.median(t for t, _ in times)


def _delta_body(rank, world, job, lrs, repeats):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.testing.actor_reference import policy_data
    from megatron_rl.trainer.sync_settings import weight_sync_settings
    from megatron_rl.weight_sync.publisher import build_weight_publisher

    initialize_model_parallel(job.parallel, seed=0, model=job.model)
    out = {}
    for lr in lrs:
        cfg = dataclasses.replace(job, actor=dataclasses.replace(job.actor, lr=lr))
        actor = MegatronActor(actor_spec(cfg))
        batch, old, adv, mask, _ = policy_data(cfg.model.vocab_size, 4, 0, (4, 9), (8, 17), False)
        rows = []
        for delta in (False, True):
            rc = dataclasses.replace(cfg.rollout, engine="embedded", weight_sync="tensor", weight_sync_delta=delta)
            engine = EmbeddedEngine(cfg.actor.load_hf, dtype="bfloat16") if rank == 0 else None
            rows.append((build_weight_publisher(weight_sync_settings(dataclasses.replace(cfg, rollout=rc)), actor,
                                                engine), engine))
        for pub, _ in rows:
            pub.publish("step-0")  # the first version: full for both
        got = {"full": [], "delta": []}
        for i in range(1, repeats + 1):
            actor.train_step(batch, old, adv, mask, None, 1.0)
            for key, (pub, _) in zip(("full", "delta"), rows):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                m = pub.publish(f"step-{i}")
                got[key].append((time.perf_counter() - t0, m))
        res = {}
        for key, runs in got.items():
            m = runs[-1][1]
            nbytes = m["weight_sync/bytes_sent"]
            res[key] = {"s": statistics.median(t for t, _ in runs), "bytes": nbytes,
                        "changed": m.get("weight_sync/changed_frac", 1.0), "floor": _memcpy_s(nbytes)}
        out[lr] = res
        for _, engine in rows:
            if engine is not None:
                engine.close()
        del actor, rows
    return out


def _print_delta(out):
    print(f"{'lr':>8s} {'sync':6s} {'sync s':>8s} {'MiB sent':>9s} {'changed':>8s} {'memcpy s':>9s} {'x floor':>8s}")
    for lr, res in out.items():
        for key, r in res.items():
            print(f"{lr:8.0e} {key:6s} {r['s']:8.3f} {r['bytes'] / 2**20:9.2f} {r['changed']:8.2%} "
                  f"{r['floor']:9.4f} {r['s'] / max(r['floor'], 1e-9):8.0f}")
        print(f"{'':8s} delta / full: {res['delta']['bytes'] / res['full']['bytes']:.1%} of the bytes, "
              f"{res['delta']['s'] / res['full']['s']:.2f}x the time")


def _job(hf, parallel: dict, bucket_mb: float, verify_interval: int = 1):
    from megatron_rl.config import job_config_from_dict
    from megatron_rl.convert.hf_config import model_config_from_hf

    with open(os.path.join(hf, "config.json")) as fh:
        model = dataclasses.asdict(model_config_from_hf(json.load(fh)))
    return job_config_from_dict({"model": model, "actor": {"load_hf": hf, "micro_batch_size": 1},
                                 "rollout": {"weight_sync_bucket_mb": bucket_mb,
                                             "weight_sync_verify_interval": verify_interval},
                                 "parallel": parallel})


def senders_main(a) -> None:
    """Fixed cost and cost per byte of each layout (see the module doc)."""
    from megatron_rl.rollout.sglang_server import find_free_port, launch_sglang_server
    from megatron_rl.testing.distributed import run_ranks
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    root = tempfile.mkdtemp(prefix="bench_ws_senders_")
    load0 = os.getloadavg()
    sizes = [int(x) for x in a.sizes.split(",")]
    if len(sizes) != 2 or sizes[0] >= sizes[1] or any(h % 256 for h in sizes):
        raise SystemExit(f"--sizes {a.sizes!r}: two hidden sizes (multiples of 256), the smaller first")
    cases = [("dense 1 rank (1 sender)", "dense", 1, {}, "1"),
             ("dense TP2 (1 sender)", "dense", 2, {"tensor_model_parallel_size": 2}, "tp2"),
             ("dense PP2 (2 senders)", "dense", 2, {"pipeline_model_parallel_size": 2}, "pp2"),
             ("MoE DP2 (1 sender)", "moe", 2, {}, "dp2"),
             ("MoE EP2 (2 senders)", "moe", 2, {"expert_model_parallel_size": 2}, "ep2")]
    if a.layouts:
        cases = [c for c in cases if c[4] in a.layouts.split(",")]
    points = {}  # (label, key) -> [(bytes, seconds, senders, key)] per size
    transports = [[t] for t in a.transports.split(",")] if a.transports else [[]]
    for hidden in sizes:  # the same tensors, each larger: the fixed cost stays fixed, the bytes grow
        shape = dict(hidden_size=hidden, num_hidden_layers=a.layers, num_attention_heads=hidden // 64,
                     num_key_value_heads=4, vocab_size=a.vocab)
        models = {"dense": build_tiny_hf_model(os.path.join(root, f"dense{hidden}"), arch="qwen2", seed=0,
                                               intermediate_size=hidden * 11 // 4, **shape),
                  "moe": build_tiny_hf_model(os.path.join(root, f"moe{hidden}"), arch="qwen3_moe", seed=0,
                                             num_experts=a.experts, num_experts_per_tok=2,
                                             moe_intermediate_size=hidden, tie_word_embeddings=False, **shape)}
        for label, kind, world, parallel, _ in cases:
            server = None
            try:
                if a.sglang:
                    server = launch_sglang_server(models[kind], port=find_free_port(), device="cpu",
                                                  max_total_tokens=1024, ready_timeout=600)
                modes = [("sglang", "distributed")] if a.sglang else [("embedded", "tensor", *t) for t in transports]
                job = _job(models[kind], parallel, a.bucket_mb, a.verify_interval)
                out = run_ranks(_body, world, job, modes, server.url if server else None, a.repeats, timeout=3000)
            finally:
                if server is not None:
                    server.terminate()
            for key, r0 in out[0].items():
                cpu = min(sum(o[key]["cpus"][i] for o in out) for i in range(a.repeats))  # all ranks' CPU seconds
                points.setdefault((label, key), []).append((r0["weight_sync/bytes"], r0["min_s"], r0["weight_sync/senders"],
                                                     key, r0["copy_s"], cpu, r0["copy_cpu"]))
    load1 = os.getloadavg()
    print(f"load average (1 / 5 / 15 min) at the start {load0[0]:.2f} / {load0[1]:.2f} / {load0[2]:.2f}, at the end "
          f"{load1[0]:.2f} / {load1[1]:.2f} / {load1[2]:.2f} (this host has {os.cpu_count()} CPUs: above ~1, read the cpu "
          f"columns)")
    print(f"verification: {'every version' if a.verify_interval == 1 else 'off' if a.verify_interval == 0 else f'every {a.verify_interval}th version'}; hidden {sizes[0]} and {sizes[1]}, {a.layers} layers, vocab {a.vocab}")
    print("wall: rank 0's seconds per sync (fastest of --repeats); cpu: the CPU seconds of every rank together "
          "(fastest); per byte: the slope between the two sizes, as a multiple of a memcpy's")
    print(f"{'layout':24s} {'transport':>9s} {'senders':>7s} {'MiB':>13s} {'wall s':>15s} {'fixed ms':>8s} {'x memcpy/B':>10s} "
          f"{'cpu s':>15s} {'fixed ms':>8s} {'x memcpy/B':>10s} {'x floor':>13s}")
    for (label, key), pts in points.items():
        (b1, t1, n, key, m1, c1, k1), (b2, t2, _, _, m2, c2, k2) = pts
        wall_b, cpu_b = (t2 - t1) / (b2 - b1), (c2 - c1) / (b2 - b1)
        copy_b, copy_cpu_b = min(m1 / b1, m2 / b2), min(k1 / b1, k2 / b2)  # a memcpy has no fixed cost to speak of
        print(f"{label:24s} {key.split('/')[2] if key.count('/') == 2 else 'job':>9s} {n:7.0f} {b1 / 2**20:6.1f}/{b2 / 2**20:6.1f} {t1:7.3f}/{t2:7.3f} "
              f"{(t1 - wall_b * b1) * 1e3:8.1f} {wall_b / copy_b:10.2f} {c1:7.3f}/{c2:7.3f} "
              f"{(c1 - cpu_b * b1) * 1e3:8.1f} {cpu_b / copy_cpu_b:10.2f} {t1 / m1:6.1f}/{t2 / m2:6.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sglang", action="store_true", help="also a CPU SGLang server: disk / distributed / tensor")
    p.add_argument("--delta-lrs", default="", help="comma list of learning rates: full vs delta sync after train "
                   "steps at each (instead of the mode comparison)")
    p.add_argument("--senders", action="store_true", help="one sender vs several (TP2 vs PP2, DP2 vs EP2)")
    p.add_argument("--experts", type=int, default=8, help="--senders: routed experts of the MoE model")
    p.add_argument("--sizes", default="256,768", help="--senders: the two model sizes (hidden) of the linear fit")
    p.add_argument("--layouts", default="", help="--senders: a comma list of 1,tp2,pp2,dp2,ep2 (default: all)")
    p.add_argument("--transports", default="", help="--senders: a comma list of shm,gloo,flat to compare in one run "
                   "(the sender transport and TP gather; flat: shm senders, all_gather_into_tensor; default: the job's)")
    p.add_argument("--verify-interval", type=int, default=1, help="--senders: rollout.weight_sync_verify_interval "
                   "(0: no verification)")
    a = p.parse_args(argv)
    if a.senders:
        return senders_main(a)
    from megatron_rl.rollout.sglang_server import find_free_port, launch_sglang_server
    from megatron_rl.testing.distributed import run_ranks
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    root = tempfile.mkdtemp(prefix="bench_ws_")
    hf = build_tiny_hf_model(os.path.join(root, "model"), arch="qwen2", seed=0, hidden_size=a.hidden,
                             intermediate_size=a.hidden * 11 // 4, num_hidden_layers=a.layers,
                             num_attention_heads=a.hidden // 64, num_key_value_heads=4,
                             vocab_size=a.vocab)
    job = _job(hf, {"tensor_model_parallel_size": a.tp}, a.bucket_mb)
    fp32_mb = os.path.getsize(os.path.join(hf, "model.safetensors")) / 2**20
    print(f"model: qwen2 hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}: {fp32_mb:.0f} MiB fp32 "
          f"(trainer, TP{a.tp}), engine bf16; bucket {a.bucket_mb} MiB")
    if a.delta_lrs:
        lrs = [float(x) for x in a.delta_lrs.split(",")]
        _print_delta(run_ranks(_delta_body, a.tp, job, lrs, a.repeats, timeout=3000)[0])
        return
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

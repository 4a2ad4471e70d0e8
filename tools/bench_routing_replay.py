"""Benchmark MoE routing replay on a tiny Qwen3-MoE (CPU, 1 gloo rank): bytes per token of the captured
routing and the time replay adds to the log-prob (recompute) pass and to a train step.

    OMP_NUM_THREADS=1 python tools/bench_routing_replay.py [--layers 4] [--experts 8] [--topk 2] [--rows 32]

Prints one line per mode (none / r3 / r2): median seconds of compute_log_probs and train_step over
``--repeats`` runs on the same batch (routing captured -> the none mode still records for the agreement
metric), plus the transport size (uint8 when experts <= 256, else int16).
"""
import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    from megatron_rl.actor import MegatronActor, RolloutBatch
    from megatron_rl.plan import actor_spec
    from megatron_rl.actor.routing import routing_bytes_per_token
    from megatron_rl.config import job_config_from_dict
    from megatron_rl.convert.hf_config import model_config_from_hf
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.testing.distributed import run_ranks
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    tmp = tempfile.mkdtemp(prefix="bench_rr_")
    hf = build_tiny_hf_model(os.path.join(tmp, "moe"), arch="qwen3_moe", seed=0, num_hidden_layers=a.layers,
                             num_experts=a.experts, num_experts_per_tok=a.topk)
    with open(os.path.join(hf, "config.json")) as fh:
        m = dataclasses.asdict(model_config_from_hf(json.load(fh)))
    m.update(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (8,), generator=g).tolist() for _ in range(a.rows)]
    responses = [torch.randint(3, 300, (a.length - 8,), generator=g).tolist() for _ in range(a.rows)]
    routing = [torch.rand(a.length, a.layers, a.experts, generator=g).argsort(-1)[..., :a.topk].to(torch.uint8)
               for _ in range(a.rows)]
    batch = RolloutBatch.from_sequences(prompts, responses, [[-1.0] * len(r) for r in responses], routing=routing)
    W = batch.max_length - 1

    def body(rank, world):
        out = {}
        for mode in ("none", "r3", "r2"):
            job = job_config_from_dict({"model": m, "actor": {"load_hf": hf, "micro_batch_size": 8, "lr": 1e-6,
                                                              "routing_replay": mode}})
            initialize_model_parallel(job.parallel, seed=0, model=job.model)
            actor = MegatronActor(actor_spec(job))
            lp_t, tr_t = [], []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                old, _ = actor.compute_log_probs(batch, 1.0, compute_entropy=False)
                lp_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                actor.train_step(batch, old, torch.ones(batch.num_rows), batch.response_mask, None, 1.0)
                tr_t.append(time.perf_counter() - t0)
            out[mode] = (statistics.median(lp_t), statistics.median(tr_t))
        return out

    res = run_ranks(body, 1, timeout=1200)[0]
    bpt = routing_bytes_per_token(a.experts, a.layers, a.topk)
    print(f"tiny Qwen3-MoE: {a.layers} layers, {a.experts} experts, top-{a.topk}; batch {a.rows} x {a.length} tokens "
          f"({batch.num_rows * W} routed positions)")
    print(f"routing transport: {bpt} bytes/token ({batch.routing.dtype}); batch {batch.routing.numel() * batch.routing.element_size()} bytes")
    base = res["none"]
    for mode, (lp, tr) in res.items():
        print(f"{mode:>4}: log-prob pass {lp * 1e3:8.1f} ms ({(lp / base[0] - 1) * 100:+5.1f} %)   train step "
              f"{tr * 1e3:8.1f} ms ({(tr / base[1] - 1) * 100:+5.1f} %)")


if __name__ == "__main__":
    main()

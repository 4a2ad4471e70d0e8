"""Benchmark LoRA against full fine-tuning on one model, ratios in one run: bytes per weight sync (adapter-only vs
merged vs the full model's; merged with delta sync after a train step), train-step time and the trainer's memory.

    OMP_NUM_THREADS=1 python tools/bench_lora.py [--hidden 512] [--layers 4] [--vocab 8192] [--rank 16]
        [--rows 8] [--seq 256] [--repeats 3] [--device cpu|cuda] [--json out.json]

Each variant (full, LoRA with ``all-linear``) runs in its own process on one rank: a Qwen2 built by
``convert.tiny_hf`` at the given size is the base, the embedded engine (bf16) receives the syncs through the
real publishers (``weight_sync.publisher``), and a GRPO train step on random rollouts is timed (median of
``--repeats`` after a warm-up). Memory: on CUDA the peak allocated during the steps; on CPU the bytes the
optimizer holds for training (gradient buffers + main parameters + Adam moments), counted from its tensors.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

import torch


def _optimizer_bytes(actor) -> int:
    """Gradient buffers + the optimizer's state tensors (main parameters, moments) of ``actor``."""
    total = 0
    for m in actor.model:
        for buf in getattr(m, "buffers", []) or []:
            total += buf.grad_data.numel() * buf.grad_data.element_size()
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            total += sum(p.numel() * p.element_size() for p in group)
    return total


def _variant(rank, world, hf_dir, lora, args):
    from megatron_rl.actor import MegatronActor, RolloutBatch
    from megatron_rl.config import job_config_from_dict
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.plan import actor_spec
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.testing.actor_reference import hf_model_section
    from megatron_rl.weight_sync.publisher import build_weight_publisher
    from megatron_rl.weight_sync.settings import WeightSyncSettings

    section = {"rank": args.rank, "alpha": 2 * args.rank, "target_modules": ["all-linear"]} if lora else {}
    job = job_config_from_dict({"model": hf_model_section(hf_dir), "actor": {
        "load_hf": hf_dir, "lora": section, "micro_batch_size": args.rows, "lr": 1e-4, "bf16": args.device == "cuda"}})
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    g = torch.Generator().manual_seed(0)
    p = args.seq // 4
    prompts = [torch.randint(0, args.vocab, (p,), generator=g).tolist() for _ in range(args.rows)]
    responses = [torch.randint(0, args.vocab, (args.seq - p,), generator=g).tolist() for _ in range(args.rows)]
    lps = [(-torch.rand(args.seq - p, generator=g) * 3 - 0.1).tolist() for _ in range(args.rows)]
    batch = RolloutBatch.from_sequences(prompts, responses, lps)
    adv = torch.randn(args.rows, generator=g)
    old, _ = actor.compute_log_probs(batch, 1.0, compute_entropy=False)

    def step():
        actor.train_step(batch, old, adv, batch.response_mask, None, 1.0)
        if args.device == "cuda":
            torch.cuda.synchronize()

    step()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    out = {"step_s": statistics.median(times),
           "memory_bytes": (torch.cuda.max_memory_allocated() if args.device == "cuda" else _optimizer_bytes(actor)),
           "trainable_params": sum(p.numel() for m in actor.model for p in m.parameters() if p.requires_grad)}
    modes = (("adapter", "adapter", False), ("merged", "merged", False), ("merged_delta", "merged", True)) \
        if lora else (("full", "merged", False), ("full_delta", "merged", True))
    for name, sync, delta in modes:
        r = dataclasses.replace(job.rollout, lora_sync=sync, weight_sync="tensor", weight_sync_delta=delta,
                                weight_sync_verify_interval=0)
        settings = WeightSyncSettings.build(r, tempfile.mkdtemp(), EmbeddedEngine, job.actor.lora)
        engine = EmbeddedEngine(hf_dir, dtype="bfloat16")
        pub = build_weight_publisher(settings, actor, engine)
        pub.publish("step-1")
        if delta:  # the second sync, after a train step, sends what changed
            step()
            out[name] = pub.publish("step-2")["weight_sync/bytes"]
        else:
            out[name] = pub.publish("step-2")["weight_sync/bytes"]
    return out


def main(argv=None) -> dict:
    import megatron.core  # noqa: F401  (imported once: the forked variants start fast)
    from megatron_rl.convert.tiny_hf import build_tiny_hf_model
    from megatron_rl.testing.distributed import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    hf_dir = build_tiny_hf_model(tempfile.mkdtemp(), arch="qwen2", seed=0, vocab_size=args.vocab,
                                 hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                                 num_hidden_layers=args.layers, num_attention_heads=max(2, args.hidden // 64),
                                 num_key_value_heads=max(1, args.hidden // 256))
    [full] = run_ranks(_variant, 1, str(hf_dir), False, args, timeout=3600)
    [lora] = run_ranks(_variant, 1, str(hf_dir), True, args, timeout=3600)
    res = {"full": full, "lora": lora, "ratios": {
        "sync_bytes adapter / merged": lora["adapter"] / lora["merged"],
        "sync_bytes adapter / full": lora["adapter"] / full["full"],
        "sync_bytes merged / full": lora["merged"] / full["full"],
        "sync_bytes merged+delta / full+delta": lora["merged_delta"] / max(full["full_delta"], 1),
        "step_time lora / full": lora["step_s"] / full["step_s"],
        f"memory lora / full ({'peak allocated' if args.device == 'cuda' else 'grads + optimizer state'})":
            lora["memory_bytes"] / full["memory_bytes"]}}
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return res


if __name__ == "__main__":
    main()

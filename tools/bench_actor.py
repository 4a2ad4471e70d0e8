"""Benchmark the actor's log-prob pass and train step, fp32 vs bf16 (``actor.bf16``) side by side in one run.

What: a random Qwen-style dense model built by ``MegatronActor`` (no checkpoint) on ONE rank (NCCL on CUDA, gloo on
CPU), one seeded batch of ``--rows`` rows x ``--seq`` tokens (prompt = the first quarter of each row), and for each
precision in ``--precisions`` (each in turn, the previous actor freed first):
  logprob  ``actor.compute_log_probs`` (forward only, log-probs + entropy in fp32 from the logits);
  train    ``actor.train_step`` (forward, backward, fp32 gradient reduction, Adam step; PPO-clip loss).
One warm-up each (the first train step allocates Adam's state), then the median of ``--repeats``.
Every train step trains on the same batch against the same old log-probs (PPO-clip, no IS weights): the first
step's ratios are 1, later steps see the ratios the earlier updates moved, and once every token's ratio is clipped
on its advantage's side the gradient is exactly 0 (a large model at lr 1e-5 gets there within the 4 steps). The
check line therefore reports the FIRST step's grad norm / pg_loss / clip fraction (the run fails when that grad
norm is not > 0) and the later steps' grad norms and clip fractions beside them.

Reported per precision and pass: seconds, tokens/s, peak memory (CUDA: ``torch.cuda.max_memory_allocated`` over
the pass, everything resident included: weights, main weights, gradients, Adam state, activations; CPU: the
process's peak RSS so far, ``ru_maxrss``, a bound only) and on CUDA the model FLOPs utilisation: model FLOPs
(matmul parameters incl. the output layer: 2 per parameter per token forward, causal attention scores and
values: 2 x seq x attention width per layer per token; train = 3 x forward, the recompute-free count) over the
seconds, divided by the bf16 matmul rate measured in the same run (``torch.mm`` of two 8192 x 8192 bf16 matrices,
median of 10, after a warm-up). The fp32 matmul rate (TF32 as torch has it configured) is printed beside it.

Defaults: CUDA: hidden 2048, 16 layers, 16 heads (8 KV groups, head dim 128), FFN 6144, vocab 151936 (Qwen's),
untied output layer, 4 rows x 1024 tokens = 4096 tokens, one micro-batch; CPU (``--device cpu``, or no GPU): a
tiny shape (hidden 64, 2 layers, vocab 512, 2 x 64 tokens) so the tool runs in the test suite.

Usage (from the repository root):
  python tools/bench_actor.py                           # CUDA if available, both precisions
  OMP_NUM_THREADS=1 python tools/bench_actor.py --device cpu --json out.json
  python tools/bench_actor.py --hidden 4096 --layers 8 --rows 2 --seq 2048 --precisions bf16
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import socket
import statistics
import time
from typing import Dict, List

import torch

CUDA_SHAPE = dict(hidden=2048, layers=16, heads=16, kv_heads=8, head_dim=128, ffn=6144, vocab=151936, rows=4,
                  seq=1024)
CPU_SHAPE = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=512, rows=2, seq=64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_rate(dtype: torch.dtype, n: int = 8192, repeats: int = 10) -> float:
    """Measured FLOP/s of ``torch.mm`` of two n x n ``dtype`` matrices on the current CUDA device (median)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, b)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del a, b
    return 2.0 * n ** 3 / statistics.median(times)


def matmul_params(s: Dict[str, int]) -> int:
    """Weights used in matmuls per token: QKV, output projection, gated MLP (3 matrices), output layer."""
    h, att, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    return s["layers"] * (h * (att + 2 * kv) + att * h + 3 * h * s["ffn"]) + h * s["vocab"]


def model_flops_per_token(s: Dict[str, int]) -> float:
    """Forward FLOPs per token: 2 x ``matmul_params`` plus causal attention (QK^T and PV over seq/2 positions on
    average: 2 x 2 x seq/2 x heads x head_dim per layer)."""
    return 2.0 * matmul_params(s) + s["layers"] * 2.0 * s["seq"] * s["heads"] * s["head_dim"]


def _job(s: Dict[str, int], bf16: bool, lr: float = 1e-5):
    from megatron_rl.config import job_config_from_dict

    return job_config_from_dict({
        "model": {"num_layers": s["layers"], "hidden_size": s["hidden"], "num_attention_heads": s["heads"],
                  "num_query_groups": s["kv_heads"], "kv_channels": s["head_dim"], "ffn_hidden_size": s["ffn"],
                  "vocab_size": s["vocab"], "max_position_embeddings": max(4096, s["seq"]),
                  "untie_embeddings_and_output_weights": True},
        "actor": {"micro_batch_size": s["rows"], "lr": lr, "clip_grad": 1.0, "bf16": bf16},
        "algorithm": {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0}},
    })


def _batch(s: Dict[str, int], seed: int = 0):
    from megatron_rl.actor import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    p = s["seq"] // 4
    prompts = [torch.randint(0, s["vocab"], (p,), generator=g).tolist() for _ in range(s["rows"])]
    responses = [torch.randint(0, s["vocab"], (s["seq"] - p,), generator=g).tolist() for _ in range(s["rows"])]
    lps = [(-torch.rand(s["seq"] - p, generator=g) * 3 - 0.1).tolist() for _ in range(s["rows"])]
    return RolloutBatch.from_sequences(prompts, responses, lps), torch.randn(s["rows"], generator=g)


def _peak_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB


def _timed(fn, device: str, repeats: int):
    """(median seconds, peak GiB over the timed calls) after one warm-up call."""
    fn()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), _peak_gib(device)


def bench_precision(s: Dict[str, int], bf16: bool, device: str, repeats: int, lr: float = 1e-5) -> Dict[str, dict]:
    """Build the actor in this precision and time its log-prob pass and train step."""
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec

    actor = MegatronActor(actor_spec(_job(s, bf16, lr)))
    batch, adv = _batch(s)
    out: Dict[str, dict] = {}
    state = {}

    def logprob():
        state["lp"] = actor.compute_log_probs(batch, 1.0)[0]

    sec, peak = _timed(logprob, device, repeats)
    out["logprob"] = {"seconds": sec, "peak_gib": peak}
    old = state["lp"]

    steps = []

    def train():
        steps.append(actor.train_step(batch, old, adv, batch.response_mask, None, 1.0))

    sec, peak = _timed(train, device, repeats)
    out["train"] = {"seconds": sec, "peak_gib": peak}
    # the check reads the FIRST train step (the warm-up): every step trains on the same batch against the same
    # old log-probs, so later steps see ratios the earlier updates moved; once every token's ratio is clipped on
    # its advantage's side PPO's gradient is exactly 0 (their clip fractions are reported beside it)
    first = steps[0]
    out["check"] = {"mean_log_prob": float(old[batch.response_mask.bool()].mean()),
                    "grad_norm": float(first["actor/grad_norm"]),
                    "pg_loss": float(first.get("actor/pg_loss", float("nan"))),
                    "pg_clipfrac": float(first.get("actor/pg_clipfrac", float("nan"))),
                    "update_successful": float(first.get("actor/update_successful", float("nan"))),
                    "later_grad_norms": [float(m["actor/grad_norm"]) for m in steps[1:]],
                    "later_pg_clipfracs": [float(m.get("actor/pg_clipfrac", float("nan"))) for m in steps[1:]],
                    "param_dtype": str(next(actor.model[0].module.parameters()).dtype),
                    # the weights the FLOP count assumes: every 2-D parameter but the input embedding
                    "matmul_params": sum(p.numel() for c in actor.model for n, p in c.module.named_parameters()
                                         if p.dim() == 2 and "word_embeddings" not in n)}
    del actor, state, old, steps
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def run(s: Dict[str, int], precisions: List[str], device: str, repeats: int, lr: float = 1e-5) -> dict:
    """The whole benchmark in this process (initialises a one-rank process group and megatron's parallel state)."""
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.parallel.launch import init_distributed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    init_distributed(backend="nccl" if device == "cuda" else "gloo")
    initialize_model_parallel(_job(s, False).parallel, seed=1234, model=_job(s, False).model)
    tokens = s["rows"] * s["seq"]
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shape": s, "tokens": tokens,
              "matmul_params": matmul_params(s), "model_flops_per_token_fwd": model_flops_per_token(s),
              "precisions": {}}
    if device == "cuda":
        result["bf16_matmul_flops"] = matmul_rate(torch.bfloat16)
        result["fp32_matmul_flops"] = matmul_rate(torch.float32)
    for name in precisions:
        r = bench_precision(s, name == "bf16", device, repeats, lr)
        for pass_, mult in (("logprob", 1.0), ("train", 3.0)):
            r[pass_]["tokens_per_s"] = tokens / r[pass_]["seconds"]
            if device == "cuda":
                flops = mult * result["model_flops_per_token_fwd"] * tokens / r[pass_]["seconds"]
                r[pass_]["model_tflops"] = flops / 1e12
                r[pass_]["mfu_vs_bf16_matmul"] = flops / result["bf16_matmul_flops"]
        result["precisions"][name] = r
    return result


def _print(res: dict) -> None:
    s = res["shape"]
    print(f"device {res['device']}; model hidden {s['hidden']} x {s['layers']} layers, heads {s['heads']}/"
          f"{s['kv_heads']}, FFN {s['ffn']}, vocab {s['vocab']}; {s['rows']} rows x {s['seq']} = {res['tokens']} "
          f"tokens; {res['model_flops_per_token_fwd'] / 1e9:.2f} GFLOP/token forward")
    if "bf16_matmul_flops" in res:
        print(f"measured matmul rate: bf16 {res['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s, fp32 "
              f"{res['fp32_matmul_flops'] / 1e12:.0f} TFLOP/s (torch.backends.cuda.matmul.allow_tf32="
              f"{torch.backends.cuda.matmul.allow_tf32})")
    print(f"{'precision':>9} {'pass':>8} {'seconds':>8} {'tokens/s':>10} {'peak GiB':>9} {'TFLOP/s':>8} {'MFU':>6}")
    for name, r in res["precisions"].items():
        for pass_ in ("logprob", "train"):
            x = r[pass_]
            tf = f"{x['model_tflops']:8.1f}" if "model_tflops" in x else f"{'-':>8}"
            mfu = f"{100 * x['mfu_vs_bf16_matmul']:5.1f}%" if "mfu_vs_bf16_matmul" in x else f"{'-':>6}"
            print(f"{name:>9} {pass_:>8} {x['seconds']:8.3f} {x['tokens_per_s']:10.0f} {x['peak_gib']:9.2f} {tf} {mfu}")
        print(f"{'':>9} check: params {r['check']['param_dtype']}, mean log-prob {r['check']['mean_log_prob']:.4f}, "
              f"first step: grad norm {r['check']['grad_norm']:.4g}, pg_loss {r['check']['pg_loss']:.4g}, "
              f"clipfrac {r['check']['pg_clipfrac']:.3g}, update {r['check']['update_successful']:.0f}; later "
              f"steps (same batch, same old log-probs): grad norms "
              f"{', '.join(f'{g:.3g}' for g in r['check']['later_grad_norms'])}, clipfracs "
              f"{', '.join(f'{c:.3g}' for c in r['check']['later_pg_clipfracs'])}")
    p = res["precisions"]
    if "fp32" in p and "bf16" in p:
        print("bf16 / fp32: " + ", ".join(
            f"{k} {p['fp32'][k]['seconds'] / p['bf16'][k]['seconds']:.2f}x faster, peak "
            f"{p['bf16'][k]['peak_gib'] / p['fp32'][k]['peak_gib']:.2f}x" for k in ("logprob", "train")))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    for k in CUDA_SHAPE:
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default CUDA {CUDA_SHAPE[k]}, "
                        f"CPU {CPU_SHAPE[k]}")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate of the train steps")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    shape = dict(CUDA_SHAPE if args.device == "cuda" else CPU_SHAPE)
    shape.update({k: getattr(args, k) for k in shape if getattr(args, k) is not None})
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in ("fp32", "bf16")]
    if bad or not precisions:
        ap.error(f"--precisions: {bad or precisions} (choose from fp32, bf16)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    res = run(shape, precisions, args.device, args.repeats, args.lr)
    _print(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2, default=str)
    finite = all(math.isfinite(r["check"]["mean_log_prob"]) and math.isfinite(r["check"]["grad_norm"])
                 for r in res["precisions"].values())
    if not finite:
        raise SystemExit("non-finite log-probs or gradient norm")
    # the first step's ratios are 1 (old log-probs from the same weights): nothing is clipped, so a zero gradient
    # there means the gradients never reached the optimizer
    dead = [n for n, r in res["precisions"].items() if not r["check"]["grad_norm"] > 0]
    if dead:
        raise SystemExit(f"zero gradient norm on the first train step ({', '.join(dead)})")
    return res


if __name__ == "__main__":
    main()

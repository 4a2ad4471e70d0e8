"""Benchmark token-budget micro-batches and sequence packing (issue 25): padded rows vs token budget vs packed.

What: a tiny random HF Qwen2 (built offline, ``megatron_rl.testing.tiny_hf``; default hidden 256, 4 layers,
4 heads / 2 KV heads, FFN 768, vocab 4096) loaded by ``MegatronActor`` on one gloo rank, and one seeded
long-tailed batch (default 64 rows; prompts 8-23 tokens; response lengths lognormal with median 48, capped at
8x the median). Variants, each in its own forked process (``megatron_rl.testing.distributed.run_ranks``, 1 rank):
  padded   ``actor.micro_batch_size`` rows per micro-batch, each padded to its longest row (today's default)
  budget   ``actor.max_tokens_per_micro_batch = B``: rows grouped first-fit-decreasing, rows x longest <= B
  packed   ``max_tokens_per_micro_batch = B`` + ``sequence_packing``: each micro-batch one THD sequence <= B
B defaults to the padded variant's largest micro-batch (``micro_batch_size`` x its longest row: the memory the
padded run has to be planned for), so the three run at the same token budget; ``--budgets`` adds smaller
budgets for budget/packed (a sweep; the best packed budget is reported).
Per variant: (a) ``actor.compute_log_probs`` and (b) ``actor.train_step`` (one optimizer step; the same
synthetic old log-probs / advantages for every variant): one warm-up each, then the median of ``--repeats``.

Memory: on CUDA ``torch.cuda.max_memory_allocated`` - ``memory_allocated`` before the pass (peak reset first).
On CPU the peak RSS growth over the pass: after the warm-up, ``gc`` + ``malloc_trim``, VmRSS read, the
kernel's peak-RSS counter reset (``/proc/self/clear_refs`` = 5), the pass, then VmHWM - VmRSS-before
(tracemalloc does not see torch's allocations; ``ru_maxrss`` cannot be reset and a fork inherits the
parent's). It is measured on the first timed repeat of each pass, each variant in a fresh process.

Agreement: the log-probs of every variant vs padded (max abs diff over real tokens, first pass = the same
weights) and the train step's pg_loss (first step).

Breakdown (log-prob pass: ``--repeats`` extra passes with forward hooks, the fastest kept): seconds inside
megatron's core attention (``core_attention`` modules: scores, mask, softmax, PV; on CPU the packed path runs each
row's segment as its own causal sequence, ``platform.packed_attention``) and inside the output layer (logits), the rest (projections, MLP, norms, log-prob kernel).

Usage:
  OMP_NUM_THREADS=1 python tools/bench_packing.py                       # defaults (a few minutes on 1 core)
  OMP_NUM_THREADS=1 python tools/bench_packing.py --budgets 1024,512 --repeats 3 --json out.json
  ... --rows 64 --median 48 --hidden 256 --layers 4 --vocab 4096 --micro-batch-size 8 --threads 1

Prints: the batch (real tokens, longest row), then one line per variant/budget: micro-batches, tokens computed
(model positions incl. padding) vs real, log-prob s, train s, their sum, throughput ratio vs padded
(padded time / variant time: > 1 is faster), peak memory growth of each pass and its ratio vs padded, the
log-prob max abs diff and pg_loss diff vs padded, and the attention / output-layer share of the log-prob
pass. Targets (issue 25): packed (log-prob + train step) >= 2x padded throughput; peak memory <= padded at
the same budget. Timings carry the noise of whatever else runs on the machine (every ratio is from one run).

Measured (2026-11-24, commit c47ccee, CPU, 1 thread, 2 shared cores; defaults + ``--budgets 1024,512``; full
table and reading in docs/packing.md): packed at padded's budget B=3176 2.28x padded throughput (log-prob + train
step), peak memory 0.62x / 0.94x; packed B=512 2.34x. Log-probs agree with padded to 1e-6, the loss to 2e-8.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import statistics
import tempfile
import time

import torch

from megatron_rl.actor.micro_batching import PackedCost, PaddedCost, plan_micro_batches

# ---------------------------------------------------------------- memory probes (inside a rank)
def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _settle() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class _Peak:
    """Peak memory growth of one pass: CUDA allocator peak, else peak RSS (VmHWM after a reset) - VmRSS."""

    def __enter__(self):
        _settle()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _status_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.growth = torch.cuda.max_memory_allocated() - self.base
        else:
            self.growth = _status_bytes("VmHWM") - self.base
        return False


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- one variant on one rank
def _rank_variant(rank, world, job, batch, old, adv, repeats, threads):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel

    torch.set_num_threads(threads)
    initialize_model_parallel(job.parallel, seed=0, model=job.model)
    actor = MegatronActor(actor_spec(job))
    mask = batch.response_mask
    T = 1.0

    def logprobs():
        out = actor.compute_log_probs(batch, T, compute_entropy=False)
        _sync()
        return out[0]

    def train():
        m = actor.train_step(batch, old, adv, mask, None, T)
        _sync()
        return m

    lp0 = logprobs()                      # warm-up; initial weights: the agreement check
    m0 = train()                          # warm-up; first step: the loss check (optimizer state now allocated)
    lp_t, tr_t = [], []
    mem = {}
    for i in range(repeats):
        if i == 0:
            with _Peak() as p:
                t0 = time.perf_counter()
                logprobs()
                lp_t.append(time.perf_counter() - t0)
            mem["logprob"] = p.growth
            with _Peak() as p:
                t0 = time.perf_counter()
                train()
                tr_t.append(time.perf_counter() - t0)
            mem["train"] = p.growth
        else:
            t0 = time.perf_counter()
            logprobs()
            lp_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            train()
            tr_t.append(time.perf_counter() - t0)
    # breakdown of ``repeats`` more log-prob passes (the fastest kept): time inside core attention / output layer
    spent = {"attention": 0.0, "output_layer": 0.0}
    handles = []
    for chunk in actor.model:
        for name, mod in chunk.named_modules():
            kind = ("attention" if name.endswith("core_attention") else
                    "output_layer" if name.endswith("output_layer") else None)
            if kind is None:
                continue

            def pre(_m, _a, kind=kind):
                _sync()
                _m._bench_t0 = time.perf_counter()

            def post(_m, _a, _o, kind=kind):
                _sync()
                spent[kind] += time.perf_counter() - _m._bench_t0

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    best = None
    for _ in range(repeats):
        spent.update(attention=0.0, output_layer=0.0)
        t0 = time.perf_counter()
        logprobs()
        spent["total"] = time.perf_counter() - t0
        if best is None or spent["total"] < best["total"]:
            best = dict(spent)
    spent = best
    for h in handles:
        h.remove()
    return {"lp0": lp0, "metrics0": m0, "logprob_s": statistics.median(lp_t), "train_s": statistics.median(tr_t),
            "logprob_all": lp_t, "train_all": tr_t, "mem": mem, "breakdown": spent}


# ---------------------------------------------------------------- driver
def _batch(vocab, rows, median, prompt_range, seed):
    from megatron_rl.actor import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    cap = 8 * median
    sigma = 1.0
    rlens = torch.exp(math.log(median) + sigma * torch.randn(rows, generator=g)).round().clamp(1, cap).long().tolist()
    plens = torch.randint(prompt_range[0], prompt_range[1], (rows,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p in plens]
    responses = [torch.randint(3, vocab, (r,), generator=g).tolist() for r in rlens]
    rollout = [(-torch.rand(r, generator=g) * 3 - 0.1).tolist() for r in rlens]
    batch = RolloutBatch.from_sequences(prompts, responses, rollout)
    W = batch.max_length - 1
    old = (batch.rollout_log_probs + 0.2 * torch.randn(rows, W, generator=g) * batch.response_mask).clamp(max=-1e-3)
    adv = torch.randn(rows, generator=g)
    return batch, old, adv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--median", type=int, default=48, help="median response length (cap: 8x)")
    ap.add_argument("--prompt", default="8,24", help="prompt lengths drawn in [lo, hi)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=8, help="rows per micro-batch of the padded variant")
    ap.add_argument("--budget", type=int, default=None,
                    help="token budget B (default: the padded variant's largest micro-batch)")
    ap.add_argument("--budgets", default="", help="comma list of extra (smaller) budgets for budget/packed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each variant's process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    from megatron_rl.testing.actor_reference import actor_job
    from megatron_rl.testing.distributed import run_ranks
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    tmp = tempfile.mkdtemp(prefix="bench_packing_")
    hf = build_tiny_hf_model(os.path.join(tmp, "qwen2"), arch="qwen2", seed=a.seed, hidden_size=a.hidden,
                             intermediate_size=a.ffn, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                             num_key_value_heads=max(1, a.heads // 2), vocab_size=a.vocab,
                             max_position_embeddings=max(1024, 16 * a.median))
    lo, hi = (int(x) for x in a.prompt.split(","))
    batch, old, adv = _batch(a.vocab, a.rows, a.median, (lo, hi), a.seed)
    lengths = batch.lengths.tolist()
    real = sum(lengths)
    mbs = a.micro_batch_size
    padded_plan = plan_micro_batches(lengths, PaddedCost(), micro_batch_size=mbs, max_tokens=None)
    budget = a.budget or max(padded_plan.tokens)
    extra = sorted({int(x) for x in a.budgets.split(",") if x.strip()} - {budget}, reverse=True)
    print(f"tiny Qwen2: hidden {a.hidden}, {a.layers} layers, {a.heads} heads, FFN {a.ffn}, vocab {a.vocab}; "
          f"{'CUDA' if torch.cuda.is_available() else 'CPU'}, {a.threads} thread(s)/process, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(f"batch: {a.rows} rows, {real} real tokens, rows {min(lengths)}..{max(lengths)} tokens "
          f"(median {int(statistics.median(lengths))}), padded to the longest row: {a.rows * max(lengths)}; "
          f"budget B = {budget}", flush=True)

    variants = [("padded", None, False, budget)] + [("budget", b, False, b) for b in [budget] + extra] + \
        [("packed", b, True, b) for b in [budget] + extra]
    base_actor = {"micro_batch_size": mbs, "lr": 1e-5, "clip_grad": 1.0}
    results = []
    for name, b, packed, label in variants:
        actor = dict(base_actor)
        if b is not None:
            actor["max_tokens_per_micro_batch"] = b
        if packed:
            actor["sequence_packing"] = True
        job = actor_job(hf, actor)
        plan = plan_micro_batches(lengths, PackedCost() if packed else PaddedCost(), micro_batch_size=mbs, max_tokens=b)
        t0 = time.perf_counter()
        r = run_ranks(_rank_variant, 1, job, batch, old, adv, a.repeats, a.threads, timeout=3600)[0]
        r.update(name=name, budget=label, packed=packed, micro_batches=plan.num_micro_batches,
                 computed=sum(plan.tokens), max_mb=max(plan.tokens), wall=time.perf_counter() - t0)
        results.append(r)
        print(f"  ran {name:<6} B={label}: log-prob {r['logprob_s']:.2f} s, train {r['train_s']:.2f} s "
              f"({r['wall']:.0f} s wall)", flush=True)
    report(results, batch)
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "lp0"} for r in results], f, indent=1)


def report(results, batch):
    mib = 2 ** 20
    pad = results[0]
    valid = torch.arange(1, batch.max_length).unsqueeze(0) < batch.lengths.unsqueeze(1)
    real = int(batch.lengths.sum())
    base_t = pad["logprob_s"] + pad["train_s"]
    print(f"\n{'variant':<8}{'B':>6}{'mbs':>5}{'computed':>9}{'/real':>6}{'logp s':>8}{'train s':>8}{'sum s':>7}"
          f"{'speedup':>8}{'memLP MiB':>10}{'x':>6}{'memTR MiB':>10}{'x':>6}{'|dlogp|':>9}{'dloss':>9}"
          f"{'attn%':>6}{'out%':>6}")
    for r in results:
        t = r["logprob_s"] + r["train_s"]
        dlp = (r["lp0"].double() - pad["lp0"].double())[valid].abs().max().item()
        dloss = abs(r["metrics0"]["actor/pg_loss"] - pad["metrics0"]["actor/pg_loss"])
        bd = r["breakdown"]
        ml, mt = r["mem"]["logprob"], r["mem"]["train"]
        print(f"{r['name']:<8}{r['budget']:>6}{r['micro_batches']:>5}{r['computed']:>9}{r['computed'] / real:>6.2f}"
              f"{r['logprob_s']:>8.2f}{r['train_s']:>8.2f}{t:>7.2f}{base_t / t:>8.2f}"
              f"{ml / mib:>10.1f}{ml / max(pad['mem']['logprob'], 1):>6.2f}"
              f"{mt / mib:>10.1f}{mt / max(pad['mem']['train'], 1):>6.2f}{dlp:>9.1e}{dloss:>9.1e}"
              f"{100 * bd['attention'] / bd['total']:>6.0f}{100 * bd['output_layer'] / bd['total']:>6.0f}")
    packed = [r for r in results if r["packed"]]
    best = min(packed, key=lambda r: r["logprob_s"] + r["train_s"])
    same = next(r for r in packed if r["budget"] == pad["budget"])
    sp_same = base_t / (same["logprob_s"] + same["train_s"])
    sp_best = base_t / (best["logprob_s"] + best["train_s"])
    print(f"\nreal tokens {real}; computed = model positions incl. padding (sum of micro-batch costs); speedup = "
          f"padded (log-prob + train) s / variant s; memLP / memTR = peak growth of the log-prob pass / train step "
          f"(x: vs padded); |dlogp| = max abs log-prob diff vs padded; dloss = |pg_loss - padded's|; attn% / out% "
          f"= share of the log-prob pass inside core attention / the output layer")
    mem_ok = same["mem"]["logprob"] <= pad["mem"]["logprob"] and same["mem"]["train"] <= pad["mem"]["train"]
    print(f"  {'PASS' if sp_same >= 2 else 'FAIL'}  packed >= 2x padded throughput at B={same['budget']}: "
          f"{sp_same:.2f}x")
    print(f"  {'PASS' if sp_best >= 2 else 'FAIL'}  best packed budget B={best['budget']}: {sp_best:.2f}x")
    print(f"  {'PASS' if mem_ok else 'FAIL'}  packed peak memory <= padded at B={same['budget']}: log-prob "
          f"{same['mem']['logprob'] / mib:.1f} vs {pad['mem']['logprob'] / mib:.1f} MiB, train "
          f"{same['mem']['train'] / mib:.1f} vs {pad['mem']['train'] / mib:.1f} MiB")
    for r in (pad, same, best):
        bd = r["breakdown"]
        rest = bd["total"] - bd["attention"] - bd["output_layer"]
        print(f"  breakdown {r['name']} B={r['budget']} (fastest hooked log-prob pass, {bd['total']:.2f} s): "
              f"core attention {bd['attention']:.2f} s, output layer {bd['output_layer']:.2f} s, rest {rest:.2f} s")


if __name__ == "__main__":
    main()

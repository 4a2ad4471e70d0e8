"""Benchmark: cost of the rollout-correction step relative to the log-softmax it accompanies.

Runs, in one process and one run:
  * the correction on 64 x 4096 tokens with every metric on (token TIS + batch normalisation,
    token_k1 + seq_mean_k3 + seq_max_k2 rejection, veto, off-policy diagnostics, quantiles);
  * a log-softmax over 4096 tokens (1/64 of them) at vocab 32768, scaled by 64 (it is linear in
    tokens) — the cheapest thing the trainer does with the same tokens;
and prints the ratio (target: < 2 %) and the number of collectives per call on 2 gloo DP ranks x 2 CP.

    OMP_NUM_THREADS=1 python tools/bench_correction.py [--reps 5]
"""
import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_rl.correction import RolloutCorrectionConfig, compute_rollout_correction  # noqa: E402
from megatron_rl.testing.distributed import run_ranks  # noqa: E402

CFG = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
           rollout_rs="token_k1,seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.5_2.0,0.01,2.0",
           rollout_token_veto_threshold=1e-4)


def batch(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    lr = -torch.rand(B, T, generator=g) * 3
    lt = (lr + 0.05 * torch.randn(B, T, generator=g)).clamp(max=0)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return lt, lr, mask


def best_time(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _count_body(rank, world):
    cp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    lt, lr, mask = batch(8, 512, seed=rank // 2)
    half = 256
    sl = slice(0, half) if rank % 2 == 0 else slice(half, None)
    res = compute_rollout_correction(lt[:, sl], lr[:, sl], mask[:, sl], RolloutCorrectionConfig(**CFG),
                                     group=dist.group.WORLD, cp_group=cp)
    return res.num_collectives


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cfg = RolloutCorrectionConfig(**CFG)
    lt, lr, mask = batch(a.batch, a.seq)
    t_corr = best_time(lambda: compute_rollout_correction(lt, lr, mask, cfg), a.reps)
    tokens = a.batch * a.seq
    sub = tokens // 64
    logits = torch.randn(sub, a.vocab)
    t_lsm = best_time(lambda: torch.log_softmax(logits, dim=-1), a.reps) * 64
    n_coll = run_ranks(_count_body, 4, timeout=120)
    print(f"tokens                         {tokens:,} ({a.batch} x {a.seq})")
    print(f"correction (all metrics)       {t_corr * 1e3:9.1f} ms")
    print(f"log_softmax @ V={a.vocab} (x64)  {t_lsm * 1e3:9.1f} ms  (measured on {sub} tokens)")
    print(f"ratio correction / log_softmax {100 * t_corr / t_lsm:9.2f} %   (target < 2 %)")
    print(f"collectives per call (DP2xCP2) {max(n_coll)}          (target <= 3)")


if __name__ == "__main__":
    main()

"""Sum of squared probabilities per token, sum_j p_j^2 of softmax(logits / T) (verl's
``actor.calculate_sum_pi_squared``; the optimal token baseline's path-variance proxy), from vocab-sharded logits.

The rule: it reuses the log-prob pass's global statistics (raw max M and log sum-exp log_s, already combined over
TP), so p_j^2 = exp(2 ((x_j - M) / T - log_s)) is exact locally and the TP combine is ONE more SUM all-reduce of a
[tokens] fp32 tensor. The logits are read in token chunks through one fp32 workspace of [chunk, V/TP] (never an
fp32 copy of the shard); no gradient flows through it. The fused linear path recomputes each logits chunk
(one more GEMM) and calls ``chunk_sum_pi_squared`` on it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .backend import default_chunk_rows

__all__ = ["chunk_sum_pi_squared", "sum_pi_squared_from_stats"]


def chunk_sum_pi_squared(x: torch.Tensor, mx: torch.Tensor, log_s: torch.Tensor, inv_temp: float,
                         buf: torch.Tensor) -> torch.Tensor:
    """fp32 [c]: this rank's share of sum_j p_j^2 for the block ``x`` [c, W] (any float dtype), with ``mx`` /
    ``log_s`` [c] the combined raw max and log sum-exp; ``buf``: an fp32 workspace of at least c x W elements."""
    c, w = x.shape
    a = buf[:c * w].view(c, w)
    a.copy_(x)
    a.sub_(mx.unsqueeze(-1)).mul_(inv_temp).sub_(log_s.unsqueeze(-1)).mul_(2.0)   # 2 log p
    return a.exp_().sum(dim=-1)


def chunk_rows_for(chunk_rows: int, width: int, device) -> int:
    """Rows per chunk: the caller's, capped at the torch path's budget (the Triton path runs all tokens as one
    chunk: no fp32 copy of the shard here)."""
    return max(1, min(int(chunk_rows), default_chunk_rows(width, device)))


@torch.no_grad()
def sum_pi_squared_from_stats(logits2d: torch.Tensor, mx: torch.Tensor, log_s: torch.Tensor, inv_temp: float,
                              chunk_rows: int, tp_group: Optional[object], world_size: int) -> torch.Tensor:
    """fp32 [N]: sum_j p_j^2 over the whole vocabulary for every row of ``logits2d`` [N, V/TP] (this rank's
    slice), with ``mx`` / ``log_s`` [N] the combined raw max and log sum-exp (``combine.combine_partials``).
    Collective over ``tp_group`` when ``world_size > 1`` (every TP rank calls it with the same N)."""
    n, vp = logits2d.shape
    out = torch.zeros(n, dtype=torch.float32, device=logits2d.device)
    step = chunk_rows_for(chunk_rows, vp, logits2d.device)
    buf = torch.empty(min(n, step) * vp, dtype=torch.float32, device=logits2d.device)
    for i in range(0, n, step):
        j = min(n, i + step)
        out[i:j] = chunk_sum_pi_squared(logits2d[i:j], mx[i:j], log_s[i:j], inv_temp, buf)
    if world_size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=tp_group)
    return out

"""Tensor-parallel combine of per-token softmax partials into log-probs, entropy and log-sum-exp.

Each TP rank r holds, for every token, partials of its vocab slice x_r (raw logits; z = x / T):
    m_r   = max_j x_rj                                   (raw units: max commutes with x -> x / T)
    s_r   = sum_j exp(d_rj),   d_rj = (x_rj - m_r) / T
    spz_r = sum_j exp(d_rj) * d_rj
    tgt_r = x_{target} (raw) if the target id is in this rank's slice else 0
The combine costs exactly two all-reduces over ``tp_group`` for ALL tokens at once:
one MAX of m (-> M), then one SUM of the packed [3, N] tensor of rescaled partials, with
delta_r = (m_r - M) / T:
    s   = sum_r exp(delta_r) * s_r
    spz = sum_r exp(delta_r) * (spz_r + delta_r * s_r)        (= sum_j exp(z_j - M/T) (z_j - M/T))
    tgt = sum_r tgt_r                                          (one owner, exact)
from which  logp = (tgt - M) / T - log s,  entropy = log s - spz / s,  lse = M / T + log s.
Differences are taken in raw units before scaling by 1/T, so large probabilities keep fp32 relative
accuracy at any temperature.

Non-finite logits anywhere (NaN, +inf, -inf) make s or spz non-finite for that token on every rank
(NaN -> m_r NaN; +inf -> exp(inf - inf); -inf -> 0 * -inf in spz), so ``bad`` is identical on all
ranks and every rank can raise together. Pure function of tensors plus the explicit group.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def combine_partials(m: torch.Tensor, s: torch.Tensor, tgt: torch.Tensor, spz: torch.Tensor, inv_temp: float,
                     tp_group: Optional[object], world_size: int):
    """Combine fp32 [N] partials over ``tp_group``; returns (logp, entropy, M, log_s, bad) all [N].

    M is the global raw max; the log-sum-exp of z is M * inv_temp + log_s; it is returned in two parts because the backward computes
    log p = (x - M) * inv_temp - log_s: for the large probabilities x - M and log_s are both small, so p keeps
    fp32 relative accuracy (z - lse would lose ~ulp(|lse|) absolute, ~1e-6 for lse ~ 10).

    ``bad`` is a bool mask of tokens whose combined statistics are not finite (same on every rank).
    Inputs are not modified.
    """
    if world_size > 1:
        M = m.clone()
        dist.all_reduce(M, op=dist.ReduceOp.MAX, group=tp_group)
        delta = (m - M) * inv_temp
        scale = torch.exp(delta)
        packed = torch.stack([s * scale, tgt, scale * (spz + delta * s)])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
        s_all, tgt_all, spz_all = packed[0], packed[1], packed[2]
    else:
        M, s_all, tgt_all, spz_all = m, s, tgt, spz
    log_s = torch.log(s_all)
    logp = (tgt_all - M) * inv_temp - log_s
    ent = log_s - spz_all / s_all
    bad = ~(torch.isfinite(logp) & torch.isfinite(ent) & torch.isfinite(M) & torch.isfinite(log_s))
    return logp, ent, M, log_s, bad

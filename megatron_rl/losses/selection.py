"""Batch-level token selections (Clip-Cov, KL-Cov, M2PO), exact over a process group without gathering tokens.

Each selection reads statistics of the whole batch (means, a top-k, a suffix mean of sorted values). With
the batch split over the ranks of ``group``, they are computed from all-reduced sums and histograms only:
means from (sum, count); the k largest values by a radix select on the values' order-preserving 64-bit
keys (8 rounds of one 256-bin histogram all_reduce); M2PO's cut-off by bisection on the same keys (one
(count, sum) all_reduce per step). The result equals the single-process selection on the concatenated
batch; tokens tied with the k-th value are all selected, so a selection can exceed its k. Ties are not rare:
responses to one prompt that share a prefix and an advantage have equal log-probs, covariances and Clip-Cov
hashes at the same column (verl's ``topk`` / ``randperm`` pick among such tokens arbitrarily).

* ``covariance_selection("clip_cov", ...)`` — verl 0.9.1 ``compute_policy_loss_clip_cov``
  (verl/trainer/ppo/core_algos.py): cov_t = (A_t - mean A)(log pi_t - mean log pi) over the batch's valid
  tokens; candidates: lb < cov < ub, not already clipped by PPO; max(int(clip_cov_ratio * N), 1) of them
  are chosen at random. verl draws ``torch.randperm`` (unseeded, different per rank); here each token gets
  a 31-bit hash of (``clip_cov_seed``, its column, the bits of its old log-prob and advantage) and the
  smallest hashes win: the same choice on every rank and for every split of the batch.
* ``covariance_selection("kl_cov", ...)`` — verl 0.9.1 ``compute_policy_loss_kl_cov``: the
  max(1, int(kl_cov_ratio * N)) valid tokens with the largest cov.
* ``m2po_keep_mask`` — AReaL ``_apply_m2po_masking`` / ``_get_m2po_loss_mask``
  (areal/trainer/ppo/actor.py): m2 = (log pi_rollout - log pi_old)^2; the largest m2 are masked until the
  mean of the rest is below ``m2_threshold`` (if no such set, all but the smallest are masked). Difference:
  tokens with equal m2 are kept or masked together (AReaL's sort order splits such ties arbitrarily; they are
  common, as the responses to one prompt share prefixes and so log-probs).

Scope: the actor calls ``batch_selection`` once per training step on its whole batch, before the
micro-batches are cut, over the DP group (rows are whole there), so the selection does not depend on
micro-batching, CP or PP. verl and AReaL select per micro-batch and rank, from the current log-probs; here
the covariances use the log-probs the step starts from (log pi_old; equal to verl's on the first update of
on-policy data, where pi_theta = pi_old), which also makes PPO's clipped-by-origin set empty.
``compute_policy_loss`` called without a selection selects inside its own batch from the current
log-probs (verl's per-micro-batch behaviour).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron_rl.numerics import clamp_log_ratio

from .config import BATCH_LOSS_TYPES, PolicyLossConfig

M31 = (1 << 31) - 1


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        from megatron_rl.parallel.devices import all_reduce_
        all_reduce_(t, group=group)
    return t


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys with the order of float64 ``x`` (-0.0 < +0.0; no NaN expected)."""
    bits = x.to(torch.float64).contiguous().view(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ torch.iinfo(torch.int64).max)


def top_k_mask(keys: torch.Tensor, valid: torch.Tensor, k: int, group=None) -> torch.Tensor:
    """Bool mask of the ``k`` largest int64 ``keys`` among ``valid`` positions of all ranks of ``group``
    (radix select, 8 all_reduces of 256 counts); ties with the k-th key are all selected."""
    if k <= 0:
        return torch.zeros_like(valid)
    u = keys ^ torch.iinfo(torch.int64).min          # flip the sign bit: unsigned order in the bytes
    selected = torch.zeros_like(valid)
    cand = valid.clone()
    remaining = int(k)
    for shift in range(56, -8, -8):
        byte = (u >> shift) & 255
        hist = torch.bincount(byte[cand], minlength=256).to(torch.float64)
        _all_reduce(hist, group)
        at_or_above = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])   # [b]: count with byte >= b
        counts = at_or_above.tolist()
        if counts[0] <= remaining:                   # every candidate fits
            return selected | cand
        b = max(i for i in range(256) if counts[i] >= remaining)
        above = counts[b] - float(hist[b])
        selected |= cand & (byte > b)
        remaining -= int(above)
        cand &= byte == b
    return selected | cand


def token_hash(columns: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
               seed: int) -> torch.Tensor:
    """31-bit int64 hash per token of (seed, column, float64 bits of old log-prob and advantage)."""
    h = torch.full_like(columns, (seed * 2654435761 + 97) & M31, dtype=torch.int64)
    parts = [columns.to(torch.int64)]
    for t in (old_log_probs, advantages):
        bits = t.to(torch.float64).contiguous().view(torch.int64)
        parts += [bits & M31, (bits >> 31) & M31, (bits >> 62) & 3]
    for p in parts:
        h = (h ^ p) & M31
        h = (h * 1103515245 + 12345) & M31
        h = h ^ (h >> 15)
        h = (h * 48271) & M31
    return h


def covariance_selection(loss_type: str, config: PolicyLossConfig, log_probs: torch.Tensor,
                         old_log_probs: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor,
                         group=None) -> torch.Tensor:
    """[B, T] bool: Clip-Cov's tokens whose gradient is cut, or KL-Cov's tokens that get the penalty, over
    the batch spread across ``group`` (see the module docstring)."""
    lp = log_probs.detach().to(torch.float64)
    adv = advantages.detach().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=lp.device)
    stats = torch.stack([torch.where(valid, adv, zero).sum(), torch.where(valid, lp, zero).sum(),
                         valid.sum().to(torch.float64)])
    _all_reduce(stats, group)
    n = float(stats[2])
    if n == 0:
        return torch.zeros_like(valid)
    cov = (adv - stats[0] / n) * (lp - stats[1] / n)
    if loss_type == "kl_cov":
        k = max(1, int(n * config.kl_cov_ratio))
        return top_k_mask(ordered_keys(cov), valid, k, group)
    if loss_type != "clip_cov":
        raise ValueError(f"covariance_selection: loss_type must be 'clip_cov' or 'kl_cov', got {loss_type!r}")
    ratio = torch.exp(clamp_log_ratio(lp - old_log_probs.detach().to(torch.float64)))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    cand = valid & ~(clipped > unclipped) & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    k = max(int(config.clip_cov_ratio * n), 1)
    columns = torch.arange(lp.shape[-1], device=lp.device).expand_as(lp)
    h = token_hash(columns, old_log_probs, advantages, config.clip_cov_seed)
    return top_k_mask(M31 - h, cand, k, group)             # the k smallest hashes


def m2po_keep_mask(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, valid: torch.Tensor,
                   threshold: float, group=None) -> torch.Tensor:
    """[B, T] bool: the valid tokens M2PO keeps (see the module docstring), over the batch across ``group``."""
    m2 = (rollout_log_probs.detach().to(torch.float64) - old_log_probs.detach().to(torch.float64)).square()
    keys = ordered_keys(m2)                                # m2 >= 0: keys >= 0, ordered like m2
    big = torch.iinfo(torch.int64).max

    def below(c: int) -> Tuple[float, float]:
        sel = valid & (keys <= c)
        t = torch.stack([sel.sum().to(torch.float64), torch.where(sel, m2, torch.zeros_like(m2)).sum()])
        _all_reduce(t, group)
        return float(t[0]), float(t[1])

    count, total = below(big)
    if count == 0 or total / count < threshold:
        return valid.clone()
    # (a rank may hold no rows: the sentinel keeps min() defined, and its MIN-reduce still joins the group)
    lo_t = torch.cat([keys[valid], torch.full((1,), big, dtype=keys.dtype, device=keys.device)]).min().reshape(1)
    if group is not None:
        _min_reduce(lo_t, group)
    lo = int(lo_t)
    cnt, s = below(lo)
    if not s / cnt < threshold:
        return valid & (keys <= lo)                        # AReaL: all but the smallest masked
    hi = big                                               # invariant: P(lo) true, P(hi) false
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        cnt, s = below(mid)
        if s / cnt < threshold:
            lo = mid
        else:
            hi = mid
    return valid & (keys <= lo)


def _min_reduce(t: torch.Tensor, group) -> None:
    import torch.distributed as dist
    from megatron_rl.parallel.devices import all_reduce_
    all_reduce_(t, op=dist.ReduceOp.MIN, group=group)


def batch_selection(loss_type: str, config: PolicyLossConfig, old_log_probs: torch.Tensor,
                    rollout_log_probs: Optional[torch.Tensor], advantages: torch.Tensor,
                    response_mask: torch.Tensor, group=None
                    ) -> Tuple[Optional[torch.Tensor], torch.Tensor, Dict[str, float]]:
    """The training step's batch selection for ``loss_type`` (collective over ``group`` for clip_cov,
    kl_cov and m2po; nothing to do, and no communication, for the others).

    Returns (token_select, response_mask, metrics): ``token_select`` is a [B, T] float 0/1 tensor for
    clip_cov / kl_cov (pass it to ``compute_policy_loss``), else None; ``response_mask`` is the mask with
    M2PO's masked tokens removed (unchanged otherwise, same dtype); ``metrics`` holds ``m2po_maskfrac``
    (masked fraction of the batch's valid tokens) for m2po."""
    if loss_type not in BATCH_LOSS_TYPES:
        return None, response_mask, {}
    dev = old_log_probs.device                      # the inputs may come from different places (host / device)
    advantages = advantages.to(dev)
    valid = response_mask.to(dev) != 0
    if loss_type in ("clip_cov", "kl_cov"):
        sel = covariance_selection(loss_type, config, old_log_probs, old_log_probs, advantages, valid, group)
        return sel.to(torch.float32), response_mask, {}
    if loss_type == "m2po":
        if config.m2_threshold is None:
            raise ValueError("actor.policy_loss.m2_threshold must be set (> 0) with loss_type 'm2po'")
        if rollout_log_probs is None:
            raise ValueError("loss_type 'm2po' needs the rollout engine's log-probs (its second moment is of "
                             "log pi_rollout - log pi_old); the batch has none")
        keep = m2po_keep_mask(old_log_probs, rollout_log_probs.to(dev), valid, config.m2_threshold, group)
        counts = torch.stack([valid.sum(), (valid & ~keep).sum()]).to(torch.float64)
        _all_reduce(counts, group)
        frac = float(counts[1] / counts[0]) if float(counts[0]) > 0 else 0.0
        keep = keep.to(response_mask.device)
        mask = torch.where(keep, response_mask, torch.zeros_like(response_mask))
        return None, mask, {"m2po_maskfrac": frac}

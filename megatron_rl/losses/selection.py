"""Batch-level token selections (Clip-Cov, KL-Cov, M2PO), exact over a process group without gathering tokens.

Each selection reads statistics of the whole batch (means, a top-k, a suffix mean of sorted values). With the
batch split over the ranks of ``group`` they are computed from all-reduced sums and histograms only: the k
largest values by a radix select on order-preserving 64-bit keys (8 rounds of one 256-bin all_reduce), M2PO's
cut-off by bisection on the same keys. The result equals the single-process selection on the concatenated
batch. The one rule: tokens tied with the k-th value are all selected (so a selection can exceed its k) -- ties
are common, responses to one prompt share prefixes -- where verl's ``topk`` / ``randperm`` and AReaL's sort
pick among them arbitrarily. The actor selects once per training step on its whole batch, from log pi_old,
before the micro-batches are cut; the references and differences are in docs/objectives.md.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rl.numerics import clamp_log_ratio
from megatron_rl.parallel.devices import all_reduce_

from .config import PolicyLossConfig

M31 = (1 << 31) - 1


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
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
    all_reduce_(t, op=dist.ReduceOp.MIN, group=group)


Selected = Tuple[Optional[torch.Tensor], torch.Tensor, Dict[str, float]]
"""(token_select, response_mask, metrics): a [B, T] float 0/1 selection for ``compute_policy_loss`` (or None),
the response mask with the tokens the selection removes dropped (same dtype), the selection's metrics."""


def covariance_selection_of(loss_type: str):
    """The selection of a covariance objective (``clip_cov``: the tokens whose gradient is cut; ``kl_cov``: the
    tokens that get the |log ratio| penalty), chosen over the whole batch across ``group``."""
    def select(config: PolicyLossConfig, old_log_probs: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
               advantages: torch.Tensor, response_mask: torch.Tensor, group=None) -> Selected:
        valid = response_mask.to(old_log_probs.device) != 0
        sel = covariance_selection(loss_type, config, old_log_probs, old_log_probs, advantages, valid, group)
        return sel.to(torch.float32), response_mask, {}
    select.__name__ = f"{loss_type}_selection"
    return select


def m2po_selection(config: PolicyLossConfig, old_log_probs: torch.Tensor,
                   rollout_log_probs: Optional[torch.Tensor], advantages: torch.Tensor,
                   response_mask: torch.Tensor, group=None) -> Selected:
    """The response mask without the tokens M2PO masks, and ``m2po_maskfrac`` (masked fraction of the batch's
    valid tokens). Needs ``rollout_log_probs`` and ``config.m2_threshold``."""
    dev = old_log_probs.device
    valid = response_mask.to(dev) != 0
    keep = m2po_keep_mask(old_log_probs, rollout_log_probs.to(dev), valid, config.m2_threshold, group)
    counts = torch.stack([valid.sum(), (valid & ~keep).sum()]).to(torch.float64)
    _all_reduce(counts, group)
    frac = float(counts[1] / counts[0]) if float(counts[0]) > 0 else 0.0
    keep = keep.to(response_mask.device)
    mask = torch.where(keep, response_mask, torch.zeros_like(response_mask))
    return None, mask, {"m2po_maskfrac": frac}

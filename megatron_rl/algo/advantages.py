"""Outcome-reward advantage estimators: GRPO (group-normalised) and RLOO (leave-one-out baseline).

One scalar reward per response, responses to one prompt form a group; the advantage is broadcast over the
response tokens and multiplied by the mask given. Groups of size 1 get advantage 0 (no baseline is possible; verl
leaves an un-baselined term there — deliberately not done here). Pass the response mask AFTER rejection so
rejected tokens get zero advantage; ``baseline_over`` says whether the group statistics use every sample
(``"all"``, verl's) or kept ones. Math in float64 on the rewards' device, pure functions. The formulas:
docs/advantages.md.

    adv = compute_advantages(rewards, group_index, response_mask, estimator="grpo")   # [B, T]
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

#: Supported ``algorithm.advantage_estimator`` values.
ESTIMATORS = ("grpo", "rloo")
#: Supported ``baseline_over`` values.
BASELINE_OVER = ("all", "kept")


def _group_ids(group_index, batch: int, device: torch.device) -> torch.Tensor:
    """Map ``group_index`` (an int tensor on ``device``, or a sequence of hashables such as prompt uids) to dense
    ints on ``device``."""
    if isinstance(group_index, torch.Tensor):
        if group_index.device != device:
            raise ValueError(f"group_index is on {group_index.device}, rewards on {device}: build both on one "
                             f"device (the actor's)")
        if group_index.dim() != 1 or group_index.shape[0] != batch:
            raise ValueError(f"group_index must have shape [{batch}] (one per response), got "
                             f"{tuple(group_index.shape)}")
        if group_index.dtype.is_floating_point or group_index.dtype == torch.bool:
            raise ValueError(f"group_index must be an integer tensor, got {group_index.dtype}")
        return torch.unique(group_index, return_inverse=True)[1]
    if isinstance(group_index, (str, bytes)) or not isinstance(group_index, Sequence) or len(group_index) != batch:
        raise ValueError(f"group_index must be a sequence of {batch} group ids (one per response)")
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in group_index], dtype=torch.long, device=device)


def group_advantage_scalars(rewards: torch.Tensor, group_index, estimator: str = "grpo",
                            norm_adv_by_std: bool = True, epsilon: float = 1e-6,
                            include: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence advantages ``[B]`` (float32) from ``rewards`` ``[B]`` (see the module docstring).

    ``include`` (bool ``[B]``, default all True) selects the samples that enter the group statistics; excluded
    samples get 0 and groups with fewer than 2 included samples get 0."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [B], got "
                         f"{tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__}")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten()[:5].tolist()
        raise ValueError(f"rewards has non-finite values at indices {bad}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"algorithm.advantage_estimator={estimator!r} must be one of {ESTIMATORS}")
    if not (isinstance(epsilon, (int, float)) and epsilon >= 0):
        raise ValueError(f"epsilon={epsilon!r} must be a number >= 0")
    B = rewards.shape[0]
    dev = rewards.device
    gid = _group_ids(group_index, B, dev)
    inc = torch.ones(B, dtype=torch.bool, device=dev) if include is None else include.to(torch.bool)
    if inc.shape != (B,):
        raise ValueError(f"include must have shape [{B}], got {tuple(inc.shape)}")
    if inc.device != dev:
        raise ValueError(f"include is on {inc.device}, rewards on {dev}")
    r = rewards.detach().to(torch.float64)
    w = inc.to(torch.float64)
    G = int(gid.max().item()) + 1 if B else 0
    count = torch.zeros(G, dtype=torch.float64, device=dev).index_add_(0, gid, w)
    total = torch.zeros(G, dtype=torch.float64, device=dev).index_add_(0, gid, r * w)
    n = count[gid]
    mean = total[gid] / n.clamp(min=1)
    valid = inc & (n >= 2)
    if estimator == "grpo":
        adv = r - mean
        if norm_adv_by_std:
            sq = torch.zeros(G, dtype=torch.float64, device=dev).index_add_(0, gid, (r - mean) ** 2 * w)
            std = (sq[gid] / (n - 1).clamp(min=1)).sqrt()
            adv = adv / (std + epsilon)
    else:  # rloo
        adv = r - (total[gid] - r) / (n - 1).clamp(min=1)
    adv = torch.where(valid, adv, torch.zeros_like(adv))
    return adv.to(torch.float32)


def compute_advantages(rewards: torch.Tensor, group_index, response_mask: torch.Tensor, estimator: str = "grpo",
                       norm_adv_by_std: bool = True, epsilon: float = 1e-6,
                       baseline_over: str = "all") -> torch.Tensor:
    """Token-level advantages ``[B, T]`` (float32): the per-sequence scalar times ``response_mask`` (the mask
    after rejection sampling). ``baseline_over``: "all" samples or only "kept" ones (>= 1 unmasked token)
    enter the group statistics (see the module docstring)."""
    if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2:
        raise ValueError("response_mask must be a 2-D tensor [B, T]")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or rewards.shape[0] != response_mask.shape[0]:
        raise ValueError(f"rewards must be [B={response_mask.shape[0]}] to match response_mask "
                         f"{tuple(response_mask.shape)}, got "
                         f"{tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__}")
    if baseline_over not in BASELINE_OVER:
        raise ValueError(f"baseline_over={baseline_over!r} must be one of {BASELINE_OVER}")
    if rewards.device != response_mask.device:
        raise ValueError(f"rewards are on {rewards.device}, response_mask on {response_mask.device}: build the "
                         f"step's rewards on the actor's device")
    m = response_mask.to(torch.float32)
    if not ((m == 0) | (m == 1)).all():
        raise ValueError("response_mask must contain only 0 and 1")
    include = (m.sum(dim=-1) > 0) if baseline_over == "kept" else None
    scalars = group_advantage_scalars(rewards, group_index, estimator, norm_adv_by_std, epsilon, include)
    return scalars.unsqueeze(-1) * m

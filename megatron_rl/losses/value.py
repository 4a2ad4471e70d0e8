"""The critic's clipped value loss: verl 0.9.1 ``core_algos.compute_value_loss`` with global denominators.

    out = compute_value_loss(vpreds, returns, values, response_mask, cliprange_value=0.5,
                             loss_agg_mode="token-mean", denominators=den)   # ValueLossOutput

Rule: the aggregation is ``aggregate_loss``'s (the same five modes and global denominators as the policy loss), so
summing the per-micro-batch losses over micro-batches and DP ranks gives the full batch's loss, gradients included.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .aggregation import LossDenominators, aggregate_loss
from .metrics import SumCount, sum_count

__all__ = ["ValueLossOutput", "compute_value_loss"]


@dataclass
class ValueLossOutput:
    """One micro-batch's value loss and its (sum, count) metrics."""

    loss: torch.Tensor
    """0.5 x the aggregated max(unclipped, clipped) squared error (differentiable)."""
    metrics: Dict[str, SumCount]
    """vf_clipfrac (tokens where the clipped error is larger), vpred_mean (the predicted values)."""


def compute_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
                       response_mask: torch.Tensor, cliprange_value: float, loss_agg_mode: str = "token-mean",
                       denominators: Optional[LossDenominators] = None, *,
                       loss_scale_factor: Optional[float] = None,
                       seq_valid_tokens: Optional[torch.Tensor] = None) -> ValueLossOutput:
    """verl's clipped value loss of [B, T] ``vpreds`` (current), ``values`` (before this step), ``returns``.

    vpredclipped = clip(vpreds, values - c, values + c); loss = 0.5 * agg(max((vpreds - R)^2,
    (vpredclipped - R)^2)); vf_clipfrac = mean over valid tokens of [(vpredclipped - R)^2 > (vpreds - R)^2]."""
    if not cliprange_value > 0:
        raise ValueError(f"critic.cliprange_value must be > 0, got {cliprange_value!r}")
    shape = tuple(vpreds.shape)
    for name, t in (("returns", returns), ("values", values), ("response_mask", response_mask)):
        if tuple(t.shape) != shape:
            raise ValueError(f"compute_value_loss: {name} has shape {tuple(t.shape)}, vpreds {shape}")
    values = values.to(vpreds.dtype)
    returns = returns.to(vpreds.dtype)
    # verl_F.clip_by_value: max(min(x, hi), lo)
    clipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    l1 = (vpreds - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.max(l1, l2), response_mask, loss_agg_mode, denominators,
                                loss_scale_factor=loss_scale_factor, seq_valid_tokens=seq_valid_tokens)
    valid = response_mask != 0
    metrics = {"vf_clipfrac": sum_count(torch.gt(l2, l1).to(torch.float64), valid),
               "vpred_mean": sum_count(vpreds.detach(), valid)}
    return ValueLossOutput(loss=loss, metrics=metrics)

"""Numerical constants shared by the losses and the rollout correction (one definition each).

* ``LOG_RATIO_CLAMP``: every log-ratio (PPO ratio, IS ratio, KL estimators, histogram of ratios) is
  clamped to [-20, 20] before ``exp``: exp(20) ~ 4.9e8 is finite in fp32, and verl clamps the same.
* ``LOG_PROB_TOLERANCE``: a log-probability above 1e-3 on a valid token is not a log-probability
  (log p <= 0; rounding noise of a fused log-softmax stays below it), so it is reported as invalid
  by both the loss input checks and the correction.
"""
from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0
"""|log ratio| bound before exponentiation (exp(20) ~ 4.9e8, finite in fp32)."""

LOG_PROB_TOLERANCE = 1e-3
"""A log-probability above this on a valid token is invalid (log p <= 0 up to rounding)."""


def clamp_log_ratio(x: torch.Tensor) -> torch.Tensor:
    """``x`` clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]."""
    return x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def exp_clamped(x: torch.Tensor) -> torch.Tensor:
    """``exp(clamp_log_ratio(x))``: never inf."""
    return torch.exp(clamp_log_ratio(x))

"""Per-token KL(pi_theta || pi_ref) estimators (Schulman, "Approximating KL divergence"), verl's names.

With x = log pi_theta - log pi_ref (per sampled token):

* ``k1`` / ``kl``:          x
* ``abs``:                  |x|
* ``k2`` / ``mse``:         x^2 / 2
* ``k3`` / ``low_var_kl``:  exp(-x) + x - 1, with -x clamped to [-20, 20] before exp (never inf) and the
  result clamped to [-10, 10] as verl does (k3 >= 0, so in effect capped at 10; the gradient is 0
  beyond the caps).
* ``<name>+`` (e.g. ``k3+``, ``low_var_kl+``): straight-through — the VALUE of <name> with the GRADIENT
  of k2, computed as k2 + (value - k2).detach(). This is the fix from verl PR 2953 (the first seed):
  E[grad k1] and E[grad k3] are not grad KL(pi_theta || pi_ref), E[grad k2] is. ``k2+``/``mse+`` equal k2.

Usage::

    kl = kl_penalty(log_probs, ref_log_probs, "k3+")   # [B, T]; aggregate with aggregate_loss
"""
from __future__ import annotations

import torch

from megatron_rl.numerics import clamp_log_ratio

from .config import KL_TYPES

K3_VALUE_CLAMP = 10.0
"""k3 is clamped to [-K3_VALUE_CLAMP, K3_VALUE_CLAMP] after computation (verl's choice)."""


def _forward(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, base: str) -> torch.Tensor:
    diff = log_probs - ref_log_probs
    if base in ("kl", "k1"):
        return diff
    if base == "abs":
        return diff.abs()
    if base in ("mse", "k2"):
        return 0.5 * diff.square()
    # k3 / low_var_kl: r = pi_ref / pi_theta, k3 = r - log r - 1
    log_r = clamp_log_ratio(-diff)
    return torch.clamp(torch.exp(log_r) - log_r - 1.0, min=-K3_VALUE_CLAMP, max=K3_VALUE_CLAMP)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate of type ``kl_type`` (one of ``KL_TYPES``), same shape as the inputs.

    Differentiable in ``log_probs`` (and ``ref_log_probs`` if it requires grad). No masking: apply
    the response mask when aggregating (``aggregate_loss``)."""
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {list(KL_TYPES)}, got {kl_type!r}")
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"shape mismatch: ref_log_probs has shape {tuple(ref_log_probs.shape)} but "
                         f"log_probs has shape {tuple(log_probs.shape)}")
    straight_through = kl_type.endswith("+")
    base = kl_type[:-1] if straight_through else kl_type
    value = _forward(log_probs, ref_log_probs, base)
    if not straight_through or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (log_probs - ref_log_probs).square()
    return k2 + (value - k2).detach()

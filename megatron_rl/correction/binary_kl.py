"""KPop's statistic (AReaL PR #1405): the larger of the two binary KL divergences of a sampled token.

With p = pi_prox and q = pi_behave of the sampled token, each clamped to [1e-8, 1 - 1e-8], and
D(p||q) = p log(p/q) + (1-p) log((1-p)/(1-q)) (the KL of the Bernoulli "this token / any other token"), the
rejection option ``binary_kl`` keeps a token iff max(D(p||q), D(q||p)) <= phi. Rule: computed in float64 -- in
float32 1 - 1e-8 rounds to 1, so a token with p = 1 would give 0 x log 0 = NaN (docs/correction.md).
"""
from __future__ import annotations

import torch

BINARY_KL_EPS = 1e-8
"""p and q are clamped to [BINARY_KL_EPS, 1 - BINARY_KL_EPS] (AReaL's ``compute_binary_kl_divergence``)."""


def binary_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """D(p||q) of Bernoulli(p) and Bernoulli(q) given log p and log q (float64, >= 0)."""
    p = torch.exp(log_p.to(torch.float64)).clamp(BINARY_KL_EPS, 1.0 - BINARY_KL_EPS)
    q = torch.exp(log_q.to(torch.float64)).clamp(BINARY_KL_EPS, 1.0 - BINARY_KL_EPS)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def kpop_statistic(log_prox: torch.Tensor, log_behave: torch.Tensor) -> torch.Tensor:
    """max(D(p||q), D(q||p)) per token (float64), p = exp(log_prox), q = exp(log_behave)."""
    return torch.maximum(binary_kl(log_prox, log_behave), binary_kl(log_behave, log_prox))

"""Token-local objectives' term functions: (log pi_theta, log pi_old, A, IS weights) -> a [B, T] loss.

Each follows one function of verl 0.9.1's ``verl/trainer/ppo/core_algos.py`` on the same tensors (the row in
``registry.py`` names it; the formulas are in docs/objectives.md), including where the correction's IS weights
w enter: the per-token loss is multiplied by w after the objective (verl: ``pg_losses = pg_losses *
rollout_is_weights``). One rule differs from verl: ratios are exp of log-ratios clamped at +-20 everywhere
(verl leaves them unclamped in gpg / dro / clip_cov / kl_cov, where exp can overflow); identical for
|lr| <= 20. Sequence-level objectives are in ``sequence.py``.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.numerics import clamp_log_ratio

from .selection import covariance_selection
from .terms import ObjectiveInputs, ObjectiveTerms


def _weighted(loss: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
    return loss if w is None else loss * w


def _zeros(x: ObjectiveInputs) -> torch.Tensor:
    return torch.zeros_like(x.log_probs, dtype=torch.float64).detach()


def ppo_clip_per_token(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                       clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: Optional[float]):
    """Unmasked per-token PPO-clip loss (no IS weights, no validation).

    Returns (loss, clipped, clipped_lower, log_ratio): ``clipped`` is True where the clipped branch
    exceeds the unclipped one (verl's pg_clipfrac indicator), ``clipped_lower`` where A < 0 and the
    dual-clip cap -A*c is taken, ``log_ratio`` the clamped logp - old_logp (detached)."""
    log_ratio = clamp_log_ratio(log_probs - old_log_probs)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_branch = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped_branch)
    clipped = clipped_branch > unclipped
    if clip_ratio_c is None:
        clipped_lower = torch.zeros_like(clipped)
    else:
        cap = -advantages * clip_ratio_c
        negative = advantages < 0
        clipped_lower = (loss > cap) & negative
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    return loss, clipped.detach(), clipped_lower.detach(), log_ratio.detach()


def reinforce_per_token(log_probs: torch.Tensor, advantages: torch.Tensor,
                        is_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """Unmasked per-token REINFORCE loss -A * w.detach() * logp (w = 1 when ``is_weights`` is None)."""
    loss = -advantages * log_probs
    return loss if is_weights is None else loss * is_weights.detach()


def vanilla(x: ObjectiveInputs) -> ObjectiveTerms:
    c = x.config
    loss, clipped, lower, lr = ppo_clip_per_token(x.log_probs, x.old_log_probs, x.advantages, c.clip_ratio_low,
                                                  c.clip_ratio_high, c.clip_ratio_c)
    return ObjectiveTerms(_weighted(loss, x.is_weights), clipped.double(), lower.double(), -lr)


def reinforce(x: ObjectiveInputs) -> ObjectiveTerms:
    lr = clamp_log_ratio(x.log_probs.detach() - x.old_log_probs)
    loss = reinforce_per_token(x.log_probs, x.advantages, x.is_weights)
    return ObjectiveTerms(loss, _zeros(x), _zeros(x), -lr)


def gpg(x: ObjectiveInputs) -> ObjectiveTerms:
    lr = clamp_log_ratio(x.log_probs.detach() - x.old_log_probs)
    return ObjectiveTerms(_weighted(-x.log_probs * x.advantages, x.is_weights), _zeros(x), _zeros(x), -lr)


def cispo(x: ObjectiveInputs) -> ObjectiveTerms:
    c = x.config
    lr = clamp_log_ratio(x.log_probs - x.old_log_probs)
    ratio = torch.exp(lr)
    clipped = torch.clamp(ratio, 1.0 - c.clip_ratio_low, 1.0 + c.clip_ratio_high)
    loss = -clipped.detach() * x.advantages * x.log_probs
    return ObjectiveTerms(_weighted(loss, x.is_weights), (ratio != clipped).detach().double(), _zeros(x),
                          -lr.detach())


def sapo(x: ObjectiveInputs) -> ObjectiveTerms:
    c = x.config
    lr = clamp_log_ratio(x.log_probs - x.old_log_probs)
    ratio = torch.exp(lr)
    tau = torch.where(x.advantages > 0, torch.as_tensor(c.tau_pos, dtype=ratio.dtype, device=ratio.device),
                      torch.as_tensor(c.tau_neg, dtype=ratio.dtype, device=ratio.device))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return ObjectiveTerms(_weighted(-gates * x.advantages, x.is_weights), _zeros(x), _zeros(x), -lr.detach())


def _dppo(x: ObjectiveInputs, divergence: str) -> ObjectiveTerms:
    c = x.config
    lr = clamp_log_ratio(x.log_probs - x.old_log_probs)
    ratio = torch.exp(lr)
    cap = float("inf") if c.clip_ratio_c is None else c.clip_ratio_c
    truncated = torch.clamp(ratio, max=cap).detach()
    p, p_old = torch.exp(x.log_probs.detach()), torch.exp(x.old_log_probs)
    if divergence == "tv":
        inside_pos = (p - p_old) <= c.clip_ratio_high
        inside_neg = (p - p_old) >= -c.clip_ratio_low
    else:
        binary_kl = (p_old * (x.old_log_probs - x.log_probs.detach())
                     + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)))
        inside_pos = (binary_kl <= c.clip_ratio_high) | (p <= p_old)
        inside_neg = (binary_kl <= c.clip_ratio_low) | (p >= p_old)
    inside = torch.where(x.advantages > 0, inside_pos, inside_neg).detach().to(ratio.dtype)
    loss = -x.advantages * truncated * x.log_probs * inside
    lower = ((ratio.detach() > cap).to(ratio.dtype) * inside).double()
    return ObjectiveTerms(_weighted(loss, x.is_weights), (1.0 - inside).double(), lower, -lr.detach())


def dppo_tv(x: ObjectiveInputs) -> ObjectiveTerms:
    return _dppo(x, "tv")


def dppo_kl(x: ObjectiveInputs) -> ObjectiveTerms:
    return _dppo(x, "kl")


def dro(x: ObjectiveInputs) -> ObjectiveTerms:
    beta = x.config.dro_beta
    if beta is None:
        raise ValueError("actor.policy_loss.dro_beta must be set (> 0) with loss_type 'dro'")
    lr = x.log_probs - x.old_log_probs
    loss = -(x.log_probs * x.advantages - 0.5 * beta * lr.square())
    return ObjectiveTerms(_weighted(loss, x.is_weights), _zeros(x), _zeros(x), -lr.detach())


def _selected(x: ObjectiveInputs, loss_type: str) -> torch.Tensor:
    if x.token_select is not None:
        return x.token_select.detach() != 0
    return covariance_selection(loss_type, x.config, x.log_probs.detach(), x.old_log_probs, x.advantages,
                                x.valid, group=None)


def clip_cov(x: ObjectiveInputs) -> ObjectiveTerms:
    c = x.config
    loss, _, _, lr = ppo_clip_per_token(x.log_probs, x.old_log_probs, x.advantages, c.clip_ratio_low,
                                        c.clip_ratio_high, None)
    cut = _selected(x, "clip_cov") & x.valid
    loss = torch.where(cut, torch.zeros((), dtype=loss.dtype, device=loss.device), loss)
    return ObjectiveTerms(_weighted(loss, x.is_weights), cut.double(), _zeros(x), -lr)


def kl_cov(x: ObjectiveInputs) -> ObjectiveTerms:
    c = x.config
    lr = clamp_log_ratio(x.log_probs - x.old_log_probs)
    loss = -x.advantages * torch.exp(lr)
    chosen = _selected(x, "kl_cov") & x.valid
    loss = torch.where(chosen, loss + c.ppo_kl_coef * lr.abs(), loss)
    return ObjectiveTerms(_weighted(loss, x.is_weights), _zeros(x), _zeros(x), lr.detach().abs())

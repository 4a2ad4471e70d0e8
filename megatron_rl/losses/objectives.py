"""Token-local policy objectives: each maps (log pi_theta, log pi_old, A, IS weights) to a [B, T] loss.

Every function follows one function of verl 0.9.1's ``verl/trainer/ppo/core_algos.py`` (named below) on the
same tensors, including where the correction's IS weights w enter: the per-token loss is multiplied by w
after the objective (verl: ``pg_losses = pg_losses * rollout_is_weights``), and the rejection mask is the
response mask the loss aggregates over. Notation: lr = log pi_theta - log pi_old, r = exp(lr),
eps_lo / eps_hi = ``clip_ratio_low`` / ``clip_ratio_high``, c = ``clip_ratio_c``.

* ``ppo_clip`` / ``vanilla`` (``compute_policy_loss_vanilla``): max(-A r, -A clip(r, 1-eps_lo, 1+eps_hi)),
  dual-clip min(., -A c) for A < 0 (c=None: off); lr clamped at +-20.
* ``reinforce`` (``compute_policy_loss_reinforce``): -A w log pi_theta.
* ``cispo`` (``compute_policy_loss_cispo``): -sg(clip(r, 1-eps_lo, 1+eps_hi)) A log pi_theta;
  pg_clipfrac = fraction with r outside the clip range.
* ``sapo`` (``compute_policy_loss_sapo``): -A f(r), f(r) = sigmoid(tau (r - 1)) 4 / tau with tau = tau_pos for
  A > 0 else tau_neg; always aggregated "seq-mean-token-mean" (as verl, whatever loss_agg_mode says).
* ``dppo_tv`` / ``dppo_kl`` (``compute_policy_loss_dppo_tv`` / ``_dppo_kl``): -A sg(min(r, c)) log pi_theta
  on tokens inside the trust region (TV: p - p_old <= eps_hi for A > 0, >= -eps_lo otherwise; KL: binary KL
  of (p_old, p) <= eps_hi / eps_lo unless the update moves p away from the bound); pg_clipfrac = fraction
  outside, pg_clipfrac_lower = fraction inside with r > c. c=None: no truncation (verl reads 3.0 from its
  actor config unless set).
* ``gpg`` (``compute_policy_loss_gpg``): -A log pi_theta. verl reports no metric; here ppo_kl as usual.
* ``dro`` (``compute_policy_loss_dro``): -(A log pi_theta - beta/2 lr^2).
* ``clip_cov`` (``compute_policy_loss_clip_cov``): PPO-clip without dual-clip, with the gradient of the
  selected tokens cut (``selection.covariance_selection``); pg_clipfrac = fraction cut.
* ``kl_cov`` (``compute_policy_loss_kl_cov``): -A r, plus ppo_kl_coef |lr| on the selected tokens;
  ppo_kl = mean |lr| (verl's metric for this mode).

Ratios are exp of log-ratios clamped at +-20 everywhere (verl leaves them unclamped in gpg/dro/clip_cov/
kl_cov, where exp can overflow); identical for |lr| <= 20. Sequence-level objectives are in ``sequence.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from megatron_rl.numerics import clamp_log_ratio

from .config import PolicyLossConfig


@dataclass
class ObjectiveInputs:
    """Sanitised inputs of one micro-batch (masked positions hold 0; see ``validation.sanitize``)."""

    log_probs: torch.Tensor
    """[B, T] log pi_theta (requires grad)."""
    old_log_probs: torch.Tensor
    """[B, T] log pi_old (rollout log-probs in bypass mode), detached."""
    advantages: torch.Tensor
    """[B, T] advantages, detached."""
    is_weights: Optional[torch.Tensor]
    """[B, T] IS weights (detached) or None."""
    valid: torch.Tensor
    """[B, T] bool: the response mask after rejection."""
    config: PolicyLossConfig
    """Objective parameters."""
    seq_valid_tokens: Optional[torch.Tensor] = None
    """[B] valid tokens of each whole sequence (context parallel); None = counted from ``valid``."""
    cp_group: object = None
    """Context-parallel group the sequences are split over (None: whole sequences here)."""
    token_select: Optional[torch.Tensor] = None
    """[B, T] tokens chosen by the batch selection (clip_cov / kl_cov); None = select from this batch."""


@dataclass
class ObjectiveTerms:
    """Per-token pieces of one objective (all [B, T]; only valid positions are read)."""

    loss: torch.Tensor
    """Per-token loss, IS weights included."""
    clipfrac: torch.Tensor
    """Indicator whose valid-token mean is ``pg_clipfrac``."""
    clipfrac_lower: torch.Tensor
    """Indicator whose valid-token mean is ``pg_clipfrac_lower``."""
    kl: torch.Tensor
    """Per-token value whose valid-token mean is ``ppo_kl`` (detached)."""
    agg_mode: Optional[str] = None
    """Aggregation the objective imposes (None: ``config.loss_agg_mode``)."""
    extra: Dict[str, torch.Tensor] = field(default_factory=dict)
    """Further per-token metric indicators (valid-token means), e.g. ``opsm_clipfrac``."""


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
    return ObjectiveTerms(_weighted(-gates * x.advantages, x.is_weights), _zeros(x), _zeros(x), -lr.detach(),
                          agg_mode="seq-mean-token-mean")


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
    from .selection import covariance_selection
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


def _sequence(name: str) -> Callable[[ObjectiveInputs], ObjectiveTerms]:
    def run(x: ObjectiveInputs) -> ObjectiveTerms:
        from . import sequence
        return getattr(sequence, name)(x)
    return run


OBJECTIVES: Dict[str, Callable[[ObjectiveInputs], ObjectiveTerms]] = {
    "ppo_clip": vanilla, "vanilla": vanilla, "m2po": vanilla, "reinforce": reinforce, "gpg": gpg,
    "cispo": cispo, "sapo": sapo, "dppo_tv": dppo_tv, "dppo_kl": dppo_kl, "dro": dro,
    "clip_cov": clip_cov, "kl_cov": kl_cov,
    "gspo": _sequence("gspo"), "geo_mean": _sequence("geo_mean"), "opsm": _sequence("opsm"),
}
"""loss type -> objective. ``m2po`` is PPO-clip on the response mask its batch selection shrank."""

"""Policy losses: decoupled / bypass PPO-clip (with dual-clip) and REINFORCE, with IS weights.

Three policies take part: pi_rollout (SGLang, produced the tokens), pi_old (the trainer's
recomputed log-probs before this step's updates) and pi_theta (being optimised).

* Decoupled PPO-clip (``loss_type="ppo_clip"``, ``bypass_mode=False``): ratio r = pi_theta/pi_old =
  exp(clamp(logp - old_logp, -20, 20)); per-token loss l = max(-A*r, -A*clip(r, 1-eps_low, 1+eps_high));
  dual-clip (``clip_ratio_c`` = c > 1): for A < 0, l = min(l, -A*c). The correction's IS weights
  w = pi_old/pi_rollout (detached) multiply l AFTER clipping: l * w.
* Bypass PPO-clip (``bypass_mode=True``): old := rollout log-probs, so r = pi_theta/pi_rollout is the IS
  ratio already, clipped by PPO; the correction's weights are NOT applied (that would count the IS
  ratio twice). Its rejection mask still is.
* REINFORCE (``loss_type="reinforce"``): l = -A * w.detach() * logp (w = IS weights, 1 when None).
  In bypass mode w = pi_theta/pi_rollout (detached) from the correction.

The loss type is an argument, not a ``PolicyLossConfig`` field: its one owner is
``algorithm.rollout_correction.loss_type`` (it also decides whether the IS weights apply).
``select_loss_inputs`` is the one place that decides which old log-probs and weights each mode uses
(callers pass the correction's weights as they are); ``compute_policy_loss`` then computes the aggregated loss (plus the optional KL loss) and exactly reducible metrics:
``pg_clipfrac`` (tokens where the clipped branch is taken), ``pg_clipfrac_lower`` (A < 0 tokens where
the dual-clip cap is taken), ``ppo_kl`` (mean of old_logp - logp, log ratio clamped at +-20) and, with
a KL loss, ``kl_loss`` (token mean of the KL estimate). All means are over valid tokens (mask after
rejection sampling); REINFORCE reports clip fractions of 0.

Usage::

    old, w = select_loss_inputs(corr.loss_type, corr.bypass_mode, rollout_log_probs, old_log_probs, res.weights)
    den = global_denominators(all_micro_batch_masks, group=dp_group)
    out = compute_policy_loss(logp, old, advantages, res.response_mask, cfg, loss_type=corr.loss_type,
                              is_weights=w, denominators=den)
    out.loss.backward()
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from megatron_rl.numerics import clamp_log_ratio

from .aggregation import LossDenominators, aggregate_loss
from .config import PolicyLossConfig, check_loss_type
from .kl import kl_penalty
from .metrics import SumCount, sum_count
from .validation import check_float_dtypes, check_shapes, sanitize, validate_values


@dataclass
class PolicyLossOutput:
    """Result of ``compute_policy_loss``."""

    loss: torch.Tensor
    """Scalar to back-propagate: ``pg_loss + kl_loss_coef * kl_loss``."""

    pg_loss: torch.Tensor
    """Aggregated policy-gradient loss (scalar)."""

    kl_loss: Optional[torch.Tensor]
    """Aggregated KL loss (scalar, before the coefficient); None when ``kl_loss_coef == 0``."""

    metrics: Dict[str, SumCount]
    """"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl" (+ "kl_loss"): (sum, count) over valid tokens,
    to be merged over micro-batches / ranks with ``merge_metrics`` / ``reduce_metrics``."""


def select_loss_inputs(loss_type: str, bypass_mode: bool, rollout_log_probs: torch.Tensor,
                       old_log_probs: Optional[torch.Tensor], is_weights: Optional[torch.Tensor]
                       ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Which (old_log_probs, is_weights) the loss uses in each mode.

    * decoupled (``bypass_mode=False``): (recomputed ``old_log_probs``, correction weights
      pi_old/pi_rollout). ``old_log_probs`` is required.
    * bypass + ppo_clip: (``rollout_log_probs``, None) — the PPO ratio pi_theta/pi_rollout already is
      the IS ratio, so the correction's weights are dropped (only its rejection mask is used).
    * bypass + reinforce: (``rollout_log_probs``, correction weights pi_theta/pi_rollout); the old
      log-probs then only feed the ``ppo_kl`` metric.
    """
    check_loss_type(loss_type)
    if bypass_mode:
        return rollout_log_probs, (is_weights if loss_type == "reinforce" else None)
    if old_log_probs is None:
        raise ValueError("old_log_probs is None but bypass_mode=False: the decoupled loss needs the "
                         "trainer's recomputed log-probs (or set bypass_mode=True to use rollout_log_probs)")
    return old_log_probs, is_weights


def ppo_clip_per_token(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                       clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: Optional[float]
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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


def compute_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, config: PolicyLossConfig, *, loss_type: str,
                        is_weights: Optional[torch.Tensor] = None,
                        ref_log_probs: Optional[torch.Tensor] = None,
                        denominators: Optional[LossDenominators] = None,
                        seq_valid_tokens: Optional[torch.Tensor] = None) -> PolicyLossOutput:
    """Aggregated policy loss of one micro-batch, plus metrics.

    Args:
        log_probs: [B, T] log pi_theta of the sampled tokens (requires grad).
        old_log_probs: [B, T] log pi_old (decoupled) or rollout log-probs (bypass); detached.
            For REINFORCE only used by the ``ppo_kl`` metric.
        advantages: [B, T] advantages (detached).
        response_mask: [B, T] 0/1 or bool; the correction's mask AFTER rejection sampling / veto.
            Masked tokens leave both numerator and denominator; their values are never read.
        config: ``PolicyLossConfig`` (clip ratios, aggregation, KL loss).
        loss_type: "ppo_clip" or "reinforce" (``algorithm.rollout_correction.loss_type``).
        is_weights: [B, T] IS weights (detached, >= 0) or None; multiplied into the per-token loss
            after clipping. Use ``select_loss_inputs`` to get the right ones for the mode.
        ref_log_probs: [B, T] reference-policy log-probs; required when ``config.kl_loss_coef > 0``.
        denominators: global ``LossDenominators`` (see ``global_denominators``); None = this batch's.
        seq_valid_tokens: [B] full-sequence valid-token counts under context parallelism.
    Raises:
        ValueError: shape mismatch, non-float dtype, mask not 0/1, NaN/inf or positive log-probs or
            negative weights at valid positions — naming the tensor, count and first position.
    """
    if not isinstance(config, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    check_loss_type(loss_type)
    use_kl = config.kl_loss_coef > 0
    if use_kl and ref_log_probs is None:
        raise ValueError(f"ref_log_probs is required because PolicyLossConfig.kl_loss_coef="
                         f"{config.kl_loss_coef} > 0")
    tensors = {"old_log_probs": old_log_probs, "advantages": advantages, "response_mask": response_mask,
               "is_weights": is_weights, "ref_log_probs": ref_log_probs if use_kl else None}
    check_shapes("log_probs", log_probs, tensors)
    floats = {"log_probs": log_probs, **{k: v for k, v in tensors.items() if k != "response_mask"}}
    check_float_dtypes(floats)
    valid = validate_values(response_mask, floats,
                            log_prob_names=("log_probs", "old_log_probs", "ref_log_probs"),
                            nonnegative_names=("is_weights",))

    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    logp = sanitize(log_probs, valid, dtype)
    old = sanitize(old_log_probs.detach(), valid, dtype)
    adv = sanitize(advantages.detach(), valid, dtype)
    w = sanitize(None if is_weights is None else is_weights.detach(), valid, dtype)

    if loss_type == "ppo_clip":
        per_token, clipped, clipped_lower, log_ratio = ppo_clip_per_token(
            logp, old, adv, config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c)
        if w is not None:
            per_token = per_token * w
    else:
        per_token = reinforce_per_token(logp, adv, w)
        log_ratio = clamp_log_ratio(logp.detach() - old)
        clipped = clipped_lower = torch.zeros_like(valid)

    agg = dict(loss_scale_factor=config.loss_scale_factor, seq_valid_tokens=seq_valid_tokens)
    pg_loss = aggregate_loss(per_token, valid, config.loss_agg_mode, denominators, **agg)
    metrics = {
        "pg_clipfrac": sum_count(clipped.to(torch.float64), valid),
        "pg_clipfrac_lower": sum_count(clipped_lower.to(torch.float64), valid),
        "ppo_kl": sum_count(-log_ratio, valid),
    }
    kl_loss = None
    loss = pg_loss
    if use_kl:
        kl = kl_penalty(logp, sanitize(ref_log_probs.detach(), valid, dtype), config.kl_loss_type)
        kl_loss = aggregate_loss(kl, valid, config.loss_agg_mode, denominators, **agg)
        loss = pg_loss + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = sum_count(kl, valid)
    return PolicyLossOutput(loss=loss, pg_loss=pg_loss, kl_loss=kl_loss, metrics=metrics)

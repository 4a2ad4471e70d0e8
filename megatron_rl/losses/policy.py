"""Policy losses: every objective (``LOSS_TYPES``) composed with the rollout correction's IS weights and mask.

The objectives themselves are in ``objectives.py`` (token-local, verl's), ``sequence.py`` (GSPO, GMPO,
OPSM: per-sequence sums over the CP group) and ``selection.py`` (Clip-Cov / KL-Cov / M2PO batch
selections over the DP group); this module validates inputs, runs the objective and aggregates.

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
  In bypass mode w = pi_theta/pi_rollout (detached) of the current log-probs.
* Bypass mode, as verl 0.9.1's bypass loss: the weights and the rejection come from the CURRENT log-probs of each
  micro-batch (``megatron_rl.correction.correct_in_loss``, called by the actor's loss), given here as
  ``is_weights`` and ``pg_mask``: the rejection removes tokens from the policy term only; the denominators, the
  entropy bonus and the KL loss keep ``response_mask`` (the mask before rejection).

The loss type is an argument, not a ``PolicyLossConfig`` field: its one owner is
``algorithm.rollout_correction.loss_type`` (it also decides whether the IS weights apply).
``select_loss_inputs`` is the one place that decides which old log-probs and weights each mode uses
(callers pass the correction's weights as they are); ``compute_policy_loss`` then computes the aggregated loss (plus the optional KL loss) and exactly reducible metrics:
``pg_clipfrac`` (tokens where the clipped branch is taken), ``pg_clipfrac_lower`` (A < 0 tokens where
the dual-clip cap is taken), ``ppo_kl`` (mean of old_logp - logp, log ratio clamped at +-20) and, with
a KL loss, ``kl_loss`` (token mean of the KL estimate). All means are over valid tokens (mask after
rejection sampling); REINFORCE reports clip fractions of 0. Every other objective reports the same three
metrics with its own meaning (``objectives.py``), plus ``opsm_clipfrac`` for opsm.
* Entropy bonus (``entropy_coeff``, verl's): ``- entropy_coeff * entropy_loss``, the entropy of every valid
  token aggregated with ``loss_agg_mode`` and the same global denominators as the policy loss.
* Other loss types in decoupled mode use (old log-probs, IS weights) like PPO-clip; bypass mode accepts
  ppo_clip / vanilla / reinforce only (verl's ``bypass_mode`` loss replaces any ``loss_mode``).

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

from .aggregation import LossDenominators, aggregate_loss
from .config import BYPASS_LOSS_TYPES, PolicyLossConfig, check_loss_type
from .kl import kl_penalty
from .metrics import SumCount, sum_count
from .objectives import OBJECTIVES, ObjectiveInputs, ppo_clip_per_token, reinforce_per_token  # noqa: F401
from .validation import check_float_dtypes, check_shapes, sanitize, validate_values


@dataclass
class PolicyLossOutput:
    """Result of ``compute_policy_loss``."""

    loss: torch.Tensor
    """Scalar to back-propagate: ``pg_loss + kl_loss_coef * kl_loss - entropy_coeff * entropy_loss``."""

    pg_loss: torch.Tensor
    """Aggregated policy-gradient loss (scalar)."""

    kl_loss: Optional[torch.Tensor]
    """Aggregated KL loss (scalar, before the coefficient); None when ``kl_loss_coef == 0``."""

    metrics: Dict[str, SumCount]
    """"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl" (+ "kl_loss"): (sum, count) over valid tokens,
    to be merged over micro-batches / ranks with ``merge_metrics`` / ``reduce_metrics``."""

    entropy_loss: Optional[torch.Tensor] = None
    """Aggregated entropy (scalar, before the coefficient; verl's ``entropy_loss``); None when
    ``entropy_coeff == 0``."""


def loss_input_sources(loss_type: str, bypass_mode: bool) -> Tuple[bool, bool]:
    """(the old policy is the rollout's log-probs, the loss applies the correction's IS weights) in each mode
    (``select_loss_inputs``); ``ValueError`` for a loss type bypass mode does not run."""
    check_loss_type(loss_type)
    if not bypass_mode:
        return False, True
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} with bypass_mode=True: bypass mode runs "
                         f"{', '.join(BYPASS_LOSS_TYPES)} only (verl's bypass_mode loss replaces loss_mode)")
    return True, loss_type == "reinforce"


def select_loss_inputs(loss_type: str, bypass_mode: bool, rollout_log_probs: torch.Tensor,
                       old_log_probs: Optional[torch.Tensor], is_weights: Optional[torch.Tensor]
                       ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Which (old_log_probs, is_weights) the loss uses in each mode.

    * decoupled (``bypass_mode=False``): (recomputed ``old_log_probs``, correction weights
      pi_old/pi_rollout). ``old_log_probs`` is required.
    * bypass + ppo_clip: (``rollout_log_probs``, None) — the PPO ratio pi_theta/pi_rollout already is
      the IS ratio, so the correction's weights are dropped (only its rejection mask is used).
    * bypass + reinforce: (``rollout_log_probs``, correction weights pi_theta/pi_rollout); the old
      log-probs then only feed the ``ppo_kl`` metric. The weights (and ``pg_mask``) must be those of the
      current log-probs (``correction.correct_in_loss`` in each micro-batch, verl's bypass loss).
    """
    from_rollout, weighted = loss_input_sources(loss_type, bypass_mode)
    if from_rollout:
        return rollout_log_probs, (is_weights if weighted else None)
    if old_log_probs is None:
        raise ValueError("old_log_probs is None but bypass_mode=False: the decoupled loss needs the "
                         "trainer's recomputed log-probs (or set bypass_mode=True to use rollout_log_probs)")
    return old_log_probs, is_weights


def compute_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, config: PolicyLossConfig, *, loss_type: str,
                        is_weights: Optional[torch.Tensor] = None,
                        ref_log_probs: Optional[torch.Tensor] = None,
                        denominators: Optional[LossDenominators] = None,
                        seq_valid_tokens: Optional[torch.Tensor] = None,
                        cp_group=None, token_select: Optional[torch.Tensor] = None,
                        entropy: Optional[torch.Tensor] = None, pg_mask: Optional[torch.Tensor] = None,
                        pg_seq_valid_tokens: Optional[torch.Tensor] = None) -> PolicyLossOutput:
    """Aggregated policy loss of one micro-batch, plus metrics.

    Args:
        log_probs: [B, T] log pi_theta of the sampled tokens (requires grad).
        old_log_probs: [B, T] log pi_old (decoupled) or rollout log-probs (bypass); detached.
            For REINFORCE only used by the ``ppo_kl`` metric.
        advantages: [B, T] advantages (detached).
        response_mask: [B, T] 0/1 or bool; the correction's mask AFTER rejection sampling / veto.
            Masked tokens leave both numerator and denominator; their values are never read.
        config: ``PolicyLossConfig`` (clip ratios, objective parameters, aggregation, KL loss).
        loss_type: one of ``LOSS_TYPES`` (``algorithm.rollout_correction.loss_type``).
        is_weights: [B, T] IS weights (detached, >= 0) or None; multiplied into the per-token loss
            after the objective. Use ``select_loss_inputs`` to get the right ones for the mode.
        ref_log_probs: [B, T] reference-policy log-probs; required when ``config.kl_loss_coef > 0``.
        denominators: global ``LossDenominators`` (see ``global_denominators``); None = this batch's.
        seq_valid_tokens: [B] full-sequence valid-token counts under context parallelism.
        cp_group: the context-parallel group the sequences are split over (gspo / geo_mean / opsm sum
            per-sequence values over it); None = whole sequences on this rank.
        token_select: [B, T] 0/1 batch selection of clip_cov / kl_cov (``selection.batch_selection``);
            None = selected inside this batch from the current log-probs (verl's per-micro-batch way).
        entropy: [B, T] entropy of pi_theta at each token (differentiable; from the same pass as
            ``log_probs``); required when ``config.entropy_coeff != 0``, unused otherwise.
        pg_mask: [B, T] 0/1 or bool: the tokens of the policy term when a rejection inside the loss removed some of
            ``response_mask``'s (bypass mode: ``LossCorrection.keep``); the policy term's numerator and its metrics
            (pg_clipfrac, ppo_kl, ...) use it, the denominators, the KL loss and the entropy bonus keep
            ``response_mask`` (verl 0.9.1). None: ``response_mask``.
        pg_seq_valid_tokens: [B] whole-sequence tokens of ``pg_mask`` (context parallel; seq-mean-token-mean's
            divisor); None with ``pg_mask``: counted from it.
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
    use_entropy = config.entropy_coeff != 0
    if use_entropy and entropy is None:
        raise ValueError(f"entropy is required because PolicyLossConfig.entropy_coeff={config.entropy_coeff} != 0")
    tensors = {"old_log_probs": old_log_probs, "advantages": advantages, "response_mask": response_mask,
               "is_weights": is_weights, "ref_log_probs": ref_log_probs if use_kl else None,
               "token_select": token_select, "entropy": entropy if use_entropy else None}
    check_shapes("log_probs", log_probs, tensors)
    floats = {"log_probs": log_probs, **{k: v for k, v in tensors.items()
                                         if k not in ("response_mask", "token_select")}}
    check_float_dtypes(floats)
    valid = validate_values(response_mask, floats,
                            log_prob_names=("log_probs", "old_log_probs", "ref_log_probs"),
                            nonnegative_names=("is_weights",))
    pg_valid, pg_svt = valid, seq_valid_tokens
    if pg_mask is not None:
        check_shapes("log_probs", log_probs, {"pg_mask": pg_mask})
        pg_valid, pg_svt = valid & (pg_mask != 0), pg_seq_valid_tokens

    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    logp = sanitize(log_probs, valid, dtype)
    inputs = ObjectiveInputs(
        log_probs=logp, old_log_probs=sanitize(old_log_probs.detach(), valid, dtype),
        advantages=sanitize(advantages.detach(), valid, dtype),
        is_weights=sanitize(None if is_weights is None else is_weights.detach(), valid, dtype),
        valid=pg_valid, config=config, seq_valid_tokens=pg_svt, cp_group=cp_group,
        token_select=None if token_select is None else token_select.detach())
    terms = OBJECTIVES[loss_type](inputs)

    agg = dict(loss_scale_factor=config.loss_scale_factor, seq_valid_tokens=seq_valid_tokens)
    pg_mode = terms.agg_mode or config.pg_loss_agg_mode or config.loss_agg_mode  # objective's own, then the pg term's
    pg_loss = aggregate_loss(terms.loss, pg_valid, pg_mode, denominators,
                             loss_scale_factor=config.loss_scale_factor, seq_valid_tokens=pg_svt)
    metrics = {
        "pg_clipfrac": sum_count(terms.clipfrac, pg_valid),
        "pg_clipfrac_lower": sum_count(terms.clipfrac_lower, pg_valid),
        "ppo_kl": sum_count(terms.kl, pg_valid),
    }
    metrics.update({k: sum_count(v, pg_valid) for k, v in terms.extra.items()})
    kl_loss = None
    loss = pg_loss
    if use_kl:
        kl = kl_penalty(logp, sanitize(ref_log_probs.detach(), valid, dtype), config.kl_loss_type)
        kl_loss = aggregate_loss(kl, valid, config.loss_agg_mode, denominators, **agg)
        loss = pg_loss + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = sum_count(kl, valid)
    entropy_loss = None
    if use_entropy:  # verl: pg_loss - entropy_coeff * agg_loss(entropy, mask, loss_agg_mode)
        entropy_loss = aggregate_loss(sanitize(entropy, valid, dtype), valid, config.loss_agg_mode, denominators,
                                      **agg)
        loss = loss - config.entropy_coeff * entropy_loss
    return PolicyLossOutput(loss=loss, pg_loss=pg_loss, kl_loss=kl_loss, metrics=metrics, entropy_loss=entropy_loss)

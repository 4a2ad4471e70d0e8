"""The job's policy loss (``PolicyLoss``: an objective's row, its settings, the mode) and ``compute_policy_loss``.

``build_policy_loss`` builds it once from the job's sections and the objective's row;
``compute_policy_loss(loss, batch)`` validates one micro-batch's tensors (``LossBatch``), runs the objective's term
function, composes it with the correction's IS weights and masks, aggregates with global denominators and adds
the optional KL loss and entropy bonus. The one rule: the rejection inside the loss (``pg_mask``, bypass mode)
removes tokens from the policy term only; the denominators, the KL loss and the entropy bonus keep
``response_mask`` (verl 0.9.1). Metrics are (sum, count) pairs over the policy term's tokens: ``pg_clipfrac``,
``pg_clipfrac_lower``, ``ppo_kl`` (+ ``kl_loss``, ``opsm_clipfrac``). See docs/objectives.md.

Usage::

    loss = build_policy_loss(cfg.actor.policy_loss, corr.objective, corr.bypass_mode, response_budget)
    old, w = loss.loss_inputs(rollout_log_probs, old_log_probs, res.weights)
    out = compute_policy_loss(loss, LossBatch(logp, old, advantages, mask, is_weights=w, denominators=den))
    out.loss.backward()
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .aggregation import LossDenominators, aggregate_loss, with_norm_divisor
from .config import PolicyLossConfig
from .kl import kl_penalty
from .metrics import SumCount, sum_count
from .registry import Objective, objective
from .selection import Selected
from .terms import ObjectiveInputs
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


@dataclass(frozen=True)
class PolicyLoss:
    """The job's policy loss, built once (``build_policy_loss``) and handed to the actor."""

    objective: Objective
    """The objective's row (``registry.OBJECTIVES``)."""

    config: PolicyLossConfig
    """Its settings (``actor.policy_loss``)."""

    bypass_mode: bool = False
    """``algorithm.rollout_correction.bypass_mode``: the old policy is the rollout's log-probs."""

    def __post_init__(self) -> None:
        if not isinstance(self.objective, Objective):
            raise ValueError(f"objective must be an Objective row, got {type(self.objective).__name__}")
        if not isinstance(self.config, PolicyLossConfig):
            raise ValueError(f"config must be a PolicyLossConfig, got {type(self.config).__name__}")
        self.objective.check_bypass(self.bypass_mode)
        for p in self.objective.required:
            if getattr(self.config, p.name) is None:
                raise ValueError(f"actor.policy_loss.{p.name} must be set ({p.rule}) with loss_type "
                                 f"{self.objective.name!r}")

    @classmethod
    def of(cls, loss_type: str, config: PolicyLossConfig, bypass_mode: bool = False) -> "PolicyLoss":
        """The loss of ``loss_type``'s row (ValueError with the nearest name) without the job's checks of
        ``build_policy_loss`` (tests, tools)."""
        return cls(objective(loss_type), config, bypass_mode)

    @property
    def applies_is_weights(self) -> bool:
        """The loss multiplies the correction's IS weights into its per-token loss."""
        return self.objective.applies_is_weights(self.bypass_mode)

    def summary(self) -> str:
        """One line naming the objective, its mode and the parameters it reads (``Objective.summary``)."""
        return self.objective.summary(self.bypass_mode, self.config)

    def loss_inputs(self, rollout_log_probs: torch.Tensor, old_log_probs: Optional[torch.Tensor],
                    is_weights: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(old log-probs, IS weights) the loss uses in its mode (``Objective.loss_inputs``)."""
        return self.objective.loss_inputs(self.bypass_mode, rollout_log_probs, old_log_probs, is_weights)

    def select(self, old_log_probs: torch.Tensor, rollout_log_probs: Optional[torch.Tensor],
               advantages: torch.Tensor, response_mask: torch.Tensor, group=None) -> Selected:
        """The training step's batch selection (``Objective.select``)."""
        return self.objective.select(self.config, old_log_probs, rollout_log_probs, advantages, response_mask, group)

    def parameter_errors(self) -> List[str]:
        """Parameters set that the objective does not read, required ones unset (``Objective.parameter_errors``),
        each naming its ``actor.policy_loss`` key: what the job's validation reports."""
        return self.objective.parameter_errors(self.config)

    def summary(self) -> str:
        """One line naming the objective, its mode and its parameters (``Objective.summary``)."""
        return self.objective.summary(self.bypass_mode, self.config)


def build_policy_loss(config: PolicyLossConfig, row: Objective, bypass_mode: bool = False,
                      response_budget: Optional[int] = None) -> PolicyLoss:
    """The job's ``PolicyLoss`` from ``actor.policy_loss`` and ``algorithm.rollout_correction``'s objective row (its
    ``loss_type``, looked up once when that section is read: ``RolloutCorrectionConfig.objective``) and
    ``bypass_mode``; ``response_budget`` (the most response tokens a row holds) sets the seq-mean-token-sum-norm
    divisor when it is not configured (``with_norm_divisor``). ValueError for an objective bypass mode does not run
    or a required parameter unset. A parameter set that the objective does not read is not refused here (it changes
    nothing): validation reports it (``PolicyLoss.parameter_errors``)."""
    if response_budget is not None:
        config = with_norm_divisor(config, response_budget)
    return PolicyLoss(row, config, bypass_mode)


@dataclass
class LossBatch:
    """One micro-batch's tensors of the policy loss ([B, T] unless said; all but ``log_probs`` / ``entropy``
    are detached by the loss)."""

    log_probs: torch.Tensor
    """log pi_theta of the sampled tokens (requires grad)."""

    old_log_probs: torch.Tensor
    """log pi_old (decoupled) or the rollout log-probs (bypass) -- ``PolicyLoss.loss_inputs``. For REINFORCE only
    the ``ppo_kl`` metric reads them."""

    advantages: torch.Tensor
    """Advantages."""

    response_mask: torch.Tensor
    """0/1 or bool; the correction's mask AFTER rejection sampling / veto (bypass: before the loss's own
    rejection). Masked tokens leave both numerator and denominator; their values are never read."""

    is_weights: Optional[torch.Tensor] = None
    """IS weights (>= 0) or None, multiplied into the per-token loss after the objective
    (``PolicyLoss.loss_inputs`` gives the right ones for the mode)."""

    ref_log_probs: Optional[torch.Tensor] = None
    """Reference-policy log-probs; required when ``config.kl_loss_coef > 0``."""

    denominators: Optional[LossDenominators] = None
    """Global ``LossDenominators`` (``global_denominators``); None = this batch's."""

    seq_valid_tokens: Optional[torch.Tensor] = None
    """[B] whole-sequence valid-token counts under context parallelism."""

    cp_group: object = None
    """The context-parallel group the sequences are split over (per-sequence sums of gspo / geo_mean / opsm);
    None = whole sequences on this rank."""

    token_select: Optional[torch.Tensor] = None
    """0/1 batch selection of clip_cov / kl_cov (``PolicyLoss.select``); None = selected inside this batch from
    the current log-probs (verl's per-micro-batch way)."""

    entropy: Optional[torch.Tensor] = None
    """Entropy of pi_theta at each token (differentiable; the same pass as ``log_probs``); required when
    ``config.entropy_coeff != 0``."""

    pg_mask: Optional[torch.Tensor] = None
    """0/1 or bool: the policy term's tokens when a rejection inside the loss removed some of ``response_mask``'s
    (bypass mode: ``LossCorrection.keep``); its numerator and metrics use it. None: ``response_mask``."""

    pg_seq_valid_tokens: Optional[torch.Tensor] = None
    """[B] whole-sequence tokens of ``pg_mask`` (context parallel; seq-mean-token-mean's divisor); None with
    ``pg_mask``: counted from it."""


def compute_policy_loss(loss: PolicyLoss, batch: LossBatch) -> PolicyLossOutput:
    """Aggregated policy loss of one micro-batch, plus metrics.

    Raises:
        ValueError: shape mismatch, non-float dtype, mask not 0/1, NaN/inf or positive log-probs or
            negative weights at valid positions -- naming the tensor, count and first position; a required
            tensor (ref_log_probs, entropy) missing.
    """
    if not isinstance(loss, PolicyLoss) or not isinstance(batch, LossBatch):
        raise ValueError(f"compute_policy_loss takes a PolicyLoss and a LossBatch, got {type(loss).__name__} and "
                         f"{type(batch).__name__}")
    config, b = loss.config, batch
    log_probs, old_log_probs, advantages, response_mask = b.log_probs, b.old_log_probs, b.advantages, b.response_mask
    is_weights, ref_log_probs, entropy, pg_mask = b.is_weights, b.ref_log_probs, b.entropy, b.pg_mask
    token_select, denominators, seq_valid_tokens = b.token_select, b.denominators, b.seq_valid_tokens
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
        pg_valid, pg_svt = valid & (pg_mask != 0), b.pg_seq_valid_tokens

    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    logp = sanitize(log_probs, valid, dtype)
    inputs = ObjectiveInputs(
        log_probs=logp, old_log_probs=sanitize(old_log_probs.detach(), valid, dtype),
        advantages=sanitize(advantages.detach(), valid, dtype),
        is_weights=sanitize(None if is_weights is None else is_weights.detach(), valid, dtype),
        valid=pg_valid, config=config, seq_valid_tokens=pg_svt, cp_group=b.cp_group,
        token_select=None if token_select is None else token_select.detach())
    terms = loss.objective.terms(inputs)

    agg = dict(loss_scale_factor=config.loss_scale_factor, seq_valid_tokens=seq_valid_tokens)
    pg_mode = loss.objective.aggregation or config.pg_loss_agg_mode or config.loss_agg_mode  # the objective's own first
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

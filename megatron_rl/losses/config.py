"""Typed configuration of the policy loss (``PolicyLossConfig``), validated on construction.

Names and defaults follow verl 0.9.1's actor config and its ``actor.policy_loss`` block, plus slime's
``opsm_delta`` and AReaL's ``m2_threshold``; all live under ``actor.policy_loss`` here. One addition:
``clip_ratio_c=None`` disables dual-clip (verl always applies it). The objective parameters' ranges are the
rows of ``params.py``.

The loss type is not a field here: its one owner is ``algorithm.rollout_correction.loss_type``, because it
also decides which IS weights apply; which objective reads which parameter is said by the objective's row
(``megatron_rl.losses.registry``). See docs/objectives.md.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .params import PARAMETERS

MOVED_KEYS = {"loss_type": "algorithm.rollout_correction.loss_type",
              "loss_mode": "algorithm.rollout_correction.loss_type"}
"""Keys users put under ``actor.policy_loss`` that live elsewhere (the key's one owner)."""

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Valid loss aggregation modes (verl's names); see ``megatron_rl.losses.aggregation``."""

# Every name verl's kl_penalty accepts (the "+" variants use the k2 gradient, see kl.py).
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
            "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+")
"""Valid KL estimator names; see ``megatron_rl.losses.kl.kl_penalty``."""


def _finite_number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"PolicyLossConfig.{key} must be a finite number, got {value!r}")
    return float(value)


def choice(key: str, value: Any, choices) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``, naming ``key`` and the nearest choice."""
    if value not in choices:
        prefixed = [c for c in choices if str(c).startswith(str(value))] if str(value) else []
        near = prefixed[:1] or difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.4)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}{hint}")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the per-token policy loss, its aggregation, the optional KL loss and entropy bonus."""

    clip_ratio_low: float = 0.2
    """Lower clip: the ratio is clipped below at 1 - clip_ratio_low (ppo_clip, gspo, cispo, clip_cov, opsm, m2po;
    the lower divergence bound of dppo_tv / dppo_kl, the log-ratio bound of geo_mean). >= 0, as verl reads it
    (it checks no range): with a ratio objective a value >= 1 means no lower clip -- verl's CISPO recipes set 10."""

    clip_ratio_high: float = 0.2
    """PPO upper clip: the ratio is clipped above at 1 + clip_ratio_high. >= 0 (DAPO's
    clip-higher uses e.g. 0.28)."""

    clip_ratio_c: Optional[float] = 3.0
    """Dual-clip constant c > 1 (Ye et al. 2019): for A < 0 the per-token loss is capped at -A*c.
    None disables dual-clip. verl's default is 3.0."""

    loss_agg_mode: str = "token-mean"
    """How per-token losses become a scalar: one of ``LOSS_AGG_MODES``."""

    pg_loss_agg_mode: Optional[str] = None
    """The policy-gradient term's aggregation alone, when it differs from ``loss_agg_mode`` (which the KL loss
    and the entropy bonus keep): verl main (after 0.9.1) aggregates GSPO's "seq-mean-token-mean" whatever
    loss_agg_mode says, and ``migrate verl`` writes that here. null: ``loss_agg_mode``. An objective with its own
    aggregation (sapo, geo_mean) keeps it."""

    loss_scale_factor: Optional[float] = None
    """Only for "seq-mean-token-sum-norm": the constant the per-sequence token sums are divided by
    (verl's ``loss_scale_factor``). None means verl's default, the width of its response mask = the
    configured response budget: the actor uses ``rollout.max_new_tokens`` (multi-turn:
    ``multi_turn.max_total_tokens``), a constant of the config that does not move with prompt lengths."""

    tau_pos: float = 1.0
    """SAPO (``sapo``): temperature of the gate for A > 0, f(r) = sigmoid(tau (r - 1)) * 4 / tau. > 0;
    verl's default 1.0."""

    tau_neg: float = 1.05
    """SAPO: temperature of the gate for A <= 0. > 0; verl's default 1.05."""

    clip_cov_ratio: float = 0.0002
    """Clip-Cov (``clip_cov``): fraction of the batch's valid tokens whose gradient is cut, chosen at random
    among tokens with covariance in (clip_cov_lb, clip_cov_ub). In (0, 1]; verl's default 0.0002."""

    clip_cov_lb: float = 1.0
    """Clip-Cov: lower covariance bound of the candidates (verl's default 1.0)."""

    clip_cov_ub: float = 5.0
    """Clip-Cov: upper covariance bound of the candidates (> clip_cov_lb; verl's default 5.0)."""

    clip_cov_seed: int = 0
    """Clip-Cov: seed of the random choice among candidates (a hash of each token's values, the same on
    every rank and layout; verl draws ``torch.randperm`` from the global RNG)."""

    kl_cov_ratio: float = 0.0002
    """KL-Cov (``kl_cov``): fraction of the batch's valid tokens (those with the largest covariance) that
    get the |log ratio| penalty. In (0, 1]; verl's default 0.0002."""

    ppo_kl_coef: float = 0.1
    """KL-Cov: coefficient of the |log ratio| penalty (>= 0; verl's default 0.1)."""

    dro_beta: Optional[float] = None
    """DRO (``dro``): coefficient of the quadratic log-ratio penalty 0.5 * beta * (log r)^2. Required
    (> 0) with loss_type dro; verl has no default either."""

    opsm_delta: float = 1e-4
    """OPSM (``opsm``, slime's ``--opsm-delta``): a sequence whose mean log(pi_old / pi_theta) exceeds it
    has its negative-advantage tokens masked. >= 0; slime's default 1e-4."""

    m2_threshold: Optional[float] = None
    """M2PO (``m2po``, AReaL's ``m2_threshold``): the batch's tokens with the largest
    (log pi_old - log pi_rollout)^2 are masked until the mean of the rest is below it. Required (> 0)
    with loss_type m2po."""

    kl_loss_coef: float = 0.0
    """Coefficient of the KL(pi_theta || pi_ref) loss added to the policy loss; 0 disables it
    (then ``ref_log_probs`` is not needed). verl's ``use_kl_loss``/``kl_loss_coef``."""

    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss: one of ``KL_TYPES`` ("low_var_kl" = k3, "k3+" = k3 value with
    k2 gradient, ...). Aggregated with ``loss_agg_mode`` like the policy loss."""

    entropy_coeff: float = 0.0
    """Entropy bonus (verl's ``actor.entropy_coeff``): the loss is ``pg_loss - entropy_coeff * entropy_loss``,
    ``entropy_loss`` the entropy of softmax(logits / T) at each valid token aggregated with ``loss_agg_mode``
    like the policy loss (metric ``actor/entropy_loss``). 0 disables it; a negative value penalises entropy."""

    def __post_init__(self) -> None:
        choice("PolicyLossConfig.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        choice("PolicyLossConfig.kl_loss_type", self.kl_loss_type, KL_TYPES)
        if self.pg_loss_agg_mode is not None:
            choice("PolicyLossConfig.pg_loss_agg_mode", self.pg_loss_agg_mode, LOSS_AGG_MODES)
        for param in PARAMETERS:
            param.check(getattr(self, param.name))
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"PolicyLossConfig.clip_cov_lb ({self.clip_cov_lb!r}) must be < clip_cov_ub "
                             f"({self.clip_cov_ub!r})")
        if self.loss_scale_factor is not None:
            f = _finite_number("loss_scale_factor", self.loss_scale_factor)
            if f <= 0:
                raise ValueError(f"PolicyLossConfig.loss_scale_factor must be > 0, got {self.loss_scale_factor!r}")
        _finite_number("entropy_coeff", self.entropy_coeff)
        coef = _finite_number("kl_loss_coef", self.kl_loss_coef)
        if coef < 0:
            raise ValueError(f"PolicyLossConfig.kl_loss_coef must be >= 0, got {self.kl_loss_coef!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PolicyLossConfig":
        """Build from a flat mapping. Accepts verl's ``clip_ratio`` (sets low and high unless they
        are given) and ``use_kl_loss`` (False forces ``kl_loss_coef=0``); a key of ``MOVED_KEYS``
        (``loss_type``) raises ValueError naming its owner; other unknown keys raise ValueError naming
        the key and the nearest valid one."""
        d = dict(d)
        for k, owner in MOVED_KEYS.items():
            if k in d:
                raise ValueError(f"{k}: not a policy_loss setting; it has one owner, {owner} "
                                 f"(move actor.policy_loss.{k}: {d[k]!r} to {owner})")
        fields = [f.name for f in dataclasses.fields(cls)]
        clip = d.pop("clip_ratio", None)
        if clip is not None:
            for k in ("clip_ratio_low", "clip_ratio_high"):
                if d.get(k) is None:
                    d[k] = clip
        use_kl = d.pop("use_kl_loss", None)
        if use_kl is False:
            d["kl_loss_coef"] = 0.0
        for k in d:
            if k not in fields:
                near = difflib.get_close_matches(k, fields + ["clip_ratio", "use_kl_loss"], n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ValueError(f"PolicyLossConfig: unknown key {k!r}{hint}")
        d = {k: v for k, v in d.items() if not (v is None and k in ("clip_ratio_low", "clip_ratio_high"))}
        return cls(**d)

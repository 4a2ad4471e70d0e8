"""``RolloutCorrectionConfig``: typed settings of the rollout-correction step, presets, verl migration.

Vocabulary follows verl's latest ``algorithm.rollout_correction`` block so configs can be pasted
between the two; :meth:`RolloutCorrectionConfig.from_dict` also accepts the seed-era flat keys
(``rollout_is_level``, ``rollout_is_mode``, ...), see :mod:`megatron_rl.correction.migration`.

Differences from verl, on purpose:
  * ``rollout_is`` defaults to ``None`` (metrics only); verl's dataclass defaults to ``"sequence"``.
  * ``"geometric"`` IS level (exp of the masked mean log-ratio) is kept from the seed era.
  * k1 RS bounds apply to r = pi_train / pi_rollout (verl: to 1/r); identical for symmetric specs.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from megatron_rl.correction.migration import translate
from megatron_rl.correction.thresholds import (
    KPOP_PHI_DEFAULT, ISBounds, RSBound, parse_is_threshold, parse_rs_options, parse_rs_thresholds,
)
from megatron_rl.losses.registry import BYPASS_LOSS_TYPES, Objective, objective
from megatron_rl.numerics import LOG_RATIO_CLAMP

IS_LEVELS = ("token", "sequence", "geometric")
ON_INVALID = ("raise", "reject")


@dataclass
class RolloutCorrectionConfig:
    """Settings of the rollout-vs-training mismatch correction (IS weights, rejection, veto)."""

    rollout_is: Optional[str] = None
    """IS weight level: None (no weights; metrics only), "token" (w_t = r_t), "sequence"
    (w = prod_t r_t = exp(sum_t log r_t), broadcast to the sequence's tokens) or "geometric"
    (w = exp(mean_t log r_t), the length-normalised sequence ratio)."""

    rollout_is_threshold: Union[float, str] = 2.0
    """A number C: truncate (TIS), w = min(w, C). A string "lo_hi": mask (MIS / IcePop), weights
    outside [lo, hi] become 0 (the token stays in the loss's denominator)."""

    rollout_is_batch_normalize: bool = False
    """Divide the weights by their global-batch mean after truncation: the token-weighted mean for
    "token", the mean over sequences of the per-sequence weight for "sequence"/"geometric". The mean
    is taken over the tokens / sequences that survive rejection (verl uses the pre-rejection mask),
    so the weights the loss sees average to exactly 1. Skipped (factor reported as 1) if <= 1e-8. Bypass mode
    (weights computed in the loss): the mean over each micro-batch's kept tokens / sequences on its DP rank."""

    rollout_rs: Optional[str] = None
    """Rejection sampling: None or a comma list, AND-combined, of token_k1/k2/k3,
    seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3, binary_kl. k1 = -log r, k2 = (log r)^2 / 2,
    k3 = r - 1 - log r (log r clamped at +-20); seq_* options reduce over the sequence and reject
    (or keep) the whole sequence; binary_kl (KPop, token level) rejects a token whose
    max(D(p||q), D(q||p)) exceeds its threshold, D the binary KL of p = pi_train, q = pi_rollout."""

    rollout_rs_threshold: Optional[Union[float, str]] = None
    """One spec shared by all RS options or a comma list with one per option. k1: "lo_hi" bounds on
    the ratio r (a number U means [1/U, U]); k2/k3/binary_kl: a positive upper bound on the statistic
    (binary_kl alone with null: phi = 2.0, AReaL's default; docs/correction.md)."""

    rollout_token_veto_threshold: Optional[float] = None
    """None or a float in (0, 1): a valid token with r below it rejects its whole sequence."""

    bypass_mode: bool = False
    """True: reuse the rollout log-probs as the old policy (2 policies; no old-log-prob recompute); as verl's
    bypass loss, the IS weights and the rejection are computed from the current log-probs in every micro-batch
    (exact over several optimizer steps per training step); rollout_corr/* metrics are the step's first pass.
    False (decoupled): old log-probs are recomputed by the trainer and the IS weights correct the
    rollout -> old gap."""

    loss_type: str = "ppo_clip"
    """The policy objective, one of ``megatron_rl.losses.LOSS_TYPES``: "ppo_clip" (= verl's "vanilla";
    clipped surrogate; in bypass mode the PPO ratio pi_theta / pi_rollout already is the IS correction, so
    explicit weights are not applied), "reinforce" (policy gradient with explicit detached IS weights, no
    clipping), verl's loss modes "gspo", "geo_mean", "cispo", "sapo", "dppo_tv", "dppo_kl", "gpg",
    "clip_cov", "kl_cov", "dro", and "opsm" (slime) / "m2po" (AReaL); their parameters live in
    actor.policy_loss. Bypass mode takes ppo_clip / vanilla / reinforce only. The one place the loss type
    is set (verl's actor.policy_loss.loss_mode is moved here when a config is loaded)."""

    on_invalid: str = "raise"
    """What to do with NaN / inf / positive (> 1e-3) log-probs on valid tokens: "raise" a ValueError
    naming tensor, count and first position (on every rank of the group, so no rank hangs), or
    "reject" the affected sequences and count them in rollout_corr/invalid_seq_count."""

    # Parsed forms, filled by validation (not user settings).
    is_bounds: Optional[ISBounds] = field(default=None, init=False, repr=False, compare=False)
    rs_options: List[str] = field(default_factory=list, init=False, repr=False, compare=False)
    rs_bounds: Dict[str, RSBound] = field(default_factory=dict, init=False, repr=False, compare=False)
    objective: Optional[Objective] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation (one place)
    def validate(self) -> None:
        """Check every field; raise ValueError naming the key and the bad value."""
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is: {self.rollout_is!r} is not one of None, "
                             f"{', '.join(repr(v) for v in IS_LEVELS)}")
        self.is_bounds = parse_is_threshold(self.rollout_is_threshold)
        if not isinstance(self.rollout_is_batch_normalize, bool):
            raise ValueError(f"rollout_is_batch_normalize: expected a bool, got {self.rollout_is_batch_normalize!r}")
        self.rs_options = parse_rs_options(self.rollout_rs)
        self.rs_bounds = parse_rs_thresholds(self.rs_options, self.rollout_rs_threshold)
        v = self.rollout_token_veto_threshold
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 < float(v) < 1.0):
                raise ValueError(f"rollout_token_veto_threshold: must be None or a float in (0, 1), got {v!r}")
            self.rollout_token_veto_threshold = float(v)
        for key in ("bypass_mode",):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key}: expected a bool, got {getattr(self, key)!r}")
        self.objective = objective(self.loss_type)
        if self.bypass_mode and not self.objective.bypass:
            raise ValueError(f"loss_type: {self.loss_type!r} cannot run with bypass_mode: true (bypass mode "
                             f"takes {', '.join(BYPASS_LOSS_TYPES)}; verl's bypass_mode loss replaces any "
                             f"loss_mode); set bypass_mode: false to use {self.loss_type!r}")
        if self.on_invalid not in ON_INVALID:
            raise ValueError(f"on_invalid: {self.on_invalid!r} is not one of {', '.join(ON_INVALID)}")

    def to_dict(self) -> Dict[str, Any]:
        """The user-settable fields (verl's keys), e.g. for YAML dumps and metrics headers."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "RolloutCorrectionConfig":
        """Build from verl's ``algorithm.rollout_correction`` block (as is) or seed-era flat keys.

        A ``preset`` key (``{"preset": "decoupled_token_is", "threshold": 3.0}``) calls that preset.
        Other preset keys override the preset's values. ``None`` is :meth:`disabled`. Unknown keys
        raise ValueError naming each key and the nearest valid one; seed-era keys are translated with a
        one-line migration hint (logged as a warning), see :mod:`megatron_rl.correction.migration`.
        """
        if d is None:
            return cls.disabled()
        valid_keys = [f.name for f in dataclasses.fields(cls) if f.init]
        if isinstance(d, dict) and "preset" in d:
            return cls._from_preset(dict(d), valid_keys)
        return cls(**translate(d, valid_keys))

    @classmethod
    def _from_preset(cls, d: Dict[str, Any], valid_keys: List[str]) -> "RolloutCorrectionConfig":
        """``{"preset": name, <preset arguments>, <config keys overriding the preset>}``."""
        name = d.pop("preset")
        if name not in PRESETS:
            near = difflib.get_close_matches(str(name), PRESETS, n=1)
            raise ValueError(f"rollout_correction.preset: unknown preset {name!r}"
                             + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f"; presets: {', '.join(PRESETS)}")
        overrides = {k: d.pop(k) for k in list(d) if k in valid_keys}
        try:
            preset = getattr(cls, name)(**d)
        except TypeError as exc:
            raise ValueError(f"rollout_correction.preset={name}: bad preset arguments {sorted(d)}: {exc}") from None
        return dataclasses.replace(preset, **overrides) if overrides else preset

    # ------------------------------------------------------------------ presets: verl (latest)
    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0):
        """Decoupled (3 policies), token-level TIS."""
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0):
        """Decoupled, sequence-level TIS."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5):
        """Decoupled, token-level IcePop: weights outside [threshold_lower, threshold] zeroed."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}")

    @classmethod
    def decoupled_seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: Union[str, float] = "0.5_2.0"):
        """Decoupled, sequence TIS + sequence rejection on the summed log-ratio (Seq-MIS)."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_sum_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: Union[str, float] = "0.999_1.001"):
        """Decoupled, geometric-mean ratio rejection (Geo-RS), no weights."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: Union[str, float] = "0.999_1.001"):
        """Decoupled, Geo-RS + sequence TIS."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: Union[str, float] = "0.999_1.001"):
        """Decoupled, Geo-RS + token TIS."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: float = 0.01):
        """Decoupled, rejection on the per-sequence mean k3 divergence."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01):
        """Decoupled, K3-RS + sequence TIS."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01):
        """Decoupled, K3-RS + token TIS."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_token_kpop(cls, threshold: float = KPOP_PHI_DEFAULT):
        """Decoupled, KPop (AReaL PR #1405): a token is kept iff max(D(p||q), D(q||p)) <= threshold (phi) with D
        the binary KL of pi_old and pi_rollout; kept tokens keep the untruncated token ratio (the IS threshold
        exp(20) never truncates: every ratio is clamped there)."""
        return cls(rollout_is="token", rollout_is_threshold=math.exp(LOG_RATIO_CLAMP), rollout_rs="binary_kl",
                   rollout_rs_threshold=threshold)

    @classmethod
    def bypass_ppo_clip(cls):
        """Bypass (old := rollout), PPO-clip; the PPO ratio is the IS correction."""
        return cls(rollout_is=None, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, rs_threshold: Union[str, float] = "0.999_1.001"):
        """Bypass PPO-clip + Geo-RS."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold,
                   bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = 0.01):
        """Bypass PPO-clip + K3-RS."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold,
                   bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0):
        """Bypass REINFORCE with sequence TIS weights."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True,
                   loss_type="reinforce")

    @classmethod
    def bypass_pg_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5):
        """Bypass REINFORCE with token IcePop weights."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}",
                   bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold: Union[str, float] = "0.999_1.001"):
        """Bypass REINFORCE + Geo-RS."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold,
                   bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: Union[str, float] = "0.999_1.001"):
        """Bypass REINFORCE + Geo-RS + sequence TIS."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: Union[str, float] = "0.999_1.001"):
        """Bypass REINFORCE + Geo-RS + token TIS."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def disabled(cls):
        """No correction; the off-policy diagnostics are still computed."""
        return cls(rollout_is=None, rollout_rs=None)

    # ------------------------------------------------------------------ presets: seed era
    # Names from verl PRs 3984/4070; thresholds as those PRs defined them. Seed "rs" at level
    # token / sequence / geometric maps to token_k1 / seq_sum_k1 / seq_mean_k1 with "lo_hi" bounds.
    @classmethod
    def token_is(cls, threshold: float = 2.0):
        """Seed era: token-level TIS (now decoupled_token_is)."""
        return cls.decoupled_token_is(threshold)

    token_tis = token_is

    @classmethod
    def seq_is(cls, threshold: float = 2.0):
        """Seed era: sequence-level TIS (now decoupled_seq_is)."""
        return cls.decoupled_seq_is(threshold)

    @classmethod
    def seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: float = 2.0,
                  rs_threshold_lower: Optional[float] = None):
        """Seed era: sequence TIS + sequence rejection of ratios outside [lower (1/upper), upper]."""
        return cls.decoupled_seq_is_rs(is_threshold, _k1_bounds(rs_threshold, rs_threshold_lower))

    seq_mis = seq_is_rs

    @classmethod
    def geo_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: Optional[float] = None,
               veto_threshold: Optional[float] = 1e-4):
        """Seed era: geometric-mean rejection + catastrophic-token veto, no weights (decoupled_geo_rs + veto)."""
        return dataclasses.replace(cls.decoupled_geo_rs(_k1_bounds(rs_threshold, rs_threshold_lower)),
                                   rollout_token_veto_threshold=veto_threshold)

    geo_mis = geo_rs

    @classmethod
    def ppo_is_bypass(cls, threshold: float = 2.0):
        """Seed era: bypass mode with PPO-clip; token IS weights computed for the metrics only."""
        return cls(rollout_is="token", rollout_is_threshold=threshold, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def pure_is(cls, threshold: float = 2.0):
        """Seed era: off-policy REINFORCE with sequence TIS (now bypass_pg_is)."""
        return cls.bypass_pg_is(threshold)

    pg_is = pure_is

    @classmethod
    def pg_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: Optional[float] = None,
              veto_threshold: Optional[float] = 1e-4):
        """Seed era: REINFORCE + geometric rejection + veto (bypass mode; bypass_pg_geo_rs + veto)."""
        return dataclasses.replace(cls.bypass_pg_geo_rs(_k1_bounds(rs_threshold, rs_threshold_lower)),
                                   rollout_token_veto_threshold=veto_threshold)


def _k1_bounds(upper: float, lower: Optional[float]) -> str:
    """The seed-era presets' k1 rejection bounds as a "lo_hi" spec: [lower, upper], lower defaulting to 1 / upper."""
    return f"{1.0 / upper if lower is None else lower}_{upper}"


PRESETS = (
    # verl (latest)
    "decoupled_token_is", "decoupled_seq_is", "decoupled_token_icepop", "decoupled_seq_is_rs",
    "decoupled_geo_rs", "decoupled_geo_rs_seq_tis", "decoupled_geo_rs_token_tis", "decoupled_k3_rs",
    "decoupled_k3_rs_seq_tis", "decoupled_k3_rs_token_tis", "bypass_ppo_clip", "bypass_ppo_clip_geo_rs",
    "bypass_ppo_clip_k3_rs", "bypass_pg_is", "bypass_pg_token_icepop", "bypass_pg_geo_rs",
    "bypass_pg_geo_rs_seq_tis", "bypass_pg_geo_rs_token_tis", "disabled",
    # AReaL's KPop
    "decoupled_token_kpop",
    # seed era
    "token_is", "token_tis", "seq_is", "seq_is_rs", "seq_mis", "geo_rs", "geo_mis", "ppo_is_bypass",
    "pure_is", "pg_is", "pg_rs",
)

"""Typed configuration of the policy loss (``PolicyLossConfig``), validated on construction.

Names and defaults follow verl's actor config (``clip_ratio_low`` / ``clip_ratio_high`` /
``clip_ratio_c`` / ``loss_agg_mode`` / ``kl_loss_coef`` / ``kl_loss_type``), with one addition:
``clip_ratio_c=None`` disables dual-clip (verl always applies it).

The loss type ("ppo_clip" / "reinforce") is not a field here: it has one owner,
``algorithm.rollout_correction.loss_type`` (verl's key, ``RolloutCorrectionConfig.loss_type``), because
it also decides which IS weights apply; the loss functions take it as an argument. ``from_dict``
rejects ``loss_type`` with that hint. ``LOSS_TYPES`` below is its one list of valid values.

Usage::

    from megatron_rl.losses import PolicyLossConfig
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-mean")
    cfg = PolicyLossConfig.from_dict({"clip_ratio": 0.2, "loss_agg_mode": "token-mean"})
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

LOSS_TYPES = ("ppo_clip", "reinforce")
"""Valid loss types (``algorithm.rollout_correction.loss_type``): "ppo_clip" is the clipped surrogate
with ratio pi_theta/pi_old; "reinforce" is -A * w * log pi_theta with detached IS weights w."""

MOVED_KEYS = {"loss_type": "algorithm.rollout_correction.loss_type"}
"""Keys users put under ``actor.policy_loss`` that live elsewhere (the key's one owner)."""

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Valid loss aggregation modes (verl's names); see ``megatron_rl.losses.aggregation``."""

# Every name verl's kl_penalty accepts (the "+" variants use the k2 gradient, see kl.py).
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
            "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+")
"""Valid KL estimator names; see ``megatron_rl.losses.kl.kl_penalty``."""


def _finite_number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"PolicyLossConfig.{key} must be a finite number, got {value!r}")
    return float(value)


def _choice(key: str, value: Any, choices) -> None:
    if value not in choices:
        near = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.4)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}{hint}")


def check_loss_type(loss_type: Any) -> None:
    """Raise ValueError unless ``loss_type`` is one of ``LOSS_TYPES`` (with the nearest name)."""
    _choice("loss_type", loss_type, LOSS_TYPES)


@dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the per-token policy loss, its aggregation and the optional KL loss."""

    clip_ratio_low: float = 0.2
    """PPO lower clip: the ratio is clipped below at 1 - clip_ratio_low. In [0, 1)."""

    clip_ratio_high: float = 0.2
    """PPO upper clip: the ratio is clipped above at 1 + clip_ratio_high. >= 0 (DAPO's
    clip-higher uses e.g. 0.28)."""

    clip_ratio_c: Optional[float] = 3.0
    """Dual-clip constant c > 1 (Ye et al. 2019): for A < 0 the per-token loss is capped at -A*c.
    None disables dual-clip. verl's default is 3.0."""

    loss_agg_mode: str = "token-mean"
    """How per-token losses become a scalar: one of ``LOSS_AGG_MODES``."""

    loss_scale_factor: Optional[float] = None
    """Only for "seq-mean-token-sum-norm": the constant the per-sequence token sums are divided by
    (verl's ``loss_scale_factor``). None means verl's default, the width of its response mask = the
    configured response budget: the actor uses ``rollout.max_new_tokens`` (multi-turn:
    ``multi_turn.max_total_tokens``), a constant of the config that does not move with prompt lengths."""

    kl_loss_coef: float = 0.0
    """Coefficient of the KL(pi_theta || pi_ref) loss added to the policy loss; 0 disables it
    (then ``ref_log_probs`` is not needed). verl's ``use_kl_loss``/``kl_loss_coef``."""

    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss: one of ``KL_TYPES`` ("low_var_kl" = k3, "k3+" = k3 value with
    k2 gradient, ...). Aggregated with ``loss_agg_mode`` like the policy loss."""

    def __post_init__(self) -> None:
        _choice("PolicyLossConfig.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _choice("PolicyLossConfig.kl_loss_type", self.kl_loss_type, KL_TYPES)
        low = _finite_number("clip_ratio_low", self.clip_ratio_low)
        high = _finite_number("clip_ratio_high", self.clip_ratio_high)
        if not 0.0 <= low < 1.0:
            raise ValueError(f"PolicyLossConfig.clip_ratio_low must be in [0, 1), got {self.clip_ratio_low!r}")
        if high < 0.0:
            raise ValueError(f"PolicyLossConfig.clip_ratio_high must be >= 0, got {self.clip_ratio_high!r}")
        if self.clip_ratio_c is not None:
            c = _finite_number("clip_ratio_c", self.clip_ratio_c)
            if c <= 1.0:
                raise ValueError(f"PolicyLossConfig.clip_ratio_c must be > 1 (or None to disable "
                                 f"dual-clip), got {self.clip_ratio_c!r}")
        if self.loss_scale_factor is not None:
            f = _finite_number("loss_scale_factor", self.loss_scale_factor)
            if f <= 0:
                raise ValueError(f"PolicyLossConfig.loss_scale_factor must be > 0, got {self.loss_scale_factor!r}")
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

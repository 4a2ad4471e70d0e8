"""The objective parameters (verl's names under ``actor.policy_loss``) and their valid ranges.

Each ``Param`` is one row: its name (a ``PolicyLossConfig`` field) and its range. ``PolicyLossConfig`` checks
every row's range on construction; an objective's row (``megatron_rl.losses.registry``) lists the ``Param``
rows it reads, so which objective reads what, and the range, are written once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Param:
    """One objective parameter: a ``PolicyLossConfig`` field and the values it accepts."""

    name: str
    """The key under ``actor.policy_loss`` (verl's name), a field of ``PolicyLossConfig``."""

    low: float
    """Lower bound of the accepted values."""

    low_open: bool = False
    """The lower bound itself is refused (``> low``; False: ``>= low``)."""

    high: Optional[float] = None
    """Upper bound, included (None: no upper bound)."""

    unset: str = ""
    """What ``None`` means when the parameter accepts it ("" : None is refused)."""

    integer: bool = False
    """Only integers are accepted."""

    note: str = ""
    """Said after the range in the error (what a value in a part of the range means)."""

    @property
    def rule(self) -> str:
        """The range in words, e.g. ``> 0``, ``in (0, 1]``, ``an integer >= 0``."""
        if math.isinf(self.low):
            return "a finite number"
        if self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        rule = f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"an integer {rule}" if self.integer else rule

    def check(self, value: Any) -> None:
        """Raise ValueError naming ``PolicyLossConfig.<name>``, the range and the value when it is outside."""
        if value is None and self.unset:
            return
        key = f"PolicyLossConfig.{self.name}"
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, int) or not self._inside(value):
                raise ValueError(f"{key} must be {self.rule}, got {value!r}")
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value!r}")
        if not self._inside(float(value)):
            unset = f" (or {self.unset})" if self.unset else ""
            raise ValueError(f"{key} must be {self.rule}{self.note}{unset}, got {value!r}")

    def _inside(self, v: float) -> bool:
        above = v > self.low if self.low_open else v >= self.low
        return above and (self.high is None or v <= self.high)


CLIP_RATIO_LOW = Param("clip_ratio_low", 0.0, note=" (>= 1: no lower clip)")
CLIP_RATIO_HIGH = Param("clip_ratio_high", 0.0)
CLIP_RATIO_C = Param("clip_ratio_c", 1.0, low_open=True, unset="None to disable dual-clip")
TAU_POS = Param("tau_pos", 0.0, low_open=True)
TAU_NEG = Param("tau_neg", 0.0, low_open=True)
CLIP_COV_RATIO = Param("clip_cov_ratio", 0.0, low_open=True, high=1.0)
CLIP_COV_LB = Param("clip_cov_lb", -math.inf)
CLIP_COV_UB = Param("clip_cov_ub", -math.inf)
CLIP_COV_SEED = Param("clip_cov_seed", 0, integer=True)
KL_COV_RATIO = Param("kl_cov_ratio", 0.0, low_open=True, high=1.0)
PPO_KL_COEF = Param("ppo_kl_coef", 0.0)
DRO_BETA = Param("dro_beta", 0.0, low_open=True, unset="unset")
OPSM_DELTA = Param("opsm_delta", 0.0)
M2_THRESHOLD = Param("m2_threshold", 0.0, low_open=True, unset="unset")

PARAMETERS = (CLIP_RATIO_LOW, CLIP_RATIO_HIGH, CLIP_RATIO_C, TAU_POS, TAU_NEG, CLIP_COV_RATIO, CLIP_COV_LB,
              CLIP_COV_UB, CLIP_COV_SEED, KL_COV_RATIO, PPO_KL_COEF, DRO_BETA, OPSM_DELTA, M2_THRESHOLD)
"""Every objective parameter, in the order they are checked and listed."""

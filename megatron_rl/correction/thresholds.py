"""Parsing of IS / RS threshold specs into typed bounds (ratio space, r = pi_train / pi_rollout).

Spec grammar (verl's):
  * IS ``rollout_is_threshold``: a number ``C`` -> truncate (TIS): ``w = min(w, C)``, lower bound
    ``1/C`` used only for the ``*_fraction_low`` metrics; a string ``"lo_hi"`` -> mask (MIS / IcePop):
    weights outside ``[lo, hi]`` become 0.
  * RS ``rollout_rs_threshold``: one spec shared by all options or a comma list with one spec per
    option. k1 options take ``"lo_hi"`` ratio bounds or a number ``U`` meaning ``[1/U, U]``; k2/k3
    options and ``binary_kl`` (KPop, ``correction.binary_kl``) take one positive upper bound on the statistic.

k1 convention: our k1 bounds always apply to ``r = pi_train / pi_rollout`` (keep iff
``lo <= r <= hi``). verl applies ``log lo <= k1 <= log hi`` with ``k1 = -log r``, i.e. to the inverse
ratio; for symmetric specs (``lo = 1/hi``, e.g. every verl preset) both conventions agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch

Spec = Union[str, float, int]

RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
    "binary_kl",
)

KPOP_PHI_DEFAULT = 2.0
"""``binary_kl``'s threshold phi when ``rollout_rs_threshold`` is null and binary_kl is the only option: AReaL's
documented default and its KPop example (PR #1405); prime-rl's port defaults to the much tighter 0.1."""


def is_token_option(opt: str) -> bool:
    """Whether the RS option decides per token (``token_*`` and KPop's ``binary_kl``)."""
    return opt.startswith("token_") or opt == "binary_kl"


@dataclass(frozen=True)
class ISBounds:
    """Parsed IS threshold: ``upper`` C, ``lower`` lo, and whether out-of-range weights are masked."""

    upper: float
    """C: weights above it are truncated to it (TIS) or masked (IcePop)."""
    lower: float
    """Masking: weights below it are masked; truncation: 1 / C, used by the ``*_fraction_low`` metrics only."""
    mask: bool
    """True: "lo_hi" spec (IcePop / MIS); False: truncate at ``upper`` (TIS)."""

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """The bounded weights of ``raw`` ratios (any shape: per token or per sequence): truncated
        ``min(raw, C)``, or masked (``raw`` where ``lower <= raw <= upper``, else 0). 0 stays 0."""
        if self.mask:
            return torch.where((raw >= self.lower) & (raw <= self.upper), raw, torch.zeros((), dtype=raw.dtype,
                                                                                            device=raw.device))
        return raw.clamp(max=self.upper)


@dataclass(frozen=True)
class RSBound:
    """Parsed RS threshold for one option.

    For k1 options ``lower``/``upper`` are ratio bounds on r; for k2/k3 ``upper`` bounds the divergence
    statistic and ``lower`` is None.
    """

    option: str
    upper: float
    lower: Optional[float]

    @property
    def estimator(self) -> str:
        return self.option[-2:]

    @property
    def stat_bounds(self) -> tuple:
        """Bounds (L, U) on the option's statistic (k1 = -log r; k2, k3 >= 0, L = 0)."""
        if self.estimator == "k1":
            return -math.log(self.upper), -math.log(self.lower)
        return 0.0, self.upper


def _positive_float(text: Spec, where: str) -> float:
    if isinstance(text, bool):
        raise ValueError(f"{where}: expected a number, got the boolean {text!r}")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: must be a finite positive number, got {text!r}")
    return value


def _split_lo_hi(spec: str, where: str) -> tuple:
    lo_s, hi_s = spec.split("_", 1)
    lo = _positive_float(lo_s, f"{where} (lower bound of {spec!r})")
    hi = _positive_float(hi_s, f"{where} (upper bound of {spec!r})")
    if lo > hi:
        raise ValueError(f"{where}: lower bound {lo} exceeds upper bound {hi} in {spec!r}")
    return lo, hi


def parse_is_threshold(spec: Spec, key: str = "rollout_is_threshold") -> ISBounds:
    """Parse ``rollout_is_threshold`` (see module docstring)."""
    if isinstance(spec, str) and "_" in spec.strip():
        lo, hi = _split_lo_hi(spec.strip(), key)
        return ISBounds(upper=hi, lower=lo, mask=True)
    if isinstance(spec, str) and not spec.strip():
        raise ValueError(f"{key}: empty string")
    upper = _positive_float(spec.strip() if isinstance(spec, str) else spec, key)
    return ISBounds(upper=upper, lower=1.0 / upper, mask=False)


def parse_rs_options(rollout_rs: Optional[str], key: str = "rollout_rs") -> List[str]:
    """Split the comma list of RS options, drop duplicates (order kept), reject unknown names."""
    if rollout_rs is None:
        return []
    if not isinstance(rollout_rs, str):
        raise ValueError(f"{key}: expected a comma-separated string, got {type(rollout_rs).__name__}")
    options: List[str] = []
    for opt in (o.strip() for o in rollout_rs.split(",")):
        if not opt:
            continue
        if opt not in RS_OPTIONS:
            import difflib

            near = difflib.get_close_matches(opt, RS_OPTIONS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"{key}: unknown option {opt!r}{hint}; valid: {', '.join(RS_OPTIONS)}")
        if opt not in options:
            options.append(opt)
    if not options:
        raise ValueError(f"{key}: {rollout_rs!r} names no option")
    return options


def parse_rs_thresholds(options: List[str], spec: Optional[Spec],
                        key: str = "rollout_rs_threshold") -> Dict[str, RSBound]:
    """Parse ``rollout_rs_threshold`` for the given options (one shared spec or one per option)."""
    if not options:
        return {}
    if spec is None and set(options) == {"binary_kl"}:
        spec = KPOP_PHI_DEFAULT
    if spec is None:
        raise ValueError(f"{key}: required when rollout_rs is set (options: {', '.join(options)})")
    if isinstance(spec, bool):
        raise ValueError(f"{key}: expected a number or string, got the boolean {spec!r}")
    parts = [p.strip() for p in spec.split(",") if p.strip()] if isinstance(spec, str) else [spec]
    if len(parts) == 1:
        parts = parts * len(options)
    if len(parts) != len(options):
        raise ValueError(f"{key}: {len(parts)} thresholds for {len(options)} rollout_rs options "
                         f"({', '.join(options)}); give one shared spec or one per option")
    bounds: Dict[str, RSBound] = {}
    for opt, part in zip(options, parts):
        where = f"{key}[{opt}]"
        if opt.endswith("k1"):
            if isinstance(part, str) and "_" in part:
                lo, hi = _split_lo_hi(part, where)
            else:
                hi = _positive_float(part, where)
                lo = 1.0 / hi
            bounds[opt] = RSBound(opt, upper=hi, lower=lo)
        else:
            if isinstance(part, str) and "_" in part:
                raise ValueError(f"{where}: k2/k3/binary_kl options take one upper bound, got {part!r}")
            bounds[opt] = RSBound(opt, upper=_positive_float(part, where), lower=None)
    return bounds

"""Step 4 of the correction: metric values from the reduced sums — and the reference of every metric.

All keys are ``rollout_corr/<name>``, computed over the *valid* sequences (>= 1 response token, no invalid
log-prob) and their tokens with the pre-rejection mask (only the batch normalisation uses the kept ones). Empty
sets give 0.0, never NaN, with their counts reported. ``kl``, ``log_ppl_diff`` and ``chi2_*`` may be negative:
they are estimators of non-negative quantities, not the quantities. The formula of every metric (counts,
off-policy diagnostics, IS, RS, veto): docs/correction.md.
"""
from __future__ import annotations

import math
from typing import Dict, Mapping

from megatron_rl.correction import histogram
from megatron_rl.correction.config import RolloutCorrectionConfig
from megatron_rl.correction.reduce import div, finite_or_zero, seq_std
from megatron_rl.correction.thresholds import is_token_option
from megatron_rl.numerics import LOG_RATIO_CLAMP

PREFIX = "rollout_corr/"


def _std(total_sq_mean: float, mean: float, n: float) -> float:
    return math.sqrt(max(0.0, total_sq_mean - mean ** 2)) if n > 1 else 0.0


def _offpolicy(s: Mapping, e: Mapping, N: float, NS: float) -> Dict[str, float]:
    return {
        "training_log_ppl": div(s["op/log_ppl_t"], NS), "training_ppl": div(s["op/ppl_t"], NS),
        "rollout_log_ppl": div(s["op/log_ppl_r"], NS), "rollout_ppl": div(s["op/ppl_r"], NS),
        "kl": div(s["op/kl"], N), "k3_kl": div(s["op/k3"], N),
        "log_ppl_diff": div(s["op/lpd"], NS), "log_ppl_abs_diff": div(s["op/lpd_abs"], NS),
        "log_ppl_diff_max": finite_or_zero(e["op/lpd_max"]), "log_ppl_diff_min": finite_or_zero(e["op/lpd_min"]),
        "ppl_ratio": div(s["op/ppl_ratio"], NS),
        "chi2_token": div(s["op/chi2_tok_m1"], N),
        "chi2_seq": div(s["op/chi2_seq"], NS) - 1.0 if NS else 0.0,
    }


def _importance_sampling(cfg: RolloutCorrectionConfig, s: Mapping, e: Mapping, N: float,
                         NS: float) -> Dict[str, float]:
    out: Dict[str, float] = {}
    mean_w, mean_w2 = div(s["is/w"], N), div(s["is/w2"], N)
    out["rollout_is_mean"] = mean_w
    out["rollout_is_std"] = _std(mean_w2, mean_w, N)
    out["rollout_is_eff_sample_size"] = (mean_w + 1e-8) ** 2 / mean_w2 if mean_w2 > 0 else 0.0
    if cfg.rollout_is == "token":
        out["rollout_is_max"] = finite_or_zero(e["is/max"])
        out["rollout_is_min"] = finite_or_zero(e["is/min"])
        out["rollout_is_ratio_fraction_high"] = div(s["is/high"], N)
        out["rollout_is_ratio_fraction_low"] = div(s["is/low"], N)
    else:
        mx, mn = e["is/max_log"], e["is/min_log"]
        out["rollout_is_max"] = math.exp(min(LOG_RATIO_CLAMP, mx)) if math.isfinite(mx) else 0.0
        out["rollout_is_min"] = math.exp(min(LOG_RATIO_CLAMP, mn)) if math.isfinite(mn) else 0.0
        out["rollout_is_ratio_fraction_high"] = div(s["is/high"], NS)
        out["rollout_is_ratio_fraction_low"] = div(s["is/low"], NS)
    if cfg.is_bounds.mask:
        out["rollout_is_oob_ratio"] = div(s["is/oob"], N)
    out["rollout_is_seq_mean"] = div(s["is/seq_sum"], NS)
    out["rollout_is_seq_std"] = seq_std(s["is/seq_sum"], s["is/seq_sq"], NS)
    out["rollout_is_seq_max"] = finite_or_zero(e["is/seq_max"])
    out["rollout_is_seq_min"] = finite_or_zero(e["is/seq_min"])
    out["rollout_is_seq_max_deviation"] = finite_or_zero(e["is/seq_dev"])
    out["rollout_is_seq_fraction_high"] = div(s["is/seq_high"], NS)
    out["rollout_is_seq_fraction_low"] = div(s["is/seq_low"], NS)
    for q, val in histogram.quantiles(s["is/hist"], (0.5, 0.9, 0.99)).items():
        out[f"rollout_is_p{int(round(q * 100))}"] = val
    return out


def _rejection_option(opt: str, s: Mapping, e: Mapping, N: float, NS: float) -> Dict[str, float]:
    p, k = f"rs/{opt}/", f"rollout_rs_{opt}"
    token_level = is_token_option(opt)
    den = N if token_level else NS
    mean_sc, mean_sc2 = div(s[p + "sc"], N), div(s[p + "sc2"], N)
    out = {
        f"{k}_mean": div(s[p + "mean"], N),
        f"{k}_max": finite_or_zero(e[p + "max"] if token_level else e[p + "seq_max"]),
        f"{k}_min": finite_or_zero(e[p + "min"] if token_level else e[p + "seq_min"]),
        f"{k}_fraction_high": div(s[p + "high"], den),
        f"{k}_fraction_low": div(s[p + "low"], den),
        f"{k}_std": _std(mean_sc2, mean_sc, N),
        f"{k}_seq_mean": div(s[p + "seq_sum"], NS),
        f"{k}_seq_std": seq_std(s[p + "seq_sum"], s[p + "seq_sq"], NS),
        f"{k}_seq_max": finite_or_zero(e[p + "seq_max"]),
        f"{k}_seq_min": finite_or_zero(e[p + "seq_min"]),
        f"{k}_seq_max_deviation": finite_or_zero(e[p + "seq_dev"]),
        f"{k}_seq_fraction_high": div(s[p + "seq_high"], NS),
    }
    if opt.endswith("k1"):
        out[f"{k}_seq_fraction_low"] = div(s[p + "seq_low"], NS)
    out[f"{k}_masked_fraction"] = div(s[p + "masked"], N)
    out[f"{k}_seq_masked_fraction"] = div(s[p + "seq_masked"], NS)
    return out


def finalize_metrics(cfg: RolloutCorrectionConfig, s: Mapping, e: Mapping) -> Dict[str, float]:
    """``rollout_corr/*`` metrics from the reduced sums ``s`` and extrema ``e`` (see the module docstring)."""
    N, NS = float(s["n_tok"]), float(s["n_seq"])
    out: Dict[str, float] = {
        "valid_token_count": N, "valid_seq_count": NS,
        "kept_token_count": float(s["n_kept_tok"]), "kept_seq_count": float(s["n_kept_seq"]),
        "invalid_token_count": float(s["n_invalid_tok"]), "invalid_seq_count": float(s["n_invalid_seq"]),
    }
    out.update(_offpolicy(s, e, N, NS))
    if cfg.rollout_is is not None:
        out.update(_importance_sampling(cfg, s, e, N, NS))
    for opt in cfg.rs_options:
        out.update(_rejection_option(opt, s, e, N, NS))
    if cfg.rs_options:
        out["rollout_rs_masked_fraction"] = div(s["rs/masked"], N)
        out["rollout_rs_seq_masked_fraction"] = div(s["rs/seq_masked"], NS)
    if cfg.rollout_token_veto_threshold is not None:
        out["rollout_is_veto_fraction"] = div(s["veto/seqs"], NS)
        out["rollout_is_catastrophic_token_fraction"] = div(s["veto/tokens"], N)
    return {PREFIX + k: float(v) for k, v in out.items()}


def batch_norm_factor(cfg: RolloutCorrectionConfig, s: Mapping) -> float:
    """The divisor of the weights: their mean over the kept tokens / sequences (1.0 if off or <= 1e-8)."""
    if cfg.rollout_is is None or not cfg.rollout_is_batch_normalize:
        return 1.0
    mean = div(s["bn/num"], s["bn/den"])
    return mean if mean > 1e-8 else 1.0

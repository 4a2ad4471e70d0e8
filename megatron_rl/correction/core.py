"""``compute_rollout_correction``: IS weights, rejection mask and metrics, exact under DP / CP.

Inputs are one rank's share of the global batch: ``[B, T]`` trainer log-probs (fp32 recompute),
rollout log-probs (e.g. SGLang bf16) and the response mask. With ``group`` (the ranks that hold
distinct tokens of the batch: Megatron's data-parallel group *with* context parallel) every weight and
metric equals the single-process result on the concatenated batch; with ``cp_group`` (context
parallel, each sequence split along time over its ranks, contiguous or zigzag) every sequence-level
weight and decision equals the unsplit one.

Steps (all in float64, exponentials of log-space values clamped at +-20):
  1. per-sequence partial sums / maxima -> completed over ``cp_group`` (1 all_gather);
  2. sequence validity (>= 1 valid token, no invalid value when ``on_invalid="reject"``), IS weights
     (token / sequence / geometric; truncate or mask), RS keep decisions, veto;
  3. every metric's partial sums / extrema -> one SUM and one MAX all_reduce over ``group``;
  4. batch normalisation of the weights by the global mean; invalid-value errors raised on all ranks.
At most 3 collectives per call, whatever the number of metrics.

Semantics (see ``metrics_reference.md`` for every formula):
  * IS weights are computed on the pre-rejection mask (verl), then zeroed where rejection / veto /
    padding removed the token, so ``weights`` is 0 wherever ``response_mask`` is 0.
  * All metrics except batch normalisation use the pre-rejection mask; per-sequence metrics run over
    valid sequences only (verl includes empty rows); every sequence fraction has the number of valid
    sequences as its denominator; empty sets give 0.0, never NaN, with counts reported
    (``valid_token_count``, ``valid_seq_count``, ``kept_token_count``, ``kept_seq_count``,
    ``invalid_seq_count``, ``invalid_token_count``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from megatron_rl.correction import histogram
from megatron_rl.correction.config import RolloutCorrectionConfig
from megatron_rl.correction.reduce import (
    CollectiveCounter, Reducer, cp_reduce_rows, div, finite_or_zero, group_rank, group_size, seq_std,
)
from megatron_rl.correction.validation import check_structure, describe_invalid, invalid_tokens

SAFETY_BOUND = 20.0
PREFIX = "rollout_corr/"


@dataclass
class CorrectionResult:
    """Output of :func:`compute_rollout_correction`."""

    weights: Optional[torch.Tensor]
    """[B, T] fp32 IS weights, detached, 0 where ``response_mask`` is 0; None if rollout_is is None."""
    response_mask: torch.Tensor
    """[B, T] mask after rejection sampling, veto and invalid-sequence rejection (input dtype)."""
    metrics: Dict[str, float]
    """Global metrics, keys ``rollout_corr/<name>``, identical on every rank of the group."""
    num_collectives: int = 0
    """Collectives this call issued (<= 3)."""


def _clamp(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-SAFETY_BOUND, SAFETY_BOUND)


def _sexp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(_clamp(x))


# Per-sequence columns completed over the CP group (sums), and their maxima.
_SUM_COLS = ("n", "sum_d", "sum_lp_t", "sum_lp_r", "n_invalid", "n_catastrophic",
             "sum_k1", "sum_k2", "sum_k3", "sum_w", "sum_raw", "n_tok_rs_reject_any")
_MAX_COLS = ("max_k2", "max_k3")


def compute_rollout_correction(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                               response_mask: torch.Tensor, cfg: RolloutCorrectionConfig,
                               group=None, cp_group=None) -> CorrectionResult:
    """Correct the rollout-vs-training mismatch of one rank's share of the batch.

    Args:
        train_log_probs: [B, T] log pi_train of the sampled tokens (fp32 recompute, or the old policy).
        rollout_log_probs: [B, T] log pi_rollout of the same tokens (from the rollout engine).
        response_mask: [B, T] 1 on response tokens, 0 on padding (bool / int / float).
        cfg: the correction settings.
        group: process group over which the global batch is split (Megatron's data-parallel group
            with context parallel); None for a single process.
        cp_group: context-parallel group (each sequence split along time over it); None if no CP.
            Its ranks must be members of ``group``.
    Returns:
        :class:`CorrectionResult`.
    Raises:
        ValueError: bad shapes / dtypes / mask values (at once), or invalid log-probs with
            ``cfg.on_invalid == "raise"`` (on every rank of ``group`` together, after the reduction).
    """
    check_structure(train_log_probs, rollout_log_probs, response_mask)
    counter = CollectiveCounter()
    dev = train_log_probs.device
    f64 = torch.float64
    mask0 = response_mask.bool()
    B, T = mask0.shape
    cp_rank = group_rank(cp_group) if group_size(cp_group) > 1 else 0
    seq_owner = 1.0 if cp_rank == 0 else 0.0  # sequence-level sums are contributed once per sequence

    # ---- sanitise: invalid values never reach arithmetic (no NaN / inf anywhere downstream)
    bad_t = invalid_tokens(train_log_probs, mask0)
    bad_r = invalid_tokens(rollout_log_probs, mask0)
    bad = bad_t | bad_r
    ok = mask0 & ~bad
    lp_t = torch.where(ok, train_log_probs.detach().to(f64), torch.zeros((), dtype=f64, device=dev))
    lp_r = torch.where(ok, rollout_log_probs.detach().to(f64), torch.zeros((), dtype=f64, device=dev))
    m0 = mask0.to(f64)
    d = lp_t - lp_r
    dc = _clamp(d)
    k1, k2, k3 = -dc, 0.5 * dc * dc, torch.exp(dc) - 1.0 - dc

    isb = cfg.is_bounds
    token_opts = [o for o in cfg.rs_options if o.startswith("token_")]
    stats = {"k1": k1, "k2": k2, "k3": k3}

    # token-level IS weights are local
    if cfg.rollout_is == "token":
        raw_tok = torch.exp(dc) * m0
        w_tok = _bound(raw_tok, isb)
    else:
        raw_tok = w_tok = torch.zeros_like(m0)
    tok_keep = {}
    rej_any = torch.zeros_like(mask0)
    for opt in token_opts:
        lo, hi = cfg.rs_bounds[opt].stat_bounds
        st = stats[opt[-2:]]
        keep = (st >= lo) & (st <= hi) if opt.endswith("k1") else (st <= hi)
        tok_keep[opt] = keep
        rej_any |= ~keep & mask0
    veto = cfg.rollout_token_veto_threshold
    catastrophic = (d < math.log(veto)) & mask0 & ~bad if veto is not None else torch.zeros_like(mask0)

    # ---- 1. per-sequence columns, completed over CP
    neg_inf = torch.tensor(float("-inf"), dtype=f64, device=dev)
    cols = {
        "n": m0.sum(1), "sum_d": (d * m0).sum(1), "sum_lp_t": lp_t.sum(1), "sum_lp_r": lp_r.sum(1),
        "n_invalid": bad.to(f64).sum(1), "n_catastrophic": catastrophic.to(f64).sum(1),
        "sum_k1": (k1 * m0).sum(1), "sum_k2": (k2 * m0).sum(1), "sum_k3": (k3 * m0).sum(1),
        "sum_w": (w_tok * m0).sum(1), "sum_raw": (raw_tok * m0).sum(1),
        "n_tok_rs_reject_any": rej_any.to(f64).sum(1),
    }
    for opt in token_opts:
        cols[f"n_reject_{opt}"] = (~tok_keep[opt] & mask0).to(f64).sum(1)
    sum_names = list(_SUM_COLS) + [f"n_reject_{o}" for o in token_opts]
    maxes = {"max_k2": torch.where(mask0, k2, neg_inf).amax(1) if T else neg_inf.expand(B),
             "max_k3": torch.where(mask0, k3, neg_inf).amax(1) if T else neg_inf.expand(B)}
    s_cols, m_cols = cp_reduce_rows(torch.stack([cols[k] for k in sum_names], 1),
                                    torch.stack([maxes[k] for k in _MAX_COLS], 1), cp_group, counter)
    seq = {k: s_cols[:, i] for i, k in enumerate(sum_names)}
    seq.update({k: m_cols[:, i] for i, k in enumerate(_MAX_COLS)})

    # ---- 2. validity, IS weights, rejection
    invalid_seq = (seq["n_invalid"] > 0) & (seq["n"] > 0)
    valid = (seq["n"] > 0) & ~invalid_seq
    vf = valid.to(f64)
    n_safe = seq["n"].clamp_min(1.0)
    m = m0 * vf[:, None]  # effective pre-rejection mask
    mb = m.bool()
    S = seq["sum_d"]
    G = S / n_safe

    weights = raw = None
    if cfg.rollout_is is not None:
        if cfg.rollout_is == "token":
            raw, w = raw_tok * m, w_tok * m
            s_w, s_raw = seq["sum_w"] / n_safe, seq["sum_raw"] / n_safe
            seq_log = None
        else:
            seq_log = S if cfg.rollout_is == "sequence" else G
            raw_seq = _sexp(seq_log)
            w_seq = _bound(raw_seq, isb)
            raw, w = raw_seq[:, None] * m, w_seq[:, None] * m
            s_w, s_raw = w_seq, raw_seq

    seq_values = {}  # per option: per-sequence statistic v [B]
    seq_keep_all = torch.ones(B, dtype=torch.bool, device=dev)
    opt_keep_tok = {}
    opt_keep_seq = {}  # sequence options: per-sequence keep decision [B]
    for opt in cfg.rs_options:
        est = opt[-2:]
        lo, hi = cfg.rs_bounds[opt].stat_bounds
        if opt.startswith("token_"):
            v = seq[f"sum_{est}"] / n_safe
            opt_keep_tok[opt] = tok_keep[opt]
        else:
            if opt.startswith("seq_sum_"):
                v = seq[f"sum_{est}"]
            elif opt.startswith("seq_mean_"):
                v = seq[f"sum_{est}"] / n_safe
            else:
                v = torch.where(valid, seq[f"max_{est}"], torch.zeros_like(S))
            keep_s = (v >= lo) & (v <= hi) if est == "k1" else (v <= hi)
            seq_keep_all &= keep_s
            opt_keep_seq[opt] = keep_s
            opt_keep_tok[opt] = keep_s[:, None].expand(B, T)
        seq_values[opt] = v
    vetoed = (seq["n_catastrophic"] > 0) & valid
    rs_keep_tok = torch.ones_like(mask0)
    for keep in opt_keep_tok.values():
        rs_keep_tok = rs_keep_tok & keep
    final_keep = rs_keep_tok & ~vetoed[:, None] & mb
    kept_tokens_seq = torch.where(seq_keep_all & valid & ~vetoed, seq["n"] - seq["n_tok_rs_reject_any"],
                                  torch.zeros_like(S))
    kept_seq = kept_tokens_seq > 0

    # ---- 3. metrics: partial sums and extrema, one SUM + one MAX collective over the group
    red = Reducer(dev)
    so = seq_owner
    fk = final_keep.to(f64)
    red.add_sum("n_tok", m.sum())
    red.add_sum("n_seq", vf.sum() * so)
    red.add_sum("n_invalid_tok", bad.to(f64).sum())
    red.add_sum("n_invalid_seq", invalid_seq.to(f64).sum() * so)
    red.add_sum("n_kept_tok", fk.sum())
    red.add_sum("n_kept_seq", kept_seq.to(f64).sum() * so)
    _offpolicy_partials(red, seq, valid, vf, n_safe, m, d, dc, so)
    if cfg.rollout_is is not None:
        _is_partials(red, cfg, w, raw, s_w, s_raw, seq_log, m, mb, dc, vf, valid, so, final_keep, kept_seq)
    for opt in cfg.rs_options:
        _rs_partials(red, cfg, opt, stats, seq_values[opt], opt_keep_tok[opt], opt_keep_seq.get(opt), seq, m, mb,
                     vf, valid, so, B, T)
    if cfg.rs_options:
        red.add_sum("rs/masked", ((~rs_keep_tok).to(f64) * m).sum())
        rs_seq_rej = valid & (~seq_keep_all | (seq["n_tok_rs_reject_any"] > 0))
        red.add_sum("rs/seq_masked", rs_seq_rej.to(f64).sum() * so)
    if veto is not None:
        red.add_sum("veto/seqs", vetoed.to(f64).sum() * so)
        red.add_sum("veto/tokens", (catastrophic.to(f64) * m).sum())
    sums, ext = red.reduce(group, counter)

    # ---- 4. invalid values: every rank decides from the same global count
    n_bad_global = int(round(float(sums["n_invalid_tok"])))
    if n_bad_global and cfg.on_invalid == "raise":
        note = f" on rank {group_rank(group)} of the group" if group_size(group) > 1 else ""
        parts = [describe_invalid(n, t, b, note, n_bad_global)
                 for n, t, b in (("train_log_probs", train_log_probs, bad_t),
                                 ("rollout_log_probs", rollout_log_probs, bad_r)) if b.any()]
        raise ValueError("; ".join(parts) if parts else
                         f"{n_bad_global} invalid log-prob values (NaN, inf or > 1e-3) on other ranks "
                         f"of the group (none on this rank); set on_invalid='reject' to drop those sequences")

    metrics = _finalize(cfg, sums, ext)
    if cfg.rollout_is is not None:
        factor = 1.0
        if cfg.rollout_is_batch_normalize:
            key = "bn/tok" if cfg.rollout_is == "token" else "bn/seq"
            mean = div(sums[key + "_num"], sums[key + "_den"])
            if mean > 1e-8:
                factor = mean
            metrics[PREFIX + "rollout_is_batch_norm_factor"] = factor
        weights = (w * fk / factor).to(torch.float32).detach()
    new_mask = final_keep.to(response_mask.dtype) if response_mask.dtype != torch.bool else final_keep
    return CorrectionResult(weights=weights, response_mask=new_mask, metrics=metrics,
                            num_collectives=counter.count)


def _bound(raw: torch.Tensor, isb) -> torch.Tensor:
    """Truncate (TIS) or mask (IcePop) ratios."""
    if isb.mask:
        return torch.where((raw >= isb.lower) & (raw <= isb.upper), raw, torch.zeros_like(raw))
    return raw.clamp(max=isb.upper)


def _offpolicy_partials(red, seq, valid, vf, n_safe, m, d, dc, so):
    mean_t = seq["sum_lp_t"] / n_safe
    mean_r = seq["sum_lp_r"] / n_safe
    diff = mean_r - mean_t
    red.add_sum("op/log_ppl_t", (-mean_t * vf).sum() * so)
    red.add_sum("op/ppl_t", (_sexp(-mean_t) * vf).sum() * so)
    red.add_sum("op/log_ppl_r", (-mean_r * vf).sum() * so)
    red.add_sum("op/ppl_r", (_sexp(-mean_r) * vf).sum() * so)
    red.add_sum("op/kl", (-d * m).sum())
    red.add_sum("op/k3", ((torch.exp(dc) - dc - 1.0) * m).sum())
    red.add_sum("op/lpd", (diff * vf).sum() * so)
    red.add_sum("op/lpd_abs", (diff.abs() * vf).sum() * so)
    red.add_sum("op/ppl_ratio", (_sexp(diff) * vf).sum() * so)
    red.add_sum("op/chi2_tok", (torch.exp(2.0 * dc) * m).sum())
    red.add_sum("op/chi2_seq", (torch.exp(2.0 * _clamp(seq["sum_d"])) * vf).sum() * so)
    red.add_max("op/lpd_max", diff[valid])
    red.add_min("op/lpd_min", diff[valid])


def _is_partials(red, cfg, w, raw, s_w, s_raw, seq_log, m, mb, dc, vf, valid, so, final_keep, kept_seq):
    isb = cfg.is_bounds
    C, lo = isb.upper, isb.lower
    wc = w.clamp(0.0, C)
    red.add_sum("is/w", (w * m).sum())
    red.add_sum("is/wc", (wc * m).sum())
    red.add_sum("is/wc2", (wc * wc * m).sum())
    if seq_log is None:  # token level
        red.add_sum("is/high", ((raw > C).to(w.dtype) * m).sum())
        red.add_sum("is/low", ((raw < lo).to(w.dtype) * m).sum())
        red.add_max("is/max", w[mb])
        red.add_min("is/min", w[mb])
    else:
        red.add_sum("is/high", ((seq_log > math.log(C)) & valid).to(w.dtype).sum() * so)
        red.add_sum("is/low", ((seq_log < math.log(lo)) & valid).to(w.dtype).sum() * so)
        red.add_max("is/max_log", seq_log[valid])
        red.add_min("is/min_log", seq_log[valid])
    if isb.mask:
        red.add_sum("is/oob", (((raw < lo) | (raw > C)).to(w.dtype) * m).sum())
    red.add_sum("is/seq_sum", (s_w * vf).sum() * so)
    red.add_sum("is/seq_sq", (s_w * s_w * vf).sum() * so)
    red.add_sum("is/seq_high", ((s_raw > C) & valid).to(w.dtype).sum() * so)
    red.add_sum("is/seq_low", ((s_raw < lo) & valid).to(w.dtype).sum() * so)
    red.add_max("is/seq_max", s_w[valid])
    red.add_min("is/seq_min", s_w[valid])
    red.add_max("is/seq_dev", (s_w[valid] - 1.0).abs())
    red.add_sum("is/hist", histogram.bin_counts(dc, mb))
    if cfg.rollout_is_batch_normalize:
        fk = final_keep.to(w.dtype)
        if cfg.rollout_is == "token":
            red.add_sum("bn/tok_num", (w * fk).sum())
            red.add_sum("bn/tok_den", fk.sum())
        else:
            red.add_sum("bn/seq_num", (s_w * kept_seq.to(w.dtype)).sum() * so)
            red.add_sum("bn/seq_den", kept_seq.to(w.dtype).sum() * so)


def _rs_partials(red, cfg, opt, stats, v, keep_tok, keep_seq, seq, m, mb, vf, valid, so, B, T):
    est = opt[-2:]
    L, U = cfg.rs_bounds[opt].stat_bounds
    p = f"rs/{opt}/"
    token_level = opt.startswith("token_")
    stat = stats[est] if token_level else v[:, None].expand(B, T)
    f = m.dtype
    red.add_sum(p + "mean", (stat * m).sum())
    sc = stat.clamp(L if est == "k1" else 0.0, U)
    red.add_sum(p + "sc", (sc * m).sum())
    red.add_sum(p + "sc2", (sc * sc * m).sum())
    if token_level:
        red.add_max(p + "max", stat[mb])
        red.add_min(p + "min", stat[mb])
        red.add_sum(p + "high", ((stat > U).to(f) * m).sum())
        red.add_sum(p + "low", ((stat < L).to(f) * m).sum() if est == "k1" else 0.0)
        red.add_sum(p + "seq_masked", ((seq[f"n_reject_{opt}"] > 0) & valid).to(f).sum() * so)
    else:
        red.add_sum(p + "high", ((v > U) & valid).to(f).sum() * so)
        red.add_sum(p + "low", ((v < L) & valid).to(f).sum() * so if est == "k1" else 0.0)
        red.add_sum(p + "seq_masked", (~keep_seq & valid).to(f).sum() * so)
    red.add_sum(p + "masked", ((~keep_tok).to(f) * m).sum())
    red.add_sum(p + "seq_sum", (v * vf).sum() * so)
    red.add_sum(p + "seq_sq", (v * v * vf).sum() * so)
    red.add_sum(p + "seq_high", ((v > U) & valid).to(f).sum() * so)
    if est == "k1":
        red.add_sum(p + "seq_low", ((v < L) & valid).to(f).sum() * so)
    red.add_max(p + "seq_max", v[valid])
    red.add_min(p + "seq_min", v[valid])
    red.add_max(p + "seq_dev", v[valid].abs())


def _finalize(cfg: RolloutCorrectionConfig, s, e) -> Dict[str, float]:
    """Metric values from the reduced sums ``s`` and extrema ``e`` (formulas: metrics_reference.md)."""
    N, NS = float(s["n_tok"]), float(s["n_seq"])
    out: Dict[str, float] = {
        "valid_token_count": N, "valid_seq_count": NS,
        "kept_token_count": float(s["n_kept_tok"]), "kept_seq_count": float(s["n_kept_seq"]),
        "invalid_token_count": float(s["n_invalid_tok"]), "invalid_seq_count": float(s["n_invalid_seq"]),
        "training_log_ppl": div(s["op/log_ppl_t"], NS), "training_ppl": div(s["op/ppl_t"], NS),
        "rollout_log_ppl": div(s["op/log_ppl_r"], NS), "rollout_ppl": div(s["op/ppl_r"], NS),
        "kl": div(s["op/kl"], N), "k3_kl": div(s["op/k3"], N),
        "log_ppl_diff": div(s["op/lpd"], NS), "log_ppl_abs_diff": div(s["op/lpd_abs"], NS),
        "log_ppl_diff_max": finite_or_zero(e["op/lpd_max"]), "log_ppl_diff_min": finite_or_zero(e["op/lpd_min"]),
        "ppl_ratio": div(s["op/ppl_ratio"], NS),
        "chi2_token": div(s["op/chi2_tok"], N) - 1.0 if N else 0.0,
        "chi2_seq": div(s["op/chi2_seq"], NS) - 1.0 if NS else 0.0,
    }
    if cfg.rollout_is is not None:
        mean_wc = div(s["is/wc"], N)
        mean_wc2 = div(s["is/wc2"], N)
        out["rollout_is_mean"] = div(s["is/w"], N)
        out["rollout_is_std"] = math.sqrt(max(0.0, mean_wc2 - mean_wc ** 2)) if N > 1 else 0.0
        # ESS = 1 / mm((wc / (mm(wc) + 1e-8))^2) = (mm(wc) + 1e-8)^2 / mm(wc^2); 0 if no weight mass
        out["rollout_is_eff_sample_size"] = (mean_wc + 1e-8) ** 2 / mean_wc2 if mean_wc2 > 0 else 0.0
        if cfg.rollout_is == "token":
            out["rollout_is_max"] = finite_or_zero(e["is/max"])
            out["rollout_is_min"] = finite_or_zero(e["is/min"])
            out["rollout_is_ratio_fraction_high"] = div(s["is/high"], N)
            out["rollout_is_ratio_fraction_low"] = div(s["is/low"], N)
        else:
            mx, mn = e["is/max_log"], e["is/min_log"]
            out["rollout_is_max"] = math.exp(min(SAFETY_BOUND, mx)) if math.isfinite(mx) else 0.0
            out["rollout_is_min"] = math.exp(min(SAFETY_BOUND, mn)) if math.isfinite(mn) else 0.0
            out["rollout_is_ratio_fraction_high"] = div(s["is/high"], NS)
            out["rollout_is_ratio_fraction_low"] = div(s["is/low"], NS)
        if cfg.is_bounds.mask:
            out["rollout_is_oob_ratio"] = div(s["is/oob"], N)
        out["rollout_is_seq_mean"] = div(s["is/seq_sum"], NS)
        out["rollout_is_seq_std"] = seq_std(float(s["is/seq_sum"]), float(s["is/seq_sq"]), NS)
        out["rollout_is_seq_max"] = finite_or_zero(e["is/seq_max"])
        out["rollout_is_seq_min"] = finite_or_zero(e["is/seq_min"])
        out["rollout_is_seq_max_deviation"] = finite_or_zero(e["is/seq_dev"])
        out["rollout_is_seq_fraction_high"] = div(s["is/seq_high"], NS)
        out["rollout_is_seq_fraction_low"] = div(s["is/seq_low"], NS)
        for q, val in histogram.quantiles(s["is/hist"], (0.5, 0.9, 0.99)).items():
            out[f"rollout_is_p{int(round(q * 100))}"] = val
    for opt in cfg.rs_options:
        p, k = f"rs/{opt}/", f"rollout_rs_{opt}"
        token_level = opt.startswith("token_")
        den = N if token_level else NS
        mean_sc, mean_sc2 = div(s[p + "sc"], N), div(s[p + "sc2"], N)
        out[f"{k}_mean"] = div(s[p + "mean"], N)
        out[f"{k}_max"] = finite_or_zero(e[p + "max"] if token_level else e[p + "seq_max"])
        out[f"{k}_min"] = finite_or_zero(e[p + "min"] if token_level else e[p + "seq_min"])
        out[f"{k}_fraction_high"] = div(s[p + "high"], den)
        out[f"{k}_fraction_low"] = div(s[p + "low"], den)
        out[f"{k}_std"] = math.sqrt(max(0.0, mean_sc2 - mean_sc ** 2)) if N > 1 else 0.0
        out[f"{k}_seq_mean"] = div(s[p + "seq_sum"], NS)
        out[f"{k}_seq_std"] = seq_std(float(s[p + "seq_sum"]), float(s[p + "seq_sq"]), NS)
        out[f"{k}_seq_max"] = finite_or_zero(e[p + "seq_max"])
        out[f"{k}_seq_min"] = finite_or_zero(e[p + "seq_min"])
        out[f"{k}_seq_max_deviation"] = finite_or_zero(e[p + "seq_dev"])
        out[f"{k}_seq_fraction_high"] = div(s[p + "seq_high"], NS)
        if opt.endswith("k1"):
            out[f"{k}_seq_fraction_low"] = div(s[p + "seq_low"], NS)
        out[f"{k}_masked_fraction"] = div(s[p + "masked"], N)
        out[f"{k}_seq_masked_fraction"] = div(s[p + "seq_masked"], NS)
    if cfg.rs_options:
        out["rollout_rs_masked_fraction"] = div(s["rs/masked"], N)
        out["rollout_rs_seq_masked_fraction"] = div(s["rs/seq_masked"], NS)
    if cfg.rollout_token_veto_threshold is not None:
        out["rollout_is_veto_fraction"] = div(s["veto/seqs"], NS)
        out["rollout_is_catastrophic_token_fraction"] = div(s["veto/tokens"], N)
    return {PREFIX + k: float(v) for k, v in out.items()}

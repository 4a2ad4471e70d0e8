"""Step 1 of the correction: this rank's per-token view and the per-sequence columns, completed over CP.

``token_view`` sanitises the inputs once (log-probs of tokens outside the mask or invalid — NaN, inf,
> ``LOG_PROB_TOLERANCE`` — are replaced by 0, so the log-ratio is 0 there and nothing downstream sees
NaN / inf) and computes the per-token values the later steps need. ``seq_columns`` reduces them along
time to per-sequence sums / maxima ``[B]`` and completes those over the context-parallel group with
one ``all_gather`` (every CP rank then holds the whole sequence's values, bitwise identical).

Precision, per input dtype: per-token arithmetic runs in the inputs' dtype promoted to at least
float32 (float32 for bf16 / fp16 / fp32 log-probs, float64 for float64 ones); every sum along time
accumulates in float64. Two values that would lose digits in float32 are formed differently:

* the per-sequence log-ratio sum is the difference of the float64 sums of the two log-probs
  (``sum_t d_t = sum_t lp_train - sum_t lp_rollout``, exact), minus the part the +-20 clamp removed;
  sequence IS weights, k1 statistics (Geo-RS thresholds such as 0.999_1.001) and perplexities use it;
* k3 = exp(d) - 1 - d (~ d^2 / 2: catastrophic cancellation in float32 for small d) is evaluated
  in float64 as ``expm1(d) - d``.
Everything else (token ratios, k2, token-level RS decisions) carries the float32 rounding of the
per-token log-ratio: a relative error below ~1e-7 (|d| < 1) and ~1.2e-6 at the clamp (|d| = 20).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from megatron_rl.correction.binary_kl import kpop_statistic
from megatron_rl.correction.config import RolloutCorrectionConfig
from megatron_rl.correction.reduce import CollectiveCounter, complete_over_cp
from megatron_rl.correction.thresholds import is_token_option
from megatron_rl.numerics import LOG_PROB_TOLERANCE, LOG_RATIO_CLAMP, clamp_log_ratio

F64 = torch.float64


@dataclass
class TokenView:
    """This rank's ``[B, T]`` per-token values (never NaN / inf)."""

    mask: torch.Tensor
    """bool: response tokens (``response_mask != 0``), including tokens with invalid log-probs."""
    ok: torch.Tensor
    """bool: response tokens whose two log-probs are valid."""
    lp_train: torch.Tensor
    """Training log-probs (compute dtype); 0 where not ``ok``."""
    lp_rollout: torch.Tensor
    """Rollout log-probs (compute dtype); 0 where not ``ok``."""
    log_ratio: torch.Tensor
    """log pi_train - log pi_rollout (compute dtype, unclamped); 0 where not ``ok``."""
    clamped: torch.Tensor
    """``log_ratio`` clamped to [-20, 20]."""
    ratio: torch.Tensor
    """exp(clamped); 1 where not ``ok``."""
    is_raw: Optional[torch.Tensor]
    """Token IS only: the ratio on response tokens, 0 elsewhere."""
    is_weight: Optional[torch.Tensor]
    """Token IS only: ``is_raw`` truncated (TIS) or masked (IcePop); 0 outside the mask."""
    rs_keep: Optional[torch.Tensor]
    """bool: tokens every token-level RS option keeps; None without token-level options."""


@dataclass
class TokenOptionColumns:
    """Per-sequence sums / extrema of one token-level RS option's statistic over response tokens."""

    n_high: torch.Tensor
    """Tokens with statistic > U."""
    n_low: torch.Tensor
    """Tokens with statistic < L (k1 only; 0 for k2 / k3)."""
    sum_clamped: torch.Tensor
    """Sum of the statistic clamped to [L, U] (k2 / k3: [0, U])."""
    sum_clamped_sq: torch.Tensor
    """Sum of its square."""
    max: torch.Tensor
    """Largest statistic (-inf without tokens)."""
    min: torch.Tensor
    """Smallest statistic (+inf without tokens)."""
    sum: Optional[torch.Tensor] = None
    """Sum of the statistic (``binary_kl`` only: the k's sums are ``SeqColumns.sum_k*``)."""

    @property
    def n_rejected(self) -> torch.Tensor:
        """Tokens this option rejects (outside [L, U])."""
        return self.n_high + self.n_low


@dataclass
class SeqColumns:
    """Per-sequence ``[B]`` float64 values of whole sequences (completed over the CP group)."""

    n_tokens: torch.Tensor
    """Response tokens."""
    n_invalid: torch.Tensor
    """Response tokens with an invalid log-prob (either tensor)."""
    sum_lp_train: torch.Tensor
    """Sum of the valid training log-probs."""
    sum_lp_rollout: torch.Tensor
    """Sum of the valid rollout log-probs."""
    sum_log_ratio: torch.Tensor
    """Sum of the unclamped log-ratio d (= sum_lp_train - sum_lp_rollout)."""
    sum_k1: torch.Tensor
    """Sum of k1 = -clamp(d)."""
    sum_k2: Optional[torch.Tensor]
    """Sum of k2 = clamp(d)^2 / 2 (only with a k2 RS option)."""
    sum_k3: torch.Tensor
    """Sum of k3 = exp(clamp(d)) - 1 - clamp(d)."""
    max_k2: Optional[torch.Tensor]
    """Largest k2 (only with seq_max_k2; -inf without tokens)."""
    max_k3: Optional[torch.Tensor]
    """Largest k3 (only with seq_max_k3; -inf without tokens)."""
    sum_ratio_sq_m1: torch.Tensor
    """Sum of exp(2 clamp(d)) - 1 (chi^2; computed with expm1, no cancellation)."""
    n_catastrophic: Optional[torch.Tensor]
    """Valid tokens with d < log(veto threshold) (only with the veto)."""
    n_rs_rejected: torch.Tensor
    """Tokens rejected by at least one token-level RS option (0 without such options)."""
    token_options: Dict[str, TokenOptionColumns]
    """Per token-level RS option (``token_k1`` / ``token_k2`` / ``token_k3`` / ``binary_kl``)."""
    is_sum_w: Optional[torch.Tensor] = None
    """Token IS: sum of the truncated / masked weights."""
    is_sum_w_sq: Optional[torch.Tensor] = None
    """Token IS: sum of their squares."""
    is_sum_w_rs_kept: Optional[torch.Tensor] = None
    """Token IS with token-level RS: sum of the weights of tokens every token option keeps."""
    is_sum_raw: Optional[torch.Tensor] = None
    """Token IS: sum of the raw ratios."""
    is_n_high: Optional[torch.Tensor] = None
    """Token IS: tokens with ratio > C."""
    is_n_low: Optional[torch.Tensor] = None
    """Token IS: tokens with ratio < lower bound."""
    is_max: Optional[torch.Tensor] = None
    """Token IS: largest weight."""
    is_min: Optional[torch.Tensor] = None
    """Token IS: smallest weight (+inf without tokens)."""

    def stat_sum(self, opt: str) -> torch.Tensor:
        """Per-sequence sum of RS option ``opt``'s per-token statistic (k1 / k2 / k3 / binary_kl)."""
        if opt == "binary_kl":
            return self.token_options[opt].sum
        return {"k1": self.sum_k1, "k2": self.sum_k2, "k3": self.sum_k3}[opt[-2:]]

    @property
    def n_safe(self) -> torch.Tensor:
        """``n_tokens`` with 0 replaced by 1 (for means of empty sequences, which are never used)."""
        return self.n_tokens.clamp_min(1.0)


def _is_log_prob(x: torch.Tensor) -> torch.Tensor:
    """bool: finite and <= LOG_PROB_TOLERANCE (False for NaN, +-inf)."""
    return (x > float("-inf")) & (x <= LOG_PROB_TOLERANCE)


def token_view(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
               cfg: RolloutCorrectionConfig) -> TokenView:
    """Sanitised per-token values of this rank's ``[B, T]`` share."""
    dtype = torch.promote_types(torch.promote_types(train_log_probs.dtype, rollout_log_probs.dtype),
                                torch.float32)
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    lp_t = train_log_probs.detach().to(dtype)
    lp_r = rollout_log_probs.detach().to(dtype)
    ok = mask & _is_log_prob(lp_t) & _is_log_prob(lp_r)
    zero = torch.zeros((), dtype=dtype, device=lp_t.device)
    lp_t, lp_r = torch.where(ok, lp_t, zero), torch.where(ok, lp_r, zero)
    log_ratio = lp_t - lp_r
    clamped = clamp_log_ratio(log_ratio)
    ratio = torch.exp(clamped)
    is_raw = is_weight = None
    if cfg.rollout_is == "token":
        is_raw = torch.where(mask, ratio, zero)
        is_weight = cfg.is_bounds.apply(is_raw)
    rs_keep = None
    for opt in cfg.rs_options:
        if is_token_option(opt):
            keep = _token_stat_keep(opt, clamped, cfg, lp_t, lp_r)
            rs_keep = keep if rs_keep is None else rs_keep & keep
    return TokenView(mask=mask, ok=ok, lp_train=lp_t, lp_rollout=lp_r, log_ratio=log_ratio, clamped=clamped,
                     ratio=ratio, is_raw=is_raw, is_weight=is_weight, rs_keep=rs_keep)


def _k3(clamped: torch.Tensor) -> torch.Tensor:
    """k3 = exp(x) - 1 - x in float64 (>= 0; no cancellation for small x)."""
    x = clamped.to(F64)
    return torch.expm1(x) - x


def _token_stat(opt: str, clamped: torch.Tensor, lp_t: torch.Tensor, lp_r: torch.Tensor) -> torch.Tensor:
    """The per-token statistic of a token-level option: k1 = -x, k2 = x^2 / 2, k3 (float64); binary_kl: KPop's
    max of the two binary KLs of pi_train and pi_rollout (float64, ``correction.binary_kl``)."""
    if opt == "binary_kl":
        return kpop_statistic(lp_t, lp_r)
    est = opt[-2:]
    if est == "k1":
        return -clamped
    if est == "k2":
        return 0.5 * clamped * clamped
    return _k3(clamped)


def _token_stat_keep(opt: str, clamped: torch.Tensor, cfg: RolloutCorrectionConfig, lp_t: torch.Tensor,
                     lp_r: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: tokens the token-level option keeps (k1: L <= k1 <= U; k2 / k3 / binary_kl: stat <= U)."""
    lo, hi = cfg.rs_bounds[opt].stat_bounds
    stat = _token_stat(opt, clamped, lp_t, lp_r)
    return (stat >= lo) & (stat <= hi) if opt.endswith("k1") else stat <= hi


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row float64 sum of ``x`` where ``mask``."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(1, dtype=F64)


def _row_max(x: torch.Tensor, n_local: torch.Tensor) -> torch.Tensor:
    """Per-row max over the mask of a non-negative ``x`` that is 0 outside it (-inf for empty rows)."""
    m = x.amax(1).to(F64) if x.shape[1] else torch.zeros(x.shape[0], dtype=F64, device=x.device)
    return torch.where(n_local > 0, m, torch.full_like(m, float("-inf")))


def _masked_extrema(x: torch.Tensor, mask: torch.Tensor):
    """Per-row (max, min) of ``x`` over ``mask`` in float64 (-inf / +inf for empty rows)."""
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    if x.shape[1] == 0:
        full = torch.full((x.shape[0],), float("inf"), dtype=F64, device=x.device)
        return -full, full
    return (torch.where(mask, x, -inf).amax(1).to(F64), torch.where(mask, x, inf).amin(1).to(F64))


def seq_columns(tok: TokenView, cfg: RolloutCorrectionConfig, cp_group,
                counter: CollectiveCounter) -> SeqColumns:
    """Per-sequence sums / maxima of this rank's tokens, completed over ``cp_group`` (1 all_gather)."""
    mask, T = tok.mask, tok.mask.shape[1]
    sums: Dict[str, torch.Tensor] = {}
    maxes: Dict[str, torch.Tensor] = {}
    n_local = mask.sum(1, dtype=F64)
    n_outside = T - n_local  # positions outside the mask, where ratio = 1 and k's = 0
    sums["n_tokens"] = n_local
    sums["n_invalid"] = n_local - tok.ok.sum(1, dtype=F64)
    sums["sum_lp_train"] = tok.lp_train.sum(1, dtype=F64)
    sums["sum_lp_rollout"] = tok.lp_rollout.sum(1, dtype=F64)
    # what the clamp removed, sum over |d| > 20 of (d - clamp(d)), from the exact log-probs
    beyond = tok.log_ratio.abs() > LOG_RATIO_CLAMP
    sums["clamp_excess"] = (_masked_sum(tok.lp_train, beyond) - _masked_sum(tok.lp_rollout, beyond)
                            - _masked_sum(tok.clamped, beyond))
    k3 = _k3(tok.clamped)
    sums["sum_k3"] = k3.sum(1)
    sums["sum_ratio_sq_m1"] = torch.expm1(2.0 * tok.clamped).sum(1, dtype=F64)  # r^2 - 1: 0 outside
    estimators = {o[-2:] for o in cfg.rs_options}
    if "k2" in estimators:
        sums["sum_k2"] = (0.5 * tok.clamped * tok.clamped).sum(1, dtype=F64)
    if "seq_max_k2" in cfg.rs_options:
        a = (tok.clamped.abs().amax(1) if T
             else torch.zeros(mask.shape[0], dtype=tok.clamped.dtype, device=mask.device))
        maxes["max_k2"] = torch.where(n_local > 0, (0.5 * a * a).to(F64), torch.full_like(n_local, float("-inf")))
    if "seq_max_k3" in cfg.rs_options:
        maxes["max_k3"] = _row_max(k3, n_local)
    if cfg.rollout_token_veto_threshold is not None:
        sums["n_catastrophic"] = (tok.log_ratio < math.log(cfg.rollout_token_veto_threshold)).sum(1, dtype=F64)
    sums["n_rs_rejected"] = ((mask & ~tok.rs_keep).sum(1, dtype=F64) if tok.rs_keep is not None
                             else torch.zeros_like(n_local))
    token_opts = [o for o in cfg.rs_options if is_token_option(o)]
    for opt in token_opts:
        lo, hi = cfg.rs_bounds[opt].stat_bounds
        stat = k3 if opt.endswith("k3") else _token_stat(opt, tok.clamped, tok.lp_train, tok.lp_rollout)
        if opt == "binary_kl":
            sums[f"{opt}/sum"] = _masked_sum(stat, mask)
        sums[f"{opt}/n_high"] = ((stat > hi) & mask).sum(1, dtype=F64)
        sums[f"{opt}/n_low"] = (((stat < lo) & mask).sum(1, dtype=F64) if opt.endswith("k1")
                                else torch.zeros_like(n_local))
        sc = torch.where(mask, stat.clamp(lo if opt.endswith("k1") else 0.0, hi), 0.0)
        sums[f"{opt}/sum_clamped"] = sc.sum(1, dtype=F64)
        sums[f"{opt}/sum_clamped_sq"] = (sc * sc).sum(1, dtype=F64)
        mx, mn = _masked_extrema(stat, mask)
        maxes[f"{opt}/max"], maxes[f"{opt}/neg_min"] = mx, -mn
    if tok.is_weight is not None:
        w, raw, isb = tok.is_weight, tok.is_raw, cfg.is_bounds
        sums["is_sum_w"] = w.sum(1, dtype=F64)
        sums["is_sum_w_sq"] = (w * w).sum(1, dtype=F64)
        sums["is_sum_raw"] = raw.sum(1, dtype=F64)
        sums["is_n_high"] = (raw > isb.upper).sum(1, dtype=F64)
        sums["is_n_low"] = (raw < isb.lower).sum(1, dtype=F64) - n_outside  # raw = 0 < lower outside
        if tok.rs_keep is not None and cfg.rollout_is_batch_normalize:
            sums["is_sum_w_rs_kept"] = torch.where(tok.rs_keep, w, 0.0).sum(1, dtype=F64)
        maxes["is_max"] = _row_max(w, n_local)
        maxes["is_neg_min"] = -_masked_extrema(w, mask)[1]
    sums, maxes = complete_over_cp(sums, maxes, cp_group, counter)
    sum_log_ratio = sums["sum_lp_train"] - sums["sum_lp_rollout"]
    return SeqColumns(
        n_tokens=sums["n_tokens"], n_invalid=sums["n_invalid"], sum_lp_train=sums["sum_lp_train"],
        sum_lp_rollout=sums["sum_lp_rollout"], sum_log_ratio=sum_log_ratio,
        sum_k1=sums["clamp_excess"] - sum_log_ratio, sum_k2=sums.get("sum_k2"), sum_k3=sums["sum_k3"],
        max_k2=maxes.get("max_k2"), max_k3=maxes.get("max_k3"), sum_ratio_sq_m1=sums["sum_ratio_sq_m1"],
        n_catastrophic=sums.get("n_catastrophic"), n_rs_rejected=sums["n_rs_rejected"],
        token_options={opt: TokenOptionColumns(
            n_high=sums[f"{opt}/n_high"], n_low=sums[f"{opt}/n_low"], sum_clamped=sums[f"{opt}/sum_clamped"],
            sum_clamped_sq=sums[f"{opt}/sum_clamped_sq"], max=maxes[f"{opt}/max"], min=-maxes[f"{opt}/neg_min"],
            sum=sums.get(f"{opt}/sum"))
            for opt in token_opts},
        is_sum_w=sums.get("is_sum_w"), is_sum_w_sq=sums.get("is_sum_w_sq"),
        is_sum_w_rs_kept=sums.get("is_sum_w_rs_kept"), is_sum_raw=sums.get("is_sum_raw"),
        is_n_high=sums.get("is_n_high"), is_n_low=sums.get("is_n_low"), is_max=maxes.get("is_max"),
        is_min=-maxes["is_neg_min"] if "is_neg_min" in maxes else None)


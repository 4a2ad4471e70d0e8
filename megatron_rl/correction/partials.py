"""Step 3 of the correction: every metric's partial sums and extrema, for one reduction over the group.

Almost everything is a sum or an extremum over the valid sequences of a per-sequence value (the
per-sequence columns already hold whole sequences): ``Reducer.add_seq_sum`` / ``add_seq_max`` /
``add_seq_min``. Only the ratio histogram is a per-token partial of this rank. Names are internal to
this module and :mod:`megatron_rl.correction.finalize`, which turns the reduced values into metrics.

Notation: per sequence ``n`` tokens, ``v`` an option's per-sequence statistic; "token sums" of a value
constant over a sequence's tokens are ``value * n``.
"""
from __future__ import annotations

import math

import torch

from megatron_rl.correction import histogram
from megatron_rl.correction.columns import SeqColumns, TokenView
from megatron_rl.correction.config import RolloutCorrectionConfig
from megatron_rl.correction.decisions import Decisions, OptionDecision
from megatron_rl.correction.reduce import Reducer
from megatron_rl.numerics import clamp_log_ratio, exp_clamped


def add_partials(red: Reducer, cfg: RolloutCorrectionConfig, tok: TokenView, seq: SeqColumns,
                 dec: Decisions) -> None:
    """Register every partial sum / extremum the metrics of ``cfg`` need."""
    _counts(red, seq, dec)
    _offpolicy(red, seq, dec)
    if dec.is_ is not None:
        _importance_sampling(red, cfg, tok, seq, dec)
    for opt, o in dec.options.items():
        _rejection_option(red, opt, o, seq)
    if dec.options:
        rejected_tokens = torch.where(dec.seq_keep, seq.n_rs_rejected, seq.n_tokens)
        red.add_seq_sum("rs/masked", rejected_tokens)
        red.add_seq_count("rs/seq_masked", ~dec.seq_keep | (seq.n_rs_rejected > 0))
    if seq.n_catastrophic is not None:
        red.add_seq_count("veto/seqs", dec.vetoed)
        red.add_seq_sum("veto/tokens", seq.n_catastrophic)


def _counts(red: Reducer, seq: SeqColumns, dec: Decisions) -> None:
    red.add_seq_sum("n_tok", seq.n_tokens)
    red.add_seq_count("n_seq", torch.ones_like(dec.valid))
    red.add_seq_sum("n_kept_tok", dec.kept_tokens)
    red.add_seq_count("n_kept_seq", dec.kept)
    # invalid values are counted in every sequence, not only the valid ones: owner-weighted directly
    red.add_sum("n_invalid_tok", seq.n_invalid.sum() * red.owner)
    red.add_sum("n_invalid_seq", dec.invalid.sum() * red.owner)


def _offpolicy(red: Reducer, seq: SeqColumns, dec: Decisions) -> None:
    mean_t = seq.sum_lp_train / seq.n_safe
    mean_r = seq.sum_lp_rollout / seq.n_safe
    diff = mean_r - mean_t
    red.add_seq_sum("op/log_ppl_t", -mean_t)
    red.add_seq_sum("op/ppl_t", exp_clamped(-mean_t))
    red.add_seq_sum("op/log_ppl_r", -mean_r)
    red.add_seq_sum("op/ppl_r", exp_clamped(-mean_r))
    red.add_seq_sum("op/kl", -seq.sum_log_ratio)
    red.add_seq_sum("op/k3", seq.sum_k3)
    red.add_seq_sum("op/lpd", diff)
    red.add_seq_sum("op/lpd_abs", diff.abs())
    red.add_seq_sum("op/ppl_ratio", exp_clamped(diff))
    red.add_seq_sum("op/chi2_tok_m1", seq.sum_ratio_sq_m1)
    red.add_seq_sum("op/chi2_seq", torch.exp(2.0 * clamp_log_ratio(seq.sum_log_ratio)))
    red.add_seq_max("op/lpd_max", diff)
    red.add_seq_min("op/lpd_min", diff)


def _importance_sampling(red: Reducer, cfg: RolloutCorrectionConfig, tok: TokenView, seq: SeqColumns,
                         dec: Decisions) -> None:
    b, d = cfg.is_bounds, dec.is_
    n = seq.n_tokens
    # w <= C always (truncated at C, or masked to [lo, C]), so clamp(w, 0, C) == w: "is/w" serves both
    # the mean weight and the clamped moments of std / ESS.
    if d.seq_log_ratio is None:  # token level
        red.add_seq_sum("is/w", seq.is_sum_w)
        red.add_seq_sum("is/w2", seq.is_sum_w_sq)
        red.add_seq_sum("is/high", seq.is_n_high)
        red.add_seq_sum("is/low", seq.is_n_low)
        red.add_seq_max("is/max", seq.is_max)
        red.add_seq_min("is/min", seq.is_min)
        if b.mask:
            red.add_seq_sum("is/oob", seq.is_n_high + seq.is_n_low)
    else:
        red.add_seq_sum("is/w", d.seq_weight * n)
        red.add_seq_sum("is/w2", d.seq_weight * d.seq_weight * n)
        red.add_seq_count("is/high", d.seq_log_ratio > math.log(b.upper))
        red.add_seq_count("is/low", d.seq_log_ratio < math.log(b.lower))
        red.add_seq_max("is/max_log", d.seq_log_ratio)
        red.add_seq_min("is/min_log", d.seq_log_ratio)
        if b.mask:
            red.add_seq_sum("is/oob", ((d.seq_raw < b.lower) | (d.seq_raw > b.upper)).to(n.dtype) * n)
    red.add_seq_sum("is/seq_sum", d.seq_weight)
    red.add_seq_sum("is/seq_sq", d.seq_weight * d.seq_weight)
    red.add_seq_count("is/seq_high", d.seq_raw > b.upper)
    red.add_seq_count("is/seq_low", d.seq_raw < b.lower)
    red.add_seq_max("is/seq_max", d.seq_weight)
    red.add_seq_min("is/seq_min", d.seq_weight)
    red.add_seq_max("is/seq_dev", (d.seq_weight - 1.0).abs())
    red.add_sum("is/hist", histogram.bin_counts(tok.clamped, tok.mask & dec.valid[:, None]))
    if cfg.rollout_is_batch_normalize:
        if cfg.rollout_is == "token":
            kept_w = seq.is_sum_w if seq.is_sum_w_rs_kept is None else seq.is_sum_w_rs_kept
            red.add_seq_sum("bn/num", torch.where(dec.row_keep, kept_w, torch.zeros_like(kept_w)))
            red.add_seq_sum("bn/den", dec.kept_tokens)
        else:
            red.add_seq_sum("bn/num", torch.where(dec.kept, d.seq_weight, torch.zeros_like(d.seq_weight)))
            red.add_seq_count("bn/den", dec.kept)


def _rejection_option(red: Reducer, opt: str, o: OptionDecision, seq: SeqColumns) -> None:
    """Partials of one RS option; k1 options also have a lower bound."""
    p, k1 = f"rs/{opt}/", opt.endswith("k1")
    n, v, lo, hi = seq.n_tokens, o.value, o.lower, o.upper
    if o.token_level:
        cols = seq.token_options[opt]
        red.add_seq_sum(p + "mean", seq.stat_sum(opt))
        red.add_seq_sum(p + "sc", cols.sum_clamped)
        red.add_seq_sum(p + "sc2", cols.sum_clamped_sq)
        red.add_seq_max(p + "max", cols.max)
        red.add_seq_min(p + "min", cols.min)
        red.add_seq_sum(p + "high", cols.n_high)
        red.add_seq_sum(p + "low", cols.n_low)
        red.add_seq_count(p + "seq_masked", o.n_rejected > 0)
    else:
        sc = v.clamp(lo if k1 else 0.0, hi)
        red.add_seq_sum(p + "mean", v * n)
        red.add_seq_sum(p + "sc", sc * n)
        red.add_seq_sum(p + "sc2", sc * sc * n)
        red.add_seq_count(p + "high", v > hi)
        red.add_seq_count(p + "low", (v < lo) if k1 else torch.zeros_like(v, dtype=torch.bool))
        red.add_seq_count(p + "seq_masked", ~o.keep)
    red.add_seq_sum(p + "masked", o.n_rejected)
    red.add_seq_sum(p + "seq_sum", v)
    red.add_seq_sum(p + "seq_sq", v * v)
    red.add_seq_count(p + "seq_high", v > hi)
    if k1:
        red.add_seq_count(p + "seq_low", v < lo)
    red.add_seq_max(p + "seq_max", v)
    red.add_seq_min(p + "seq_min", v)
    red.add_seq_max(p + "seq_dev", v.abs())

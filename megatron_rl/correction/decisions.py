"""Step 2 of the correction: per-sequence decisions from the (CP-complete) per-sequence columns.

Every decision here is a function of ``SeqColumns`` alone — whole sequences, identical on every CP
rank — so CP ranks holding different parts of a sequence always agree:

* validity: a sequence is valid when it has >= 1 response token and no invalid log-prob;
* IS: the per-sequence weight (sequence: exp(sum d), geometric: exp(mean d), both clamped at +-20,
  then truncated / masked) or, at token level, the sequence's mean token weight (for the metrics);
* RS: per option, the per-sequence statistic (token options: its mean) and, for sequence options,
  the keep decision; token options decide per token in ``columns.token_view``;
* veto: a valid sequence with a catastrophic token (d < log threshold) is dropped;
* the token mask after all of it: :func:`final_token_keep`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from megatron_rl.correction.columns import F64, SeqColumns, TokenView
from megatron_rl.correction.config import RolloutCorrectionConfig
from megatron_rl.correction.thresholds import is_token_option
from megatron_rl.numerics import exp_clamped


@dataclass
class ISDecision:
    """Per-sequence IS values ``[B]`` (float64)."""

    seq_weight: torch.Tensor
    """Sequence / geometric: the sequence's weight (broadcast to its tokens). Token: its mean token weight."""
    seq_raw: torch.Tensor
    """The same before truncation / masking."""
    seq_log_ratio: Optional[torch.Tensor]
    """Sequence: sum_t d; geometric: mean_t d (unclamped); None at token level."""


@dataclass
class OptionDecision:
    """One RS option's per-sequence statistic and decision."""

    lower: float
    """Lower bound L on the statistic (k1: -log hi; k2 / k3: 0)."""
    upper: float
    """Upper bound U on the statistic."""
    value: torch.Tensor
    """[B] per-sequence statistic: seq_sum / seq_mean / seq_max of k, or the mean token k (token options)."""
    keep: Optional[torch.Tensor]
    """[B] bool keep decision of a sequence-level option; None for token options (decided per token)."""
    n_rejected: torch.Tensor
    """[B] response tokens the option rejects."""

    @property
    def token_level(self) -> bool:
        """Whether the option decides per token."""
        return self.keep is None


@dataclass
class Decisions:
    """Per-sequence decisions ``[B]`` of one rank's rows (identical on every CP rank)."""

    valid: torch.Tensor
    """bool: >= 1 response token and no invalid log-prob."""
    invalid: torch.Tensor
    """bool: has response tokens with an invalid log-prob (rejected with on_invalid='reject')."""
    is_: Optional[ISDecision]
    """IS values; None when rollout_is is None."""
    options: Dict[str, OptionDecision]
    """Per RS option, in config order."""
    seq_keep: torch.Tensor
    """bool: every sequence-level RS option keeps the sequence."""
    vetoed: torch.Tensor
    """bool: valid and holds a catastrophic token."""
    row_keep: torch.Tensor
    """bool: valid, kept by every sequence-level option and not vetoed."""
    kept_tokens: torch.Tensor
    """float64: tokens left after every decision (token-level options included)."""

    @property
    def kept(self) -> torch.Tensor:
        """bool: sequences with at least one token left."""
        return self.kept_tokens > 0


def _is_decision(cfg: RolloutCorrectionConfig, seq: SeqColumns) -> Optional[ISDecision]:
    if cfg.rollout_is is None:
        return None
    if cfg.rollout_is == "token":
        return ISDecision(seq_weight=seq.is_sum_w / seq.n_safe, seq_raw=seq.is_sum_raw / seq.n_safe,
                          seq_log_ratio=None)
    log_ratio = seq.sum_log_ratio if cfg.rollout_is == "sequence" else seq.sum_log_ratio / seq.n_safe
    raw = exp_clamped(log_ratio)
    return ISDecision(seq_weight=cfg.is_bounds.apply(raw), seq_raw=raw, seq_log_ratio=log_ratio)


def _option_decision(opt: str, cfg: RolloutCorrectionConfig, seq: SeqColumns,
                     valid: torch.Tensor) -> OptionDecision:
    est = opt[-2:]
    lo, hi = cfg.rs_bounds[opt].stat_bounds
    total = seq.stat_sum(opt)
    if is_token_option(opt):
        return OptionDecision(lower=lo, upper=hi, value=total / seq.n_safe, keep=None,
                              n_rejected=seq.token_options[opt].n_rejected)
    if opt.startswith("seq_sum_"):
        value = total
    elif opt.startswith("seq_mean_"):
        value = total / seq.n_safe
    else:  # seq_max_k2 / seq_max_k3
        top = seq.max_k2 if est == "k2" else seq.max_k3
        value = torch.where(valid, top, torch.zeros_like(top))
    keep = (value >= lo) & (value <= hi) if est == "k1" else value <= hi
    return OptionDecision(lower=lo, upper=hi, value=value, keep=keep,
                          n_rejected=torch.where(keep, torch.zeros_like(seq.n_tokens), seq.n_tokens))


def decide(cfg: RolloutCorrectionConfig, seq: SeqColumns) -> Decisions:
    """Validity, IS weights, RS keep decisions and veto of every sequence."""
    has_tokens = seq.n_tokens > 0
    invalid = (seq.n_invalid > 0) & has_tokens
    valid = has_tokens & ~invalid
    options = {opt: _option_decision(opt, cfg, seq, valid) for opt in cfg.rs_options}
    seq_keep = torch.ones_like(valid)
    for o in options.values():
        if o.keep is not None:
            seq_keep &= o.keep
    vetoed = ((seq.n_catastrophic > 0) & valid if seq.n_catastrophic is not None
              else torch.zeros_like(valid))
    row_keep = valid & seq_keep & ~vetoed
    kept_tokens = torch.where(row_keep, seq.n_tokens - seq.n_rs_rejected, torch.zeros((), dtype=F64))
    return Decisions(valid=valid, invalid=invalid, is_=_is_decision(cfg, seq), options=options,
                     seq_keep=seq_keep, vetoed=vetoed, row_keep=row_keep, kept_tokens=kept_tokens)


def final_token_keep(tok: TokenView, dec: Decisions) -> torch.Tensor:
    """bool [B, T]: response tokens of kept sequences that every token-level option keeps."""
    keep = tok.mask & dec.row_keep[:, None]
    return keep if tok.rs_keep is None else keep & tok.rs_keep


def output_weights(tok: TokenView, dec: Decisions, keep: torch.Tensor, factor: float) -> torch.Tensor:
    """[B, T] fp32 IS weights / ``factor`` (batch normalisation; 1.0: none) on ``keep`` tokens, 0 elsewhere
    (detached): each token's own weight at token level, its sequence's weight otherwise."""
    zero = torch.zeros((), dtype=torch.float32, device=keep.device)
    if tok.is_weight is not None:  # token level
        w = tok.is_weight if factor == 1.0 else tok.is_weight / factor
        return torch.where(keep, w.to(torch.float32), zero)
    per_seq = (dec.is_.seq_weight / factor).to(torch.float32)
    return torch.where(keep, per_seq[:, None], zero)

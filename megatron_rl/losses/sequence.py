"""Sequence-level objectives' term functions (GSPO, GMPO ``geo_mean``, OPSM) from per-sequence sums.

The one rule: under context parallelism each rank holds a time slice of every sequence, so the per-sequence
sums are summed locally and all-reduced over ``cp_group`` (detached [B] float64, one collective per sum) and
``seq_valid_tokens`` gives the whole sequences' token counts; no token is gathered. A whole sequence's loss is
written as a per-token loss whose sum over the sequence's tokens (on all CP ranks) equals it in value and
gradient, so the usual aggregation and megatron's CP gradient reduction give the single-process result.
The formulas and their differences from verl / slime are in docs/objectives.md.
"""
from __future__ import annotations

import torch

from megatron_rl.parallel.devices import all_reduce_

from .objectives import vanilla
from .terms import ObjectiveInputs, ObjectiveTerms


def sequence_sums(values: torch.Tensor, valid: torch.Tensor, cp_group=None) -> torch.Tensor:
    """[B] float64 sums of ``values`` over the valid positions of each sequence, summed over ``cp_group``
    (detached; one all_reduce; ``cp_group=None``: no communication)."""
    v = torch.where(valid, values.detach().to(torch.float64), torch.zeros((), dtype=torch.float64,
                                                                          device=values.device))
    sums = v.sum(dim=-1)
    if cp_group is not None:
        all_reduce_(sums, group=cp_group)
    return sums


def _lengths(x: ObjectiveInputs) -> torch.Tensor:
    n = x.valid.sum(dim=-1).to(torch.float64) if x.seq_valid_tokens is None else x.seq_valid_tokens
    return n.to(torch.float64).clamp(min=1)


def gspo(x: ObjectiveInputs) -> ObjectiveTerms:
    c = x.config
    lr = x.log_probs - x.old_log_probs
    seq_lr = (sequence_sums(lr, x.valid, x.cp_group) / _lengths(x)).to(lr.dtype)
    log_s = torch.clamp(x.log_probs - x.log_probs.detach() + seq_lr.unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    l1 = -x.advantages * s
    l2 = -x.advantages * torch.clamp(s, 1.0 - c.clip_ratio_low, 1.0 + c.clip_ratio_high)
    loss = torch.maximum(l1, l2)
    if x.is_weights is not None:
        loss = loss * x.is_weights
    zeros = torch.zeros_like(lr, dtype=torch.float64).detach()
    return ObjectiveTerms(loss, (l2 > l1).detach().double(), zeros, -lr.detach())


def geo_mean(x: ObjectiveInputs) -> ObjectiveTerms:
    c = x.config
    lr = x.log_probs - x.old_log_probs
    sgn = torch.sign(x.advantages)
    lr_clamped = torch.clamp(lr, -c.clip_ratio_low, c.clip_ratio_high)
    lr_min = sgn * torch.minimum(sgn * lr, sgn * lr_clamped)
    n = _lengths(x)
    log_ratio = sequence_sums(lr_min, x.valid, x.cp_group) / n
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    adv = sequence_sums(x.advantages, x.valid, x.cp_group) / n
    coef = -adv
    if x.is_weights is not None:
        coef = coef * torch.exp(sequence_sums(torch.log(x.is_weights + 1e-10), x.valid, x.cp_group) / n)
    seq_loss = (coef * ratio).to(lr.dtype)              # value of each whole sequence's loss
    grad_scale = (coef * ratio / n).to(lr.dtype)         # d seq_loss / d lr_min_t
    per_token = (seq_loss / n.to(lr.dtype)).unsqueeze(-1) + grad_scale.unsqueeze(-1) * (lr_min - lr_min.detach())
    clipped = (lr != lr_clamped).detach()
    pos, neg = (x.advantages > 0), (x.advantages < 0)
    return ObjectiveTerms(per_token, (clipped & pos).double(), (clipped & neg).double(), -lr.detach())


def opsm(x: ObjectiveInputs) -> ObjectiveTerms:
    base = vanilla(x)
    seq_kl = sequence_sums(x.old_log_probs - x.log_probs.detach(), x.valid, x.cp_group) / _lengths(x)
    masked = (x.advantages < 0) & (seq_kl.unsqueeze(-1) > x.config.opsm_delta)
    base.loss = torch.where(masked, torch.zeros((), dtype=base.loss.dtype, device=base.loss.device), base.loss)
    base.extra["opsm_clipfrac"] = masked.double()
    return base

"""Bypass mode: IS weights and rejection from the CURRENT log-probs of one micro-batch (verl's bypass loss).

What the actor's loss calls in bypass mode (``actor/train_step.py``), so weights and decisions follow pi_theta
over several optimizer steps per training step: the same ``columns`` / ``decisions`` steps as
``compute_rollout_correction``, no metrics. Every decision is per token or per sequence, so it does not depend on
the micro-batch cut, DP or PP, except the ``rollout_is_batch_normalize`` factor, which is this DP rank's
micro-batch's (no collective leaves the CP group). The exceptions in full: docs/correction.md.

    lc = correct_in_loss(log_probs.detach(), rollout_log_probs, base_mask, cfg, cp_group=cp_group)
    lc.keep, lc.weights, lc.kept_tokens    # kept tokens; IS weights or None; per-sequence kept-token counts
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.correction.columns import F64, TokenView, seq_columns, token_view
from megatron_rl.correction.config import RolloutCorrectionConfig
from megatron_rl.correction.decisions import Decisions, decide, final_token_keep, output_weights
from megatron_rl.correction.reduce import CollectiveCounter, group_size
from megatron_rl.correction.validation import check_structure
from megatron_rl.parallel.devices import all_reduce_

__all__ = ["LossCorrection", "correct_in_loss"]


@dataclass
class LossCorrection:
    """What the policy loss of one micro-batch applies in bypass mode (:func:`correct_in_loss`)."""

    keep: torch.Tensor
    """[B, T] bool: tokens of the policy term (``base_mask`` after rejection, veto and invalid sequences)."""
    weights: Optional[torch.Tensor]
    """[B, T] fp32 IS weights pi_theta / pi_rollout (truncated / masked, batch-normalised), detached, 0 where not
    ``keep``; None when ``rollout_is`` is None."""
    kept_tokens: torch.Tensor
    """[B] float64 kept tokens of each whole sequence (summed over the CP group)."""
    batch_norm_factor: float = 1.0
    """The divisor of ``weights`` (1.0 without batch normalisation)."""


def correct_in_loss(log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, base_mask: torch.Tensor,
                    cfg: RolloutCorrectionConfig, cp_group=None) -> LossCorrection:
    """IS weights and rejection of one micro-batch from its current log-probs (see the module docstring).

    Args:
        log_probs: [B, T] log pi_theta of the sampled tokens from this forward pass (detached or not: read only).
        rollout_log_probs: [B, T] log pi_rollout (the bypass loss's old log-probs).
        base_mask: [B, T] the tokens the loss starts from (before rejection); with CP, this rank's tokens.
        cfg: the correction settings (``rollout_is``, ``rollout_rs``, veto, batch normalisation).
        cp_group: the context-parallel group the sequences are split over; None: whole sequences here.
    Collectives: over ``cp_group`` only (1 all_gather; +1 all_reduce with token-level batch normalisation).
    """
    check_structure(log_probs, rollout_log_probs, base_mask)
    counter = CollectiveCounter()
    tok = token_view(log_probs, rollout_log_probs, base_mask, cfg)
    dec = decide(cfg, seq_columns(tok, cfg, cp_group, counter))
    keep = final_token_keep(tok, dec)
    weights, factor = None, 1.0
    if cfg.rollout_is is not None:
        factor = _micro_batch_norm_factor(cfg, tok, dec, keep, cp_group)
        weights = output_weights(tok, dec, keep, factor)
    return LossCorrection(keep=keep, weights=weights, kept_tokens=dec.kept_tokens, batch_norm_factor=factor)


def _micro_batch_norm_factor(cfg: RolloutCorrectionConfig, tok: TokenView, dec: Decisions, keep: torch.Tensor,
                             cp_group) -> float:
    """The mean weight over this micro-batch's kept tokens (token level; summed over ``cp_group``) or kept
    sequences (whole on every CP rank); 1.0 when off, empty or <= 1e-8 (as ``finalize.batch_norm_factor``)."""
    if not cfg.rollout_is_batch_normalize:
        return 1.0
    if tok.is_weight is not None:
        zero = torch.zeros((), dtype=tok.is_weight.dtype, device=keep.device)
        pack = torch.stack([torch.where(keep, tok.is_weight, zero).sum(dtype=F64), keep.sum(dtype=F64)])
        if group_size(cp_group) > 1:
            all_reduce_(pack, group=cp_group)
    else:
        w = dec.is_.seq_weight
        pack = torch.stack([torch.where(dec.kept, w, torch.zeros_like(w)).sum(), dec.kept.sum(dtype=F64)])
    num, den = pack.tolist()
    mean = num / den if den > 0 else 0.0
    return mean if mean > 1e-8 else 1.0

"""Bypass mode: IS weights and rejection from the CURRENT log-probs of one micro-batch (verl's bypass loss).

In bypass mode (``bypass_mode: true``) the old policy of the loss is the rollout's and verl 0.9.1's loss
(``core_algos.compute_policy_loss_bypass_mode``) computes the IS weights pi_theta / pi_rollout and the rejection
mask from the log-probs of the forward pass it is in, in every micro-batch of every optimizer step. With several
optimizer steps per training step (``actor.ppo_epochs`` / ``actor.ppo_mini_batches`` > 1) pi_theta moves between
them, so weights and decisions of the step's first log-prob pass would be stale. :func:`correct_in_loss` is what the
actor's loss calls instead (``actor/train_step.py``)::

    lc = correct_in_loss(log_probs.detach(), rollout_log_probs, base_mask, cfg, cp_group=cp_group)
    lc.keep          # the policy term's tokens (rejection and veto applied)
    lc.weights       # [B, T] IS weights (0 where not kept) or None; reinforce applies them, ppo_clip does not
    lc.kept_tokens   # [B] whole-sequence kept tokens (seq-mean-token-mean's per-sequence divisor)

The same steps as :func:`~megatron_rl.correction.compute_rollout_correction` — ``columns`` (sequence sums completed
over ``cp_group``: 1 all_gather) and ``decisions`` — so a decision here is the one the first pass takes on the same
log-probs; no metric is computed (the ``rollout_corr/*`` metrics are the step's first pass). Every decision is per
token or per sequence, so the result does not depend on the micro-batch cut, on DP, or on PP (the loss runs on the
last stage, where the log-probs are), except the ``rollout_is_batch_normalize`` factor (below); sequences split over
CP ranks get whole-sequence sums.

Exceptions, decided here:
  * ``base_mask`` is the response mask the loss starts from — before rejection (verl: the trainer rejects nothing in
    bypass mode), sequences the first pass found invalid already removed (``CorrectionResult.loss_mask``);
  * batch normalisation (``rollout_is_batch_normalize``) divides by the mean weight over this micro-batch's kept
    tokens (token level) or kept sequences (sequence / geometric level), whole sequences over ``cp_group`` (token
    level: 1 all_reduce). verl normalises per micro-batch too, but all-reduces over every rank (the world group:
    the k-th micro-batch of every rank, a hang when ranks hold different numbers of micro-batches) and over the
    mask before rejection; here no collective leaves the CP group, so the factor is this DP rank's micro-batch's:
    the weights depend on the DP size and the micro-batch cut (``actor.micro_batch_size`` /
    ``max_tokens_per_micro_batch``, packing).
  * invalid current log-probs (NaN, inf, > 1e-3) on ``base_mask`` tokens reject their sequence here; the policy
    loss's own input check (``losses.validation``) then raises on them, as in every mode.
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

"""``compute_rollout_correction``: IS weights, rejection mask and metrics, exact under DP / CP.

Inputs are one rank's share of the batch (``[B, T]`` trainer and rollout log-probs, the response mask). With
``group`` (the ranks holding distinct tokens: Megatron's DP group *with* CP) every weight and metric equals the
single-process result on the concatenated batch; with ``cp_group`` every sequence-level decision equals the
unsplit one; at most 3 collectives per call, whatever the number of metrics. Four steps, each its own module:
``columns`` -> ``decisions`` -> ``partials`` -> ``finalize``. The rule to keep: IS weights are computed on the
pre-rejection mask, then zeroed where rejection / veto / padding removed a token. What the loss receives in
decoupled and bypass mode, and the full semantics: docs/correction.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from megatron_rl.correction.columns import TokenView, seq_columns, token_view
from megatron_rl.correction.config import RolloutCorrectionConfig
from megatron_rl.correction.decisions import decide, final_token_keep, output_weights
from megatron_rl.correction.finalize import PREFIX, batch_norm_factor, finalize_metrics
from megatron_rl.correction.partials import add_partials
from megatron_rl.correction.reduce import CollectiveCounter, Reducer, check_groups, group_rank, group_size
from megatron_rl.correction.validation import check_structure, describe_invalid, invalid_tokens
from megatron_rl.numerics import LOG_PROB_TOLERANCE


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
    old_from_rollout: bool = False
    """The policy loss's old policy is the rollout engine's log-probs (bypass mode), not the train log-probs the
    correction was given (decoupled)."""
    weights_in_loss: bool = True
    """The policy loss applies IS weights (False in bypass mode with ppo_clip: its ratio pi_theta / pi_rollout
    already is the correction, the weights feed the metrics only)."""
    valid_mask: Optional[torch.Tensor] = None
    """[B, T] the response mask without the invalid sequences (``on_invalid: reject``), before rejection sampling
    and veto (input dtype): the mask bypass mode's loss starts from (``loss_mask``)."""

    @property
    def recomputed_in_loss(self) -> bool:
        """Bypass mode: the policy loss recomputes the IS weights and the rejection from its current log-probs in
        every micro-batch (``correction.in_loss.correct_in_loss``); ``weights`` / ``response_mask`` here are the
        first pass's (the metrics')."""
        return self.old_from_rollout

    @property
    def loss_weights(self) -> Optional[torch.Tensor]:
        """[B, T] the IS weights the policy loss is given (None: none, or recomputed in the loss: bypass mode)."""
        return self.weights if self.weights_in_loss and not self.recomputed_in_loss else None

    @property
    def loss_mask(self) -> torch.Tensor:
        """[B, T] the mask the policy loss (and the advantages) are given: ``response_mask`` (decoupled), or
        ``valid_mask`` in bypass mode (the loss rejects in every micro-batch from its current log-probs)."""
        if not self.recomputed_in_loss:
            return self.response_mask
        if self.valid_mask is None:
            raise ValueError("CorrectionResult: bypass mode needs valid_mask (the mask before rejection)")
        return self.valid_mask

    def loss_inputs(self, train_log_probs: Optional[torch.Tensor], rollout_log_probs: Optional[torch.Tensor]
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(old log-probs, IS weights) the policy loss is given, of the train / rollout log-probs this correction was
        computed from (``Objective.loss_inputs``; bypass mode: no weights, the loss computes them); with
        ``loss_mask``, what ``MegatronActor.train_step`` takes. ``ValueError`` naming the missing one."""
        old = rollout_log_probs if self.old_from_rollout else train_log_probs
        if old is None:
            raise ValueError("the policy loss's old log-probs are the " + (
                "rollout log-probs (bypass_mode) but they are None" if self.old_from_rollout else
                "trainer's recomputed log-probs (bypass_mode=False) but they are None"))
        return old, self.loss_weights


def compute_rollout_correction(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                               response_mask: torch.Tensor, cfg: RolloutCorrectionConfig,
                               group=None, cp_group=None) -> CorrectionResult:
    """Correct the rollout-vs-training mismatch of one rank's share of the batch.

    Args:
        train_log_probs: [B, T] log pi_train of the sampled tokens (the actor's recompute, fp32
                log-softmax of its logits -- bf16 ones with ``actor.bf16`` --, or the old policy).
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
        ValueError: bad shapes / dtypes / mask values, or a ``cp_group`` not contained in ``group``
            (at once, before any collective), or invalid log-probs with ``cfg.on_invalid == "raise"``
            (on every rank of ``group`` together, after the reduction).
    """
    check_structure(train_log_probs, rollout_log_probs, response_mask)
    check_groups(group, cp_group)
    counter = CollectiveCounter()
    tok = token_view(train_log_probs, rollout_log_probs, response_mask, cfg)
    seq = seq_columns(tok, cfg, cp_group, counter)                              # 1. columns
    dec = decide(cfg, seq)                                                      # 2. decisions
    red = Reducer(train_log_probs.device, dec.valid, owner=group_rank(cp_group) == 0)
    add_partials(red, cfg, tok, seq, dec)                                       # 3. partial sums
    sums, extrema = red.reduce(group, counter)
    _raise_if_invalid(cfg, sums, group, train_log_probs, rollout_log_probs, tok)
    metrics = finalize_metrics(cfg, sums, extrema)                              # 4. finalize
    keep = final_token_keep(tok, dec)
    weights = None
    if cfg.rollout_is is not None:
        factor = batch_norm_factor(cfg, sums)
        if cfg.rollout_is_batch_normalize:
            metrics[PREFIX + "rollout_is_batch_norm_factor"] = factor
        weights = output_weights(tok, dec, keep, factor)
    new_mask = keep if response_mask.dtype == torch.bool else keep.to(response_mask.dtype)
    valid = tok.mask & dec.valid[:, None]
    old_from_rollout = cfg.objective.old_from_rollout(cfg.bypass_mode)      # the objective's row says
    weights_in_loss = cfg.objective.applies_is_weights(cfg.bypass_mode)
    return CorrectionResult(weights=weights, response_mask=new_mask, metrics=metrics,
                            num_collectives=counter.count, old_from_rollout=old_from_rollout,
                            weights_in_loss=weights_in_loss,
                            valid_mask=valid if response_mask.dtype == torch.bool else valid.to(response_mask.dtype))


def _raise_if_invalid(cfg: RolloutCorrectionConfig, sums, group, train_log_probs: torch.Tensor,
                      rollout_log_probs: torch.Tensor, tok: TokenView) -> None:
    """With on_invalid='raise', raise on every rank of the group when any rank saw invalid log-probs."""
    n_bad_global = int(round(float(sums["n_invalid_tok"])))
    if not n_bad_global or cfg.on_invalid != "raise":
        return
    note = f" on rank {group_rank(group)} of the group" if group_size(group) > 1 else ""
    parts = []
    for name, t in (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs)):
        bad = invalid_tokens(t, tok.mask)
        if bad.any():
            parts.append(describe_invalid(name, t, bad, note, n_bad_global))
    raise ValueError("; ".join(parts) if parts else
                     f"{n_bad_global} invalid log-prob values (NaN, inf or > {LOG_PROB_TOLERANCE}) on other ranks "
                     f"of the group (none on this rank); set on_invalid='reject' to drop those sequences")

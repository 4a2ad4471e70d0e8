"""Loss aggregation ([B, T] per-token losses -> scalar) in verl's five modes, with GLOBAL denominators.

The one rule: every mode is a sum of per-sequence terms divided by a global constant (``LossDenominators``: valid
tokens / sequences of the whole optimizer step over micro-batches, DP and CP ranks), so the per-micro-batch losses
summed over micro-batches and ranks equal the full-batch loss exactly, gradients included. Without denominators
the local batch's counts are used. Empty sequences count 0; a batch without a valid token gives 0, never NaN.
The formulas, the seq-mean-token-sum-norm divisor and megatron's loss scaling: docs/objectives.md, "Aggregation".
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from megatron_rl.parallel.devices import all_reduce_

from .config import LOSS_AGG_MODES, PolicyLossConfig

Number = Union[int, float, torch.Tensor]


@dataclass(frozen=True)
class LossDenominators:
    """Global normalisers of the aggregation modes (Python numbers or 0-d tensors)."""

    num_tokens: Number
    """Valid (mask == 1) tokens in the global batch: all micro-batches of all DP ranks (and all CP
    ranks) that are summed into one optimizer step. Used by ``token-mean``."""

    num_seqs: Number
    """Sequences with at least one valid token in the global batch. Used by the seq-mean modes."""


def sequence_token_counts(response_mask: torch.Tensor, cp_group=None) -> torch.Tensor:
    """Valid tokens per sequence, [B] float64. With ``cp_group`` (sequences split along time over
    its ranks) the counts are summed over it (one all_reduce) so every rank sees full-sequence
    counts. ``cp_group=None`` means no communication."""
    counts = (response_mask != 0).sum(dim=-1).to(torch.float64)
    if cp_group is not None:
        all_reduce_(counts, group=cp_group)
    return counts


def local_denominators(response_mask: torch.Tensor,
                       seq_valid_tokens: Optional[torch.Tensor] = None) -> LossDenominators:
    """Denominators of this batch alone (0-d float64 tensors; no communication)."""
    counts = sequence_token_counts(response_mask) if seq_valid_tokens is None else seq_valid_tokens
    return LossDenominators(num_tokens=counts.sum(), num_seqs=(counts > 0).sum().to(torch.float64))


def global_denominators(response_masks: Union[torch.Tensor, Sequence[torch.Tensor]], group=None,
                        cp_group=None) -> LossDenominators:
    """Denominators of the global batch: this rank's micro-batches summed, then reduced.

    Args:
        response_masks: the [B_k, T_k] masks (after rejection sampling) of every micro-batch this
            rank will accumulate into the optimizer step, or one mask.
        group: data-parallel process group to sum over (one packed all_reduce); None = no
            communication (single process). Never defaults to WORLD.
        cp_group: context-parallel group when sequences are split along time over its ranks: the
            per-sequence counts are summed over it first (one all_reduce) so a sequence is counted
            once, with its full length. ``group`` must then be the DP group WITHOUT the CP ranks.
    Returns:
        ``LossDenominators`` with 0-d float64 tensors, identical on every rank.
    """
    masks = [response_masks] if isinstance(response_masks, torch.Tensor) else list(response_masks)
    if not masks:
        raise ValueError("global_denominators: response_masks is empty (pass at least one [B, T] mask)")
    for k, m in enumerate(masks):
        if not isinstance(m, torch.Tensor) or m.dim() != 2:
            raise ValueError(f"global_denominators: response_masks[{k}] must be a 2-D [B, T] tensor, got "
                             f"{tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__}")
    counts = torch.cat([(m != 0).sum(dim=-1).to(torch.float64) for m in masks])
    if cp_group is not None:
        all_reduce_(counts, group=cp_group)
    packed = torch.stack([counts.sum(), (counts > 0).sum().to(torch.float64)])
    if group is not None:
        all_reduce_(packed, group=group)  # staged for the group's backend
    return LossDenominators(num_tokens=packed[0], num_seqs=packed[1])


def with_norm_divisor(cfg: PolicyLossConfig, response_budget: int) -> PolicyLossConfig:
    """``cfg`` with the ``seq-mean-token-sum-norm`` divisor set to ``response_budget`` (the most response-side
    tokens a row of the job holds) when it is not configured: verl's default, the width of its response mask,
    which verl pads to the configured response length. Other modes, or a set factor: ``cfg`` as is."""
    if cfg.loss_agg_mode != "seq-mean-token-sum-norm" or cfg.loss_scale_factor is not None:
        return cfg
    if isinstance(response_budget, bool) or not isinstance(response_budget, int) or response_budget < 1:
        raise ValueError(f"with_norm_divisor: response_budget must be an int >= 1, got {response_budget!r}")
    return dataclasses.replace(cfg, loss_scale_factor=float(response_budget))


def _as_denominator(name: str, value: Number, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"LossDenominators.{name} must be a scalar, got shape {tuple(value.shape)}")
        value = value.reshape(())
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"LossDenominators.{name} must be a finite number >= 0, got {value!r}")
    # float64 keeps token counts above 2^24 exact. Counts are integers, so clamping at 1 only
    # changes an empty batch (numerator 0 -> loss 0, never 0/0).
    return torch.as_tensor(value, dtype=torch.float64, device=like.device).clamp(min=1)


def _divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return (numerator.to(torch.float64) / denominator).to(numerator.dtype)


def aggregate_loss(per_token_loss: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str,
                   denominators: Optional[LossDenominators] = None, *,
                   loss_scale_factor: Optional[float] = None,
                   seq_valid_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Aggregate a [B, T] per-token loss into a scalar (see the module docstring for the formulas).

    Args:
        per_token_loss: [B, T] loss; entries where the mask is 0 are ignored (even NaN).
        response_mask: [B, T] 0/1 or bool mask (after rejection sampling).
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        denominators: global ``LossDenominators``; None = this batch's own counts.
        loss_scale_factor: ``seq-mean-token-sum-norm`` constant; None = ``per_token_loss.shape[-1]``.
        seq_valid_tokens: [B] valid-token count of each whole sequence (context parallel);
            None = counted from ``response_mask``. Only ``seq-mean-token-mean`` uses it.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {list(LOSS_AGG_MODES)}, got {loss_agg_mode!r}")
    if per_token_loss.shape != response_mask.shape or per_token_loss.dim() != 2:
        raise ValueError(f"aggregate_loss: per_token_loss shape {tuple(per_token_loss.shape)} and "
                         f"response_mask shape {tuple(response_mask.shape)} must be equal and 2-D")
    if seq_valid_tokens is not None and tuple(seq_valid_tokens.shape) != (per_token_loss.shape[0],):
        raise ValueError(f"seq_valid_tokens must have shape ({per_token_loss.shape[0]},), got "
                         f"{tuple(seq_valid_tokens.shape)}")
    valid = response_mask != 0
    loss = torch.where(valid, per_token_loss, torch.zeros((), dtype=per_token_loss.dtype,
                                                           device=per_token_loss.device))
    if denominators is None:
        denominators = local_denominators(response_mask, seq_valid_tokens)
    seq_sum = loss.sum(dim=-1)
    if loss_agg_mode == "token-mean":
        return _divide(seq_sum.sum(), _as_denominator("num_tokens", denominators.num_tokens, loss))
    if loss_agg_mode == "token-sum":
        return seq_sum.sum()
    num_seqs = _as_denominator("num_seqs", denominators.num_seqs, loss)
    if loss_agg_mode == "seq-mean-token-sum":
        return _divide(seq_sum.sum(), num_seqs)
    if loss_agg_mode == "seq-mean-token-mean":
        n = valid.sum(dim=-1) if seq_valid_tokens is None else seq_valid_tokens
        # Exact per-sequence mean (no epsilon): an empty sequence has seq_sum == 0 -> 0.
        return _divide((seq_sum / n.to(loss.dtype).clamp(min=1)).sum(), num_seqs)
    factor = per_token_loss.shape[-1] if loss_scale_factor is None else loss_scale_factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"loss_scale_factor must be a finite number > 0, got {factor!r}")
    return _divide(seq_sum.sum(), num_seqs * float(factor))

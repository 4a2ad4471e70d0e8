"""Input checks of the correction step: shapes, dtypes, 0/1 masks, and invalid log-probs.

Structural problems (shape, dtype, device, non-0/1 mask) raise at once with the tensor's name.
Invalid *values* (NaN, inf, or a log-prob above ``LOG_PROB_TOLERANCE`` on a valid token) are located here
but the decision is taken after the first collective, so that every rank of the group raises (or
rejects) together instead of one rank raising while the others wait in a collective.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.numerics import LOG_PROB_TOLERANCE


def _first_position(bad: torch.Tensor) -> tuple:
    idx = bad.nonzero()[0].tolist()
    return tuple(idx)


def check_structure(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                    response_mask: torch.Tensor) -> None:
    """Raise ValueError on wrong types, shapes, dtypes, devices, or a mask that is not 0/1."""
    for name, t in (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs),
                    ("response_mask", response_mask)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected shape [batch, response_len], got {tuple(t.shape)}")
    for name, t in (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs)):
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, got {t.dtype}")
        if t.shape != response_mask.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not match response_mask "
                             f"shape {tuple(response_mask.shape)}")
        if t.device != response_mask.device:
            raise ValueError(f"{name}: on {t.device}, response_mask on {response_mask.device}: the correction "
                             f"runs where the actor's log-probs are; move the rollout batch there once "
                             f"(RolloutBatch.to(device))")
    if response_mask.dtype != torch.bool:
        bad = (response_mask != 0) & (response_mask != 1)
        if bad.any():
            pos = _first_position(bad)
            raise ValueError(f"response_mask: {int(bad.sum())} values are not 0/1, first at "
                             f"[seq {pos[0]}, token {pos[1]}] = {response_mask[pos].item()!r}")


def invalid_tokens(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Bool [B, T]: valid tokens whose log-prob is NaN, inf, or > LOG_PROB_TOLERANCE."""
    return mask & (~torch.isfinite(log_probs) | (log_probs > LOG_PROB_TOLERANCE))


def describe_invalid(name: str, log_probs: torch.Tensor, bad: torch.Tensor, rank_note: str,
                     global_count: Optional[int] = None) -> str:
    """One-line description: tensor, count, first position and value."""
    n = int(bad.sum())
    msg = f"{name}: {n} invalid values (NaN, inf or > {LOG_PROB_TOLERANCE}) on valid tokens{rank_note}"
    if n:
        pos = _first_position(bad)
        msg += f", first at [seq {pos[0]}, token {pos[1]}] = {log_probs[pos].item()!r}"
    if global_count is not None:
        msg += f"; {global_count} invalid tokens across the group"
    return msg

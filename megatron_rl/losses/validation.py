"""Input checks for the loss functions: shapes, dtypes, 0/1 masks, NaN/inf, positive log-probs.

Every check runs before any loss math, and all value checks together cost ONE device->host sync
(the bad-value counts of every tensor are stacked and read at once); the position of the first bad
value is computed only when something is wrong. Errors are ``ValueError`` naming the tensor, its
shape, the number of bad values and the first bad position ``(row, col)``.

Values are checked only where ``response_mask == 1``: padding and rejected tokens may hold anything
(NaN rollout log-probs of a sequence the correction rejected, -inf from an engine's padding) and are
replaced by 0 before the loss math (see ``sanitize``), so they can never leak NaN into the loss or
the gradient.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch

from megatron_rl.numerics import LOG_PROB_TOLERANCE


def _first_position(bad: torch.Tensor) -> tuple:
    return tuple(int(i) for i in torch.nonzero(bad)[0].tolist())


def check_shapes(reference_name: str, reference: torch.Tensor,
                 tensors: Dict[str, Optional[torch.Tensor]]) -> None:
    """Raise ValueError unless ``reference`` is a 2-D [B, T] tensor and every non-None tensor in
    ``tensors`` is a tensor of the same shape (names the tensor and both shapes)."""
    if not isinstance(reference, torch.Tensor):
        raise ValueError(f"{reference_name} must be a torch.Tensor, got {type(reference).__name__}")
    if reference.dim() != 2:
        raise ValueError(f"{reference_name} must be 2-D [batch, response_length], got shape "
                         f"{tuple(reference.shape)}")
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != reference.shape:
            raise ValueError(f"shape mismatch: {name} has shape {tuple(t.shape)} but {reference_name} "
                             f"has shape {tuple(reference.shape)}")


def check_float_dtypes(tensors: Dict[str, Optional[torch.Tensor]]) -> None:
    """Raise ValueError if a non-None tensor is not floating point (names tensor and dtype)."""
    for name, t in tensors.items():
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def validate_values(response_mask: torch.Tensor, tensors: Dict[str, Optional[torch.Tensor]], *,
                    log_prob_names: Iterable[str] = (), nonnegative_names: Iterable[str] = ()) -> torch.Tensor:
    """Check values with one host sync and return the mask as a bool tensor.

    * ``response_mask`` must hold only 0/1 (bool masks always do);
    * every tensor must be finite where the mask is 1;
    * tensors in ``log_prob_names`` must be <= ``LOG_PROB_TOLERANCE`` where the mask is 1;
    * tensors in ``nonnegative_names`` (IS weights) must be >= 0 where the mask is 1.
    """
    log_prob_names, nonnegative_names = set(log_prob_names), set(nonnegative_names)
    checks = []  # (message prefix, bad-bool tensor)
    if response_mask.dtype == torch.bool:
        valid = response_mask
    else:
        not01 = ~((response_mask == 0) | (response_mask == 1))
        checks.append(("response_mask must contain only 0 and 1", not01))
        valid = response_mask == 1
    for name, t in tensors.items():
        if t is None:
            continue
        checks.append((f"{name} has NaN/inf values at valid (mask=1) positions", ~torch.isfinite(t) & valid))
        if name in log_prob_names:
            checks.append((f"{name} has positive log-probabilities (> {LOG_PROB_TOLERANCE}) at valid "
                           f"positions", (t > LOG_PROB_TOLERANCE) & valid))
        if name in nonnegative_names:
            checks.append((f"{name} has negative values at valid positions", (t < 0) & valid))
    counts = torch.stack([bad.sum() for _, bad in checks]).tolist() if checks else []
    for (msg, bad), n in zip(checks, counts):
        if n:
            raise ValueError(f"{msg}: {int(n)} of {bad.numel()} entries (shape {tuple(bad.shape)}), "
                             f"first at position {_first_position(bad)}")
    return valid


def sanitize(t: Optional[torch.Tensor], valid: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` cast to ``dtype`` with every position where ``valid`` is False replaced by 0.

    ``torch.where`` passes a zero gradient to the replaced entries, so garbage (even NaN) in padding
    changes neither the loss nor any gradient."""
    if t is None:
        return None
    t = t.to(dtype)
    return torch.where(valid, t, torch.zeros((), dtype=dtype, device=t.device))

"""Group ids and per-group sums for the outcome estimators. ``index`` is verl's: a numpy array (uids, ints), a
list, or an integer tensor, one entry per row; rows with equal entries form a group (a prompt's samples)."""
from __future__ import annotations

import numpy as np
import torch


def dense_group_ids(index, batch: int, device: torch.device) -> torch.Tensor:
    """``index`` (one group label per row) as dense int64 ids ``0..G-1`` on ``device``; a clear error for a
    wrong length."""
    if isinstance(index, torch.Tensor):
        flat = index.reshape(-1)
        if flat.dtype.is_floating_point:
            raise ValueError(f"index must hold group labels (ints / uids), got a {flat.dtype} tensor")
        ids = torch.unique(flat.to(device), return_inverse=True)[1]
    else:
        arr = np.asarray(index if not isinstance(index, (str, bytes)) else [index], dtype=object).reshape(-1)
        try:
            inv = np.unique(arr, return_inverse=True)[1]
        except TypeError:   # mixed label types: compare as strings
            inv = np.unique(np.array([str(x) for x in arr], dtype=object), return_inverse=True)[1]
        ids = torch.as_tensor(inv.astype(np.int64).reshape(-1), device=device)
    if ids.numel() != batch:
        raise ValueError(f"index has {ids.numel()} group labels for {batch} rows (one per response)")
    return ids


def group_sum(x: torch.Tensor, gid: torch.Tensor, G: int) -> torch.Tensor:
    """Per-group sums of ``x`` (``[B]``) -> ``[G]`` (float64)."""
    return torch.zeros(G, dtype=torch.float64, device=x.device).index_add_(0, gid, x.to(torch.float64))

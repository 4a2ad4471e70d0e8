"""Batch statistics an estimator takes over the WHOLE batch (verl computes them on the driver over every row), as
pure functions with an explicit process group: with ``group`` (the DP group) the sums are all-reduced, so every
DP rank gets the statistics of the global batch; ``group=None`` is the local batch. Every rank must call them
(collective), also with zero local rows. ``all_reduce(t, group=...)``: an in-place SUM all-reduce that stages ``t``
on the device the group's backend takes (the trainer passes ``parallel.devices.all_reduce_``; default
``dist.all_reduce``, for tensors already there)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_sum(t: torch.Tensor, group, all_reduce=None) -> torch.Tensor:
    """Sum ``t`` over ``group`` (in place on a copy); the identity without a group."""
    if group is not None:
        t = t.clone()
        (all_reduce or (lambda x, group=None: dist.all_reduce(x, group=group)))(t, group=group)
    return t


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, group=None, all_reduce=None) -> torch.Tensor:
    """verl's ``torch_functional.masked_whiten`` (shift_mean=True) over the global batch: mean over the masked
    entries (``/ (n + 1e-8)``), unbiased variance (``n / (n - 1)``), ``(v - mean) * rsqrt(var + 1e-8)``. Two
    all-reduces with ``group``: [n, sum] then the centred square sum (float64). Raises, like verl, when the
    global mask holds fewer than 2 entries (naming the count)."""
    m = mask.to(torch.float64)
    v = torch.where(mask.bool(), values.to(torch.float64), torch.zeros((), dtype=torch.float64, device=values.device))
    s = _all_sum(torch.stack([m.sum(), (v * m).sum()]), group, all_reduce)
    n = s[0]
    mean = s[1] / (n + 1e-8)
    sq = _all_sum(((v - mean) ** 2 * m).sum().reshape(1), group, all_reduce)[0]
    if float(n) < 2:
        raise ValueError(f"whitening the advantages needs >= 2 response tokens in the batch (response_mask sums to "
                         f"{float(n):g}{' over the DP group' if group is not None else ''}; in the trainer: the "
                         f"tokens left after algorithm.rollout_correction's rejection)")
    var = sq / (n + 1e-8) * (n / (n - 1))
    return ((values.to(torch.float64) - mean) * torch.rsqrt(var + 1e-8)).to(values.dtype)


def global_sum(t: torch.Tensor, group=None, all_reduce=None) -> torch.Tensor:
    """``t`` summed over ``group`` (a copy), the identity without one."""
    return _all_sum(t, group, all_reduce)

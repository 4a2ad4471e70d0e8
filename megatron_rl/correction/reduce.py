"""Packed reductions: every statistic of a correction call travels in at most three collectives.

* ``cp_reduce_rows``: per-sequence partial sums / maxima of a sequence split along time over the
  context-parallel group -> one ``all_gather`` of a [B, K] float64 pack, then sum / max locally in
  rank order (bitwise identical on every CP rank, so every CP rank takes the same decisions).
* ``Reducer``: named scalar / vector sums and maxima (minima are maxima of the negation) over the
  data-parallel group -> one SUM ``all_reduce`` and one MAX ``all_reduce`` for all metrics.

Empty maxima are ``-inf`` and survive the reduction; finalisers map them to 0.0 (documented per
metric). Collectives run only on the groups passed in, never on WORLD implicitly.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Size of ``group`` (1 for None)."""
    if group is None:
        return 1
    if not dist.is_initialized():
        raise RuntimeError("a process group was passed but torch.distributed is not initialized")
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank in ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


class CollectiveCounter:
    """Counts the collectives one correction call issues (reported in the result)."""

    def __init__(self) -> None:
        self.count = 0


def cp_reduce_rows(sum_cols: torch.Tensor, max_cols: torch.Tensor, cp_group,
                   counter: CollectiveCounter) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum ``sum_cols`` [B, Ks] and max ``max_cols`` [B, Km] over ``cp_group`` with one all_gather."""
    if group_size(cp_group) == 1:
        return sum_cols, max_cols
    ks = sum_cols.shape[1]
    pack = torch.cat([sum_cols, max_cols], dim=1).contiguous()
    parts = [torch.empty_like(pack) for _ in range(group_size(cp_group))]
    dist.all_gather(parts, pack, group=cp_group)
    counter.count += 1
    stacked = torch.stack(parts)  # [cp, B, K], rank order: identical result on every CP rank
    return stacked[:, :, :ks].sum(0), stacked[:, :, ks:].amax(0)


class Reducer:
    """Collect named partial sums and maxima; reduce them all with one SUM and one MAX all_reduce."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sums: Dict[str, torch.Tensor] = {}
        self._maxes: Dict[str, torch.Tensor] = {}

    def add_sum(self, name: str, value) -> None:
        """Add a scalar or 1-D partial sum (float64)."""
        t = torch.as_tensor(value, dtype=torch.float64, device=self.device).reshape(-1)
        if name in self._sums:
            raise KeyError(f"Reducer: sum {name!r} added twice")
        self._sums[name] = t

    def add_max(self, name: str, values: torch.Tensor) -> None:
        """Maximum over ``values`` (any shape; -inf when empty)."""
        v = values.to(torch.float64).reshape(-1)
        m = v.max() if v.numel() else torch.tensor(float("-inf"), dtype=torch.float64, device=self.device)
        if name in self._maxes:
            raise KeyError(f"Reducer: max {name!r} added twice")
        self._maxes[name] = m.reshape(1)

    def add_min(self, name: str, values: torch.Tensor) -> None:
        """Minimum over ``values`` (stored as the max of the negation; +inf when empty)."""
        self.add_max("-" + name, -values.to(torch.float64))

    def reduce(self, group, counter: CollectiveCounter) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
        """Return (sums by name as float64 tensors, maxima/minima by name as floats)."""
        sum_names: List[str] = list(self._sums)
        max_names: List[str] = list(self._maxes)
        sums = torch.cat([self._sums[n] for n in sum_names]) if sum_names else torch.zeros(0, dtype=torch.float64)
        maxes = torch.cat([self._maxes[n] for n in max_names]) if max_names else torch.zeros(0, dtype=torch.float64)
        if group_size(group) > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
            counter.count += 2
        out_sums: Dict[str, torch.Tensor] = {}
        off = 0
        for n in sum_names:
            k = self._sums[n].numel()
            out_sums[n] = sums[off:off + k] if k > 1 else sums[off]
            off += k
        out_ext: Dict[str, float] = {}
        for i, n in enumerate(max_names):
            v = float(maxes[i])
            if n.startswith("-"):
                out_ext[n[1:]] = -v
            else:
                out_ext[n] = v
        return out_sums, out_ext


def div(num, den) -> float:
    """``num / den`` as a float, 0.0 when the denominator is 0 (empty set)."""
    den = float(den)
    return float(num) / den if den > 0 else 0.0


def finite_or_zero(x: float) -> float:
    """An extremum of an empty set (+-inf after reduction) is reported as 0.0."""
    return x if x not in (float("inf"), float("-inf")) else 0.0


def seq_std(total: float, total_sq: float, n: float) -> float:
    """Unbiased standard deviation from sums (0.0 for fewer than two values)."""
    if n < 2:
        return 0.0
    mean = total / n
    return max(0.0, (total_sq - n * mean * mean) / (n - 1.0)) ** 0.5


def optional_group_ranks(group) -> Optional[List[int]]:
    """Global ranks of ``group`` (None for no group)."""
    return None if group is None else dist.get_process_group_ranks(group)

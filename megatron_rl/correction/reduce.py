"""Packed reductions: every statistic of a correction call travels in at most three collectives.

* ``complete_over_cp``: per-sequence partial sums / maxima of sequences split along time over the
  context-parallel group -> one ``all_gather`` of a [B, K] float64 pack, then sum / max locally in
  rank order (bitwise identical on every CP rank, so every CP rank takes the same decisions).
* ``Reducer``: named partial sums and maxima over the data-parallel group -> one SUM ``all_reduce``
  and one MAX ``all_reduce`` for all metrics. Most metrics are sums or extrema over the valid
  sequences of a per-sequence value: those are stacked and weighted / masked in one operation.

Empty maxima are ``-inf`` and survive the reduction; finalisers map them to 0.0 (documented per
metric). Collectives run only on the groups passed in, never on WORLD implicitly, and
``check_groups`` refuses a CP group that is not part of the reduction group before any of them.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron_rl.parallel.devices import all_reduce_

F64 = torch.float64


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


def check_groups(group, cp_group) -> None:
    """Raise ValueError (no collective issued) unless every rank of ``cp_group`` is in ``group``.

    The metrics are reduced over ``group`` only: with a CP group outside it, each CP rank's tokens would
    be counted on their own and the call would return plausible, wrong (rank-local) metrics."""
    if group_size(cp_group) == 1:
        return
    cp_ranks = dist.get_process_group_ranks(cp_group)
    if group is None:
        raise ValueError(f"compute_rollout_correction: cp_group has ranks {cp_ranks} but group is None, so the "
                         f"metrics would be this rank's only; pass group= the data-parallel group with context "
                         f"parallel (it must contain the cp_group's ranks)")
    ranks = dist.get_process_group_ranks(group)
    missing = [r for r in cp_ranks if r not in ranks]
    if missing:
        raise ValueError(f"compute_rollout_correction: cp_group ranks {cp_ranks} are not all in group "
                         f"(ranks {ranks}; missing {missing}); group must be the data-parallel group with "
                         f"context parallel, which contains every CP rank")


class CollectiveCounter:
    """Counts the collectives one correction call issues (reported in the result)."""

    def __init__(self) -> None:
        self.count = 0


def complete_over_cp(sums: Dict[str, torch.Tensor], maxes: Dict[str, torch.Tensor], cp_group,
                     counter: CollectiveCounter) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Sum ``sums`` and max ``maxes`` (each ``[B]`` float64) over ``cp_group`` with one all_gather."""
    cp = group_size(cp_group)
    if cp == 1:
        return sums, maxes
    pack = torch.stack(list(sums.values()) + list(maxes.values()), 1).contiguous()
    parts = [torch.empty_like(pack) for _ in range(cp)]
    dist.all_gather(parts, pack, group=cp_group)
    counter.count += 1
    stacked = torch.stack(parts)  # [cp, B, K], rank order: identical result on every CP rank
    n = len(sums)
    total, top = stacked[:, :, :n].sum(0), stacked[:, :, n:].amax(0)
    return ({k: total[:, i] for i, k in enumerate(sums)}, {k: top[:, i] for i, k in enumerate(maxes)})


class Reducer:
    """Named partial sums and maxima of one rank; :meth:`reduce` adds them up over the group.

    ``seq_valid`` [B] marks the valid sequences of this rank's rows. ``owner`` is True on the rank that
    contributes per-sequence sums (CP rank 0: after ``complete_over_cp`` every CP rank holds
    whole-sequence values, which must be counted once); extrema count on every rank (max is
    idempotent)."""

    def __init__(self, device: torch.device, seq_valid: torch.Tensor, owner: bool) -> None:
        self.device = device
        self.owner = 1.0 if owner else 0.0
        """1.0 on the rank that adds per-sequence values, else 0.0."""
        self.seq_valid = seq_valid
        self.seq_weight = seq_valid.to(F64) * self.owner
        self._sums: Dict[str, torch.Tensor] = {}
        self._seq_sums: Dict[str, torch.Tensor] = {}
        self._seq_maxes: Dict[str, torch.Tensor] = {}

    def _new(self, name: str) -> None:
        if name in self._sums or name in self._seq_sums or name in self._seq_maxes:
            raise KeyError(f"Reducer: {name!r} added twice")

    def add_sum(self, name: str, value) -> None:
        """A scalar or 1-D partial sum (float64), added as is."""
        self._new(name)
        self._sums[name] = torch.as_tensor(value, dtype=F64, device=self.device).reshape(-1)

    def add_seq_sum(self, name: str, per_seq: torch.Tensor) -> None:
        """Sum over the valid sequences this rank owns of ``per_seq`` [B]."""
        self._new(name)
        self._seq_sums[name] = per_seq.to(F64)

    def add_seq_count(self, name: str, per_seq: torch.Tensor) -> None:
        """Number of valid sequences this rank owns where ``per_seq`` [B] (bool) is set."""
        self.add_seq_sum(name, per_seq.to(F64))

    def add_seq_max(self, name: str, per_seq: torch.Tensor) -> None:
        """Maximum over the valid sequences of ``per_seq`` [B] (-inf when there are none)."""
        self._new(name)
        self._seq_maxes[name] = per_seq.to(F64)

    def add_seq_min(self, name: str, per_seq: torch.Tensor) -> None:
        """Minimum over the valid sequences of ``per_seq`` [B] (+inf when there are none)."""
        self.add_seq_max("-" + name, -per_seq.to(F64))

    def _packed(self) -> Tuple[List[str], torch.Tensor, List[str], torch.Tensor]:
        empty = torch.zeros(0, dtype=F64, device=self.device)
        sums = [torch.stack(list(self._seq_sums.values())) @ self.seq_weight] if self._seq_sums else []
        sums += list(self._sums.values())
        maxes = empty
        if self._seq_maxes:
            rows = torch.stack(list(self._seq_maxes.values()))
            ninf = torch.tensor(float("-inf"), dtype=F64, device=self.device)
            maxes = (torch.where(self.seq_valid[None, :], rows, ninf).amax(1) if rows.shape[1]
                     else ninf.expand(rows.shape[0]).contiguous())
        return (list(self._seq_sums) + list(self._sums), torch.cat(sums) if sums else empty,
                list(self._seq_maxes), maxes)

    def reduce(self, group, counter: CollectiveCounter) -> Tuple[Dict[str, object], Dict[str, float]]:
        """Return (sums by name: floats, or float64 tensors for vectors; maxima/minima by name: floats)
        over ``group``."""
        sum_names, sums, max_names, maxes = self._packed()
        if group_size(group) > 1:
            all_reduce_(sums, op=dist.ReduceOp.SUM, group=group)  # staged for the group's backend
            all_reduce_(maxes, op=dist.ReduceOp.MAX, group=group)
            counter.count += 2
        values = sums.tolist()  # one host transfer; vectors (histograms) stay tensors
        out_sums: Dict[str, object] = {}
        off = 0
        for n in sum_names:
            k = self._sums[n].numel() if n in self._sums else 1
            out_sums[n] = sums[off:off + k] if k > 1 else values[off]
            off += k
        out_ext: Dict[str, float] = {}
        for n, v in zip(max_names, maxes.tolist()):
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

"""Token-budget micro-batch planning and packed (THD) sequence layouts: pure functions, no model, no process group.

One job: decide which rows go into which micro-batch (``plan_micro_batches`` under a ``PaddedCost`` /
``PackedCost``: fixed rows, or first-fit-decreasing under ``actor.max_tokens_per_micro_batch``), how prompt groups
spread over DP ranks (``balance_groups``), and where every row's tokens sit in a packed sequence
(``pack_layout``; ``packed_cp_positions`` for each CP rank). The actor's ``MicroBatcher`` picks the cost and the
budget; ``schedule`` turns the plans into tensors. Each function, and a worked example: docs/actor.md.

    plan = plan_micro_batches(lengths, PackedCost(seq_multiple, row_multiple), micro_batch_size=4, max_tokens=8192)
    layout = pack_layout([lengths[r] for r in rows], row_multiple=row_multiple, total_multiple=seq_multiple)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["MicroBatchPlan", "PaddedCost", "PackedCost", "plan_micro_batches", "balance_groups", "PackedLayout",
           "pack_layout", "packed_cp_positions", "packed_cp_gather_index", "interleaved_group_size", "BUDGET_KEY"]

BUDGET_KEY = "actor.max_tokens_per_micro_batch"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _check_multiple(name: str, m: int) -> None:
    if int(m) != m or m < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {m!r}")


def _check_lengths(lengths: Sequence[int], what: str) -> List[int]:
    out = [int(x) for x in lengths]
    if not out:
        raise ValueError(f"{what}: no rows (empty lengths)")
    for i, (x, raw) in enumerate(zip(out, lengths)):
        if x != raw or x < 1:
            raise ValueError(f"{what}: row {i} has length {raw!r}; every row needs an integer length >= 1")
    return out


# ---------------------------------------------------------------------------------------------- micro-batches
@dataclass(frozen=True)
class MicroBatchPlan:
    """Which rows go into which micro-batch, in which order."""

    order: Tuple[int, ...]
    """A permutation of ``range(num_rows)``: micro-batch i holds rows ``order[s:e]`` for ``(s, e) = bounds[i]``
    (ascending row index inside a micro-batch)."""
    bounds: Tuple[Tuple[int, int], ...]
    """Contiguous, non-empty ``[start, end)`` blocks of ``order``, in order, covering it."""
    tokens: Tuple[int, ...]
    """Model tokens of each micro-batch before the CP split (the plan's cost of its rows)."""

    @property
    def num_micro_batches(self) -> int:
        """``len(bounds)``."""
        return len(self.bounds)

    def rows(self, i: int) -> Tuple[int, ...]:
        """Row indices of micro-batch ``i`` (ascending)."""
        s, e = self.bounds[i]
        return self.order[s:e]


@dataclass(frozen=True)
class PaddedCost:
    """Model tokens of a padded micro-batch (before the CP split): ``len(lengths) * round_up(max(max(lengths), 2),
    seq_multiple)`` — every row padded to the longest, at least 2 columns as ``RolloutBatch.select(trim=True)``
    makes them."""

    seq_multiple: int = 1
    """Micro-batch lengths are rounded up to this (``ParallelDims.seq_multiple``)."""

    def __post_init__(self):
        _check_multiple("seq_multiple", self.seq_multiple)

    def __call__(self, lengths: Sequence[int]) -> int:
        ls = _rows(lengths)
        return len(ls) * _round_up(max(max(ls), 2), self.seq_multiple)   # a padded micro-batch is >= 2 wide

    def describe(self) -> str:
        """How a row's cost is rounded, for messages."""
        return f"padded, rounded up to the sequence multiple {self.seq_multiple}"


@dataclass(frozen=True)
class PackedCost:
    """Model tokens of a packed micro-batch (before the CP split): ``round_up(sum(round_up(l, row_multiple)),
    seq_multiple)`` — each row's segment padded to ``row_multiple``, the packed sequence to ``seq_multiple``."""

    seq_multiple: int = 1
    """The packed length is rounded up to this (``ParallelDims.seq_multiple``)."""
    row_multiple: int = 1
    """Each row's segment is rounded up to this (``ParallelDims.cp_row_multiple``: 2 x CP with context parallel)."""

    def __post_init__(self):
        _check_multiple("seq_multiple", self.seq_multiple)
        _check_multiple("row_multiple", self.row_multiple)

    def __call__(self, lengths: Sequence[int]) -> int:
        return _round_up(sum(_round_up(x, self.row_multiple) for x in _rows(lengths)), self.seq_multiple)

    def describe(self) -> str:
        """How a row's cost is rounded, for messages."""
        return (f"packed, rounded up to the sequence multiple {self.seq_multiple} and row multiple "
                f"{self.row_multiple}")


def _rows(lengths: Sequence[int]) -> List[int]:
    ls = [int(x) for x in lengths]
    if not ls:
        raise ValueError("micro-batch cost: no rows (empty lengths)")
    return ls


def plan_micro_batches(lengths: Sequence[int], cost: "PaddedCost | PackedCost", *, micro_batch_size: int,
                       max_tokens: Optional[int], min_micro_batches: int = 1) -> MicroBatchPlan:
    """Group the rows (token ``lengths``, prompt + response) into micro-batches; ``cost``: model tokens of a
    micro-batch of rows (``PaddedCost`` or ``PackedCost``).

    ``max_tokens is None``: identity order, consecutive blocks of ``micro_batch_size`` rows (the last may be
    smaller), packed or not — today's behaviour (``RolloutBatch.micro_batches``).

    ``max_tokens`` set (``micro_batch_size`` ignored): every micro-batch's ``cost`` is at most ``max_tokens``, with
    few micro-batches: first-fit-decreasing over the rows sorted by length (descending, ties by row index), a
    bin's cost recomputed with ``cost`` (padded: adding a shorter row costs its padded length, the bin's longest
    row). For packed rows this is classical bin packing (at most 11/9 OPT + 6/9 micro-batches); for padded rows
    it is optimal. Rows inside a micro-batch ascend by index and micro-batches are ordered by their smallest row
    index, so the plan depends on ``lengths`` only.

    ``min_micro_batches`` (the interleaved pipeline schedule needs >= PP micro-batches): a token-budget plan
    with fewer is split further — the micro-batch with the most tokens (then the most rows) cut in two halves
    of its rows — while it has a micro-batch of more than one row.

    Raises ValueError on empty ``lengths``, a length < 1, ``micro_batch_size`` / ``max_tokens`` < 1, and when a
    single row's own cost exceeds ``max_tokens`` (naming the row, its length, its cost and
    ``actor.max_tokens_per_micro_batch``)."""
    ls = _check_lengths(lengths, "plan_micro_batches")
    n = len(ls)

    def bin_cost(rows: Sequence[int]) -> int:
        return cost([ls[r] for r in rows])

    if max_tokens is None:
        if int(micro_batch_size) != micro_batch_size or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be an integer >= 1, got {micro_batch_size!r}")
        bounds = tuple((s, min(s + micro_batch_size, n)) for s in range(0, n, micro_batch_size))
        return MicroBatchPlan(order=tuple(range(n)), bounds=bounds,
                              tokens=tuple(bin_cost(range(s, e)) for s, e in bounds))

    if int(max_tokens) != max_tokens or max_tokens < 1:
        raise ValueError(f"{BUDGET_KEY} must be an integer >= 1 (or null), got {max_tokens!r}")
    for r in range(n):
        c = bin_cost([r])
        if c > max_tokens:
            raise ValueError(f"row {r} of length {ls[r]} costs {c} tokens ({cost.describe()}), more than "
                             f"{BUDGET_KEY} = {max_tokens}: raise {BUDGET_KEY} to at least {c}")
    bins: List[List[int]] = []
    for r in sorted(range(n), key=lambda i: (-ls[i], i)):
        for b in bins:
            if bin_cost(b + [r]) <= max_tokens:
                b.append(r)
                break
        else:
            bins.append([r])
    while len(bins) < min_micro_batches and any(len(b) > 1 for b in bins):
        big = max((b for b in bins if len(b) > 1), key=lambda b: (bin_cost(b), len(b), -min(b)))
        bins.remove(big)
        big = sorted(big)
        bins += [big[: len(big) // 2], big[len(big) // 2:]]
    groups = sorted((sorted(b) for b in bins), key=lambda b: b[0])
    order, bounds, start = [], [], 0
    for g in groups:
        order.extend(g)
        bounds.append((start, start + len(g)))
        start += len(g)
    return MicroBatchPlan(order=tuple(order), bounds=tuple(bounds), tokens=tuple(bin_cost(g) for g in groups))


# ---------------------------------------------------------------------------------------------- DP balancing
def balance_groups(group_tokens: Sequence[int], num_ranks: int) -> List[List[int]]:
    """Spread prompt groups (their token counts) over ``num_ranks`` data-parallel ranks: every rank the same
    number of groups, the largest per-rank token sum kept small. Greedy: groups by tokens descending (ties by
    group index), each to the rank with the smallest sum that still has room (ties by rank index).
    Returns, per rank, its group indices ascending. Raises ValueError when ``len(group_tokens)`` is not a
    multiple of ``num_ranks`` (naming both) or ``num_ranks < 1``."""
    if int(num_ranks) != num_ranks or num_ranks < 1:
        raise ValueError(f"balance_groups: num_ranks must be an integer >= 1, got {num_ranks!r}")
    toks = [int(t) for t in group_tokens]
    if len(toks) % num_ranks:
        raise ValueError(f"balance_groups: {len(toks)} prompt groups cannot be split evenly over {num_ranks} "
                         f"data-parallel ranks (need a multiple of {num_ranks})")
    cap = len(toks) // num_ranks
    sums = [0] * num_ranks
    out: List[List[int]] = [[] for _ in range(num_ranks)]
    for g in sorted(range(len(toks)), key=lambda i: (-toks[i], i)):
        r = min((r for r in range(num_ranks) if len(out[r]) < cap), key=lambda r: (sums[r], r))
        out[r].append(g)
        sums[r] += toks[g]
    return [sorted(x) for x in out]


# ---------------------------------------------------------------------------------------------- packed layout
@dataclass(frozen=True)
class PackedLayout:
    """Where each row of one micro-batch sits in its packed (THD) sequence.

    Row i occupies ``[offsets[i], offsets[i] + lengths[i])``; the rest of its segment (up to ``padded[i]``) and
    the trailing pad segment (``total - sum(padded)`` positions, present only when non-zero) are padding.
    The tail is its own attention segment: Transformer Engine rejects empty segments and needs every packed
    position inside some ``cu_seqlens_padded`` segment. ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded``
    differ when ``row_multiple > 1``: TE takes both (``PackedSeqParams.cu_seqlens_q`` / ``cu_seqlens_q_padded``),
    megatron's RoPE and the THD CP split use the padded one."""

    lengths: Tuple[int, ...]
    """Real tokens of each row, in packing order."""
    padded: Tuple[int, ...]
    """Each row's segment length (its length rounded up to ``row_multiple``)."""
    offsets: Tuple[int, ...]
    """Start of each row's segment in the packed sequence."""
    total: int
    """Packed length: ``sum(padded)`` plus a trailing pad segment up to a multiple of ``total_multiple``."""

    @property
    def tail(self) -> int:
        """Length of the trailing pad segment (0: none)."""
        return self.total - sum(self.padded)

    @property
    def segments(self) -> Tuple[int, ...]:
        """Padded segment lengths including the tail when non-zero (what ``cu_seqlens_padded`` accumulates;
        the argument of ``packed_cp_positions``)."""
        return self.padded + ((self.tail,) if self.tail else ())

    def _cu(self, seg: Sequence[int], device) -> torch.Tensor:
        cu = [0]
        for x in seg:
            cu.append(cu[-1] + x)
        return torch.tensor(cu, dtype=torch.int32, device=device)

    def cu_seqlens(self, device=None) -> torch.Tensor:
        """int32 ``[segments + 1]``: cumulative real lengths; the tail pad segment counts as a segment of its
        full length."""
        return self._cu(self.lengths + ((self.tail,) if self.tail else ()), device)

    def cu_seqlens_padded(self, device=None) -> torch.Tensor:
        """int32 ``[segments + 1]``: cumulative padded segment lengths (tail included); last entry == total."""
        return self._cu(self.segments, device)

    def max_seqlen(self) -> int:
        """Longest padded segment (tail included)."""
        return max(self.segments)

    def position_ids(self, device=None) -> torch.Tensor:
        """int64 ``[total]``: each packed position's index within its own padded segment (0, 1, ... per
        segment, the tail too)."""
        seg = torch.tensor(self.segments, dtype=torch.int64, device=device)
        starts = torch.cumsum(seg, 0) - seg
        return torch.arange(self.total, dtype=torch.int64, device=device) - torch.repeat_interleave(starts, seg)

    def row_col(self, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[total]`` each: the row (0..n-1, packing order) and the column within that row of every packed
        position; -1 for both at padding (segment padding and tail)."""
        n = len(self.padded)
        seg = torch.tensor(self.segments, dtype=torch.int64, device=device)
        seg_id = torch.repeat_interleave(torch.arange(len(self.segments), dtype=torch.int64, device=device), seg)
        pos = self.position_ids(device)
        lens = torch.tensor(self.lengths + ((0,) if self.tail else ()), dtype=torch.int64, device=device)
        real = (seg_id < n) & (pos < lens[seg_id])
        minus = torch.full_like(pos, -1)
        return torch.where(real, seg_id, minus), torch.where(real, pos, minus)


def pack_layout(lengths: Sequence[int], row_multiple: int = 1, total_multiple: int = 1) -> PackedLayout:
    """The packed layout of rows of these ``lengths`` (>= 1 each), in the given order: each row's segment
    rounded up to ``row_multiple`` (2 x CP with context parallelism), the whole to ``total_multiple`` (a
    trailing pad segment; with CP it must itself be a multiple of 2 x CP, so pick ``total_multiple`` a
    multiple of ``row_multiple``)."""
    ls = _check_lengths(lengths, "pack_layout")
    _check_multiple("row_multiple", row_multiple)
    _check_multiple("total_multiple", total_multiple)
    padded = tuple(_round_up(x, row_multiple) for x in ls)
    offsets, o = [], 0
    for p in padded:
        offsets.append(o)
        o += p
    return PackedLayout(lengths=tuple(ls), padded=padded, offsets=tuple(offsets), total=_round_up(o, total_multiple))


# ---------------------------------------------------------------------------------------------- THD CP split
def packed_cp_positions(padded: Sequence[int], cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """int64 packed positions that CP rank ``cp_rank`` of ``cp_size`` holds, in megatron/TE's THD order.

    Convention (``transformer_engine.pytorch.cpp_extensions.thd_get_partitioned_indices(cu_seqlens_padded,
    total, cp_size, cp_rank)``, used by megatron-core's ``get_thd_batch_on_this_cp_rank`` and the THD branch of
    its models): the zigzag split of ``get_batch_on_this_cp_rank`` applied to every segment on its own. Each
    segment (``padded``: the padded segment lengths, tail included — ``PackedLayout.segments``; each divisible
    by 2 x cp_size, else ValueError) is cut into 2 x cp_size equal chunks; the rank holds chunk ``cp_rank``
    then chunk ``2*cp_size-1-cp_rank`` of every segment, segments in order. Every rank holds
    ``sum(padded) / cp_size`` positions. ``cp_size == 1``: every position in order (any segment lengths >= 1)."""
    _check_multiple("cp_size", cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"packed_cp_positions: cp_rank {cp_rank} outside context_parallel_size {cp_size}")
    parts, off = [], 0
    for i, p in enumerate(int(x) for x in padded):
        if p < 1 or (cp_size > 1 and p % (2 * cp_size)):
            raise ValueError(f"packed_cp_positions: segment {i} has padded length {p}, not a positive multiple "
                             f"of 2 x context_parallel_size = {2 * cp_size}")
        if cp_size == 1:
            parts.append(torch.arange(off, off + p, dtype=torch.int64, device=device))
            off += p
            continue
        c = p // (2 * cp_size)
        for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(off + k * c, off + (k + 1) * c, dtype=torch.int64, device=device))
        off += p
    if not parts:
        raise ValueError("packed_cp_positions: no segments")
    return torch.cat(parts)


def packed_cp_gather_index(padded: Sequence[int], cp_size: int, device=None) -> torch.Tensor:
    """int64 ``[sum(padded)]``: the concatenation over CP ranks 0..cp_size-1 of ``packed_cp_positions`` — so
    ``full[index] = torch.cat(parts_of_ranks)`` (e.g. after an all-gather) restores the packed order."""
    return torch.cat([packed_cp_positions(padded, r, cp_size, device) for r in range(cp_size)])


def interleaved_group_size(num_micro_batches: int, pp: int) -> int:
    """megatron-core's ``microbatch_group_size_per_vp_stage`` for a pass of ``num_micro_batches`` under an
    interleaved pipeline of ``pp`` stages: its schedule needs the count to be a multiple of the group size (PP by
    default); a token-budget plan has any count >= PP, so a count that is not a multiple runs as one group."""
    return pp if num_micro_batches % pp == 0 else num_micro_batches

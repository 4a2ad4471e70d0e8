"""How a sender gathers the TP / ETP pieces of a split parameter (``WeightSyncSettings.tp_gather``): a
``convert.live.PieceGather`` that leaves the full tensor on the group's rank 0 (the sender) alone.

* ``shm`` (CPU, gloo groups whose sender maps every other rank's shared memory, ``shm_reach``; else ``gloo``):
  each other rank writes its piece, cast to the engine's dtype, into its own shared-memory segment
  (``shm.Segment``, two slots, kept for the process's life); one barrier of the group; the sender writes every
  piece straight into its place in the full tensor (``partition.piece_views``).
* ``flat`` (NCCL): one ``all_gather_into_tensor`` into one flat buffer per parameter, then ``merge_tensors``.
* ``gloo``: ``convert.live``'s own per-rank ``all_gather`` (no gatherer).

The one rule (``shm``): a rank writes slot ``i % 2`` for the ``i``-th piece, and the sender reads it between the
``i``-th barrier and its entering the next one -- so a slot is never rewritten while it is read.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rl.convert.partition import merge_tensors, piece_views
from megatron_rl.weight_sync import shm
from megatron_rl.weight_sync.shm_reach import unreachable

__all__ = ["TP_GATHERS", "piece_gather"]

#: ``WeightSyncSettings.tp_gather`` values (see the module doc).
TP_GATHERS = ("shm", "flat", "gloo")


def _want(t: torch.Tensor, dtype) -> torch.dtype:
    return dtype if (dtype is not None and t.is_floating_point()) else t.dtype


def _flat_gather(t, kind, group, size, name, dtype):
    piece = t.to(_want(t, dtype)).contiguous().view(-1)
    out = torch.empty(size * piece.numel(), dtype=piece.dtype, device=piece.device)
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 renamed it
    gather_into(out, piece, group=group)
    if dist.get_rank(group) != 0:
        return None
    return merge_tensors(list(out.view(size, *t.shape).unbind(0)), kind, name)


class _Slots:
    """One group's segments: this rank's (a non-sender) or every other rank's mapping (the sender)."""

    def __init__(self, group, size: int, nbytes: int):
        self.slot = max(int(nbytes), 1 << 20)
        self.count = 0
        me = dist.get_rank(group)
        mine = shm.Segment.create(f"tp{dist.get_rank()}", 2 * self.slot) if me != 0 else None
        specs = [None] * size
        dist.all_gather_object(specs, (mine.path, mine.key) if mine else None, group=group)
        self.mine = mine
        self.peers = {r: shm.Segment.attach(*spec, 2 * self.slot) for r, spec in enumerate(specs)
                      if me == 0 and r != 0}


def _gloo_gather(t, kind, group, size, name, dtype):
    """The per-rank ``all_gather`` (a group whose sender cannot map its other ranks' shared memory)."""
    piece = t.to(_want(t, dtype)).contiguous()
    parts = [torch.empty_like(piece) for _ in range(size)]
    dist.all_gather(parts, piece, group=group)
    return merge_tensors(parts, kind, name) if dist.get_rank(group) == 0 else None


class _ShmGather:
    """The ``shm`` gatherer of one process (its slots per group, grown together when a piece does not fit). A group
    whose sender cannot map every other rank's shared memory (``shm_reach``: another host, a refused ``/proc``)
    gathers over gloo, said once on the sender."""

    def __init__(self):
        self.groups: Dict[int, Tuple[object, Optional[_Slots]]] = {}  # id -> (the group, held: ids are reused)

    def __call__(self, t, kind, group, size, name, dtype) -> Optional[torch.Tensor]:
        entry = self.groups.get(id(group))
        if entry is None or entry[0] is not group:
            why = unreachable(0, group)
            if why and dist.get_rank(group) == 0:
                ranks = dist.get_process_group_ranks(group)
                print(f"[megatron-rl] WARNING: weight sync: the TP / ETP pieces of ranks {ranks} reach their sender "
                      f"over gloo, not shared memory: "
                      + "; ".join(f"group rank {r}: {w}" for r, w in sorted(why.items())), flush=True)
            entry = self.groups[id(group)] = (group, None if not why else False)
        if entry[1] is False:
            return _gloo_gather(t, kind, group, size, name, dtype)
        want = _want(t, dtype)
        nbytes = t.numel() * torch.empty((), dtype=want).element_size()
        slots = entry[1]
        if slots is None or nbytes > slots.slot:  # every rank sees the same piece shapes: all grow together
            slots = _Slots(group, size, max(nbytes, 2 * slots.slot if slots else 0))
            self.groups[id(group)] = (group, slots)
        off = (slots.count % 2) * slots.slot
        slots.count += 1
        if slots.mine is not None:
            slots.mine.tensor[off:off + nbytes].view(want).view(t.shape).copy_(t)
            dist.barrier(group=group)
            return None
        full_shape = list(t.shape)
        full_shape[1 if kind in ("row", "expert_row") else 0] *= size
        full = torch.empty(full_shape, dtype=want, device=t.device)
        views = piece_views(full, kind, size)
        _put(views[0], t)
        dist.barrier(group=group)
        for r in range(1, size):
            _put(views[r], slots.peers[r].tensor[off:off + nbytes].view(want).view(t.shape))
        return full


def _put(views, piece: torch.Tensor) -> None:
    for dst, src in zip(views, piece.chunk(len(views), 0)):
        dst.copy_(src)


_SHM = _ShmGather()


def piece_gather(how: str):
    """The ``convert.live.PieceGather`` of ``how`` (one of ``TP_GATHERS``; ``gloo``: None, the default gather)."""
    if how == "shm":
        return _SHM
    if how == "flat":
        return _flat_gather
    if how == "gloo":
        return None
    raise ValueError(f"tp_gather {how!r} is not one of {TP_GATHERS}")

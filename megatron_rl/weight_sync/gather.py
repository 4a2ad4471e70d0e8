"""How a sender gathers the TP / ETP pieces of a split parameter (``WeightSyncSettings.tp_gather``): a
``convert.live.PieceGather`` that leaves the full tensor on the group's rank 0 (the sender) alone.

* ``shm`` (CPU, gloo groups whose sender maps every other rank's shared memory, ``shm_reach``; else ``gloo``):
  batched (``gather_many``): each other rank writes the pieces of a batch (about ``batch_bytes``), cast to the
  engine's dtype, back to back into its shared-memory segment (``shm.Segment``, two slots, kept for the process's
  life); one exchange of the group per batch (who failed, and why); the sender hands on ``pieces.Pieces`` over its
  own parameter and the slots -- the consumer (the engine, a bucket) copies each piece into place, nothing is
  assembled.
* ``flat`` (NCCL): one ``all_gather_into_tensor`` into one flat buffer per parameter, then ``merge_tensors``.
* ``gloo``: ``convert.live``'s own per-rank ``all_gather`` (no gatherer).

The one rule (``shm``): a rank writes slot ``i % 2`` for the ``i``-th batch; the sender's consumer copies the batch's
pieces out before its stream passes the ``FENCE`` after the batch, so before the sender enters batch ``i + 1``'s
exchange, after which alone slot ``i % 2`` is rewritten -- a slot is never rewritten while it is read.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rl.convert.partition import merge_tensors
from megatron_rl.convert.pieces import Pieces, from_parts, materialize
from megatron_rl.weight_sync import shm
from megatron_rl.weight_sync.endpoint import WeightSyncError
from megatron_rl.weight_sync.shm_reach import unreachable

__all__ = ["TP_GATHERS", "piece_gather"]

#: ``WeightSyncSettings.tp_gather`` values (see the module doc).
TP_GATHERS = ("shm", "flat", "gloo")

#: Most bytes of pieces per rank in one ``shm`` batch (``shm.BATCH_CAP``).
BATCH_CAP = shm.BATCH_CAP


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
        self.slot = max(int(nbytes), shm.MIN_SLOT)
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


def _nbytes(t, dtype) -> int:
    return t.numel() * torch.empty((), dtype=_want(t, dtype)).element_size()


class _ShmGather:
    """The ``shm`` gatherer of one process (its slots per group, grown together when a batch does not fit): a
    batching ``convert.live.PieceGather`` (``gather_many``) whose full tensors are ``pieces.Pieces`` over the
    parameter (this rank's piece) and the other ranks' slots. A group whose sender cannot map every other rank's
    shared memory (``shm_reach``: another host, a refused ``/proc``) gathers over gloo, said once on the sender."""

    def __init__(self, batch_bytes: int = BATCH_CAP, timeout_s: float = 600.0):
        self.batch_bytes = int(batch_bytes)
        """Bytes of pieces per rank a batch may hold (one slot; a larger piece gets a slot of its own size)."""
        self.timeout_s = float(timeout_s)
        """Bound of each batch's wait for the group."""
        self.groups: Dict[int, Tuple[object, Optional[_Slots]]] = {}  # id -> (the group, held: ids are reused)

    def _slots(self, group, size: int, nbytes: int):
        entry = self.groups.get(id(group))
        if entry is None or entry[0] is not group:
            why = unreachable(0, group)
            if why and dist.get_rank(group) == 0:
                ranks = dist.get_process_group_ranks(group)
                print(f"[megatron-rl] WARNING: weight sync: the TP / ETP pieces of ranks {ranks} reach their sender "
                      f"over gloo, not shared memory: "
                      + "; ".join(f"group rank {r}: {w}" for r, w in sorted(why.items())), flush=True)
            entry = self.groups[id(group)] = (group, None if not why else False)
        slots = entry[1]
        if slots is not False and (slots is None or nbytes > slots.slot):  # every rank sees the same sizes
            # a piece beyond the current slot: max(piece, 2 batches), what ``shm.segment_bytes`` counts
            batch = max(self.batch_bytes, shm.MIN_SLOT)
            slots = _Slots(group, size, max(nbytes, 2 * batch if slots else batch))
            self.groups[id(group)] = (group, slots)
        return slots

    def __call__(self, t, kind, group, size, name, dtype) -> Optional[torch.Tensor]:
        """One parameter (the plain ``PieceGather``): its full tensor, assembled, on the sender."""
        full = self.gather_many([(t, kind, name)], group, size, dtype)[0]
        return None if full is None else materialize(full)

    def gather_many(self, items, group, size, dtype) -> List[Optional[Pieces]]:
        """Collective over ``group``: the full tensors of ``items`` (``(piece, kind, name)``) as ``Pieces`` on the
        group's rank 0, None elsewhere. Every other rank writes its pieces into its slot, then one exchange of the
        group (bounded by ``timeout_s``) says who failed; a failure on any rank raises on every rank, naming it."""
        sizes = [_nbytes(t, dtype) for t, _, _ in items]
        slots = self._slots(group, size, sum(sizes))
        if slots is False:
            return [_gloo_gather(t, kind, group, size, name, dtype) for t, kind, name in items]
        off = (slots.count % 2) * slots.slot
        slots.count += 1
        status = torch.zeros(1, dtype=torch.int64)
        if slots.mine is not None:
            try:
                at = off
                for (t, _, _), n in zip(items, sizes):
                    slots.mine.tensor[at:at + n].view(_want(t, dtype)).view(t.shape).copy_(t)
                    at += n
            except Exception as exc:  # noqa: BLE001 - told to the group: the cause, in this rank's slot if it can be
                room = slots.mine.tensor[off:off + min(slots.slot, 4096)]
                why = f"{type(exc).__name__}: {exc}".encode()[: room.numel()]
                if why:
                    room[:len(why)].copy_(torch.frombuffer(bytearray(why), dtype=torch.uint8))
                status[0] = len(why) + 1
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        try:
            work = dist.all_gather(every, status, group=group, async_op=True)
            done = work.wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - gloo raises on its timeout
            done, cause = False, f" ({type(exc).__name__}: {exc})"
        else:
            cause = ""
        if done is False:
            self.groups.pop(id(group), None)  # its segments unmapped (the group is in an unknown state)
            raise WeightSyncError(f"weight sync: the TP / ETP group {dist.get_process_group_ranks(group)} did not "
                                  f"exchange its pieces' status within {self.timeout_s:g} s{cause}")
        failed = {r: int(s[0]) for r, s in enumerate(every) if int(s[0])}
        if failed:
            ranks = dist.get_process_group_ranks(group)
            why = {r: (bytes(slots.peers[r].tensor[off:off + n - 1].tolist()).decode(errors="replace")
                       if r in slots.peers else "") for r, n in failed.items()}
            self.groups.pop(id(group), None)  # on every rank: the next sync maps fresh segments
            raise WeightSyncError("weight sync: writing the TP / ETP pieces failed on "
                                  + "; ".join(f"rank {ranks[r]}" + (f" ({w})" if w else "") for r, w in why.items()))
        if slots.mine is not None:
            return [None] * len(items)
        out, at = [], off
        for (t, kind, name), n in zip(items, sizes):
            want = _want(t, dtype)
            parts = [t] + [slots.peers[r].tensor[at:at + n].view(want).view(t.shape) for r in range(1, size)]
            full_shape = list(t.shape)
            full_shape[1 if kind in ("row", "expert_row") else 0] *= size
            out.append(from_parts(parts, kind, full_shape, want))
            at += n
        return out


_SHM = _ShmGather()


def piece_gather(how: str, batch_bytes: int = BATCH_CAP, timeout_s: float = 600.0):
    """The ``convert.live.PieceGather`` of ``how`` (one of ``TP_GATHERS``; ``gloo``: None, the default gather);
    ``shm``: batches of ``batch_bytes`` (at most ``BATCH_CAP``) of pieces, each wait bounded by ``timeout_s`` (the
    process's one gatherer: its segments are kept across syncs)."""
    if how == "shm":
        _SHM.batch_bytes, _SHM.timeout_s = min(int(batch_bytes), BATCH_CAP), float(timeout_s)
        return _SHM
    if how == "flat":
        return _flat_gather
    if how == "gloo":
        return None
    raise ValueError(f"tp_gather {how!r} is not one of {TP_GATHERS}")

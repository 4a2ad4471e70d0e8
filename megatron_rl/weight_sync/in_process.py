"""The channel into an engine inside global rank 0's process (the embedded engine): ``InProcessSpec``.

Rank 0 loads its own buckets directly; every other sender's are received in their own thread. A sender whose
shared memory rank 0 maps (``sender_transport: shm``; ``shm_reach``) packs each bucket straight into its segment
(``shm.Segment``, kept for the process's life, mapped once by rank 0) and sends only the bucket's meta over its gloo
pair group; rank 0 loads the bucket from its mapping of that segment and acknowledges, and only then may the sender
refill it. Elsewhere (or ``gloo``) the bytes travel over the pair group. The one rule: a segment's bytes belong to
rank 0 from the meta until the acknowledgement.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_rl.weight_sync import shm
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.delta import DeltaBucket
from megatron_rl.weight_sync.endpoint import WeightSyncError
from megatron_rl.weight_sync.shm_reach import unreachable
from megatron_rl.weight_sync.transport import ChannelSpec, SenderChannel, pair_groups, recv_bucket_bytes, send_bucket

__all__ = ["InProcessSpec", "SENDER_TRANSPORTS"]

#: ``WeightSyncSettings.sender_transport`` values: shared memory for the senders on rank 0's host, or gloo for all.
SENDER_TRANSPORTS = ("shm", "gloo")

_NEAR: Dict[int, bool] = {}  # per process: global rank -> rank 0 maps its shared memory (asked once, collectively)
_WRITER: List[Optional[shm.Segment]] = [None]  # this sender's segment (kept across syncs)
_READERS: Dict[int, shm.Segment] = {}  # rank 0: each sender's segment, mapped


def _near_rank0() -> Dict[int, bool]:
    """Collective over every trainer rank, once per process: which global ranks rank 0 can map the shared memory
    of (``shm_reach``); a rank on rank 0's host that it cannot is said, once, on that rank."""
    if not _NEAR:
        why = unreachable(0)
        _NEAR.update({r: r not in why for r in range(dist.get_world_size())})
        me = dist.get_rank()
        if me in why and why[me] != "on another host":
            print(f"[megatron-rl] WARNING: weight sync: rank {me}'s buckets reach rank 0 over gloo, not shared "
                  f"memory: {why[me]}", flush=True)
    return _NEAR


@dataclass(frozen=True)
class InProcessSpec(ChannelSpec):
    """An engine inside global rank 0's process: rank 0 loads its own buckets directly and receives every other
    sender's in parallel, one thread per sender, each over its own gloo pair group (``pair_groups``); bytes through
    shared memory from the senders whose segments rank 0 maps (``shm_reach``) when the transport is ``shm``."""

    timeout_s: float
    """Bound of each transfer."""

    def open(self, rank, senders, receiver=None, transport: str = "gloo"):
        if transport not in SENDER_TRANSPORTS:
            raise ValueError(f"sender transport {transport!r} is not one of {SENDER_TRANSPORTS}")
        groups = pair_groups(senders, self.timeout_s)
        near = _near_rank0() if transport == "shm" and len(senders) > 1 else {}
        if rank == 0:
            return _Rank0Channel(receiver, groups, self.timeout_s)
        if rank not in senders:
            return None
        return _ShmToRank0Channel(groups[rank], rank) if near.get(rank) else _ToRank0Channel(groups[rank])


class _ToRank0Channel(SenderChannel):
    def __init__(self, group):
        self.group = group

    def send(self, bucket):
        send_bucket(bucket, 0, self.group)

    def close(self):
        send_bucket(None, 0, self.group)


class _ShmToRank0Channel(SenderChannel):
    """A sender on rank 0's host: bytes in its segment, meta + acknowledgement over its pair group."""

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank
        self.ack = torch.zeros(1, dtype=torch.int64)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` to pack the next bucket into: this sender's segment (a larger one replaces
        it when it does not fit)."""
        seg = _WRITER[0]
        if seg is None or seg.nbytes < nbytes:
            if seg is not None:
                seg.close()
            seg = _WRITER[0] = shm.Segment.create(f"sender{self.rank}", nbytes)
        return seg.tensor[:int(nbytes)]

    def send(self, bucket):
        flat, seg = bucket.flat, _WRITER[0]
        base = seg.tensor.data_ptr() if seg is not None else 0
        if seg is not None and base <= flat.data_ptr() and flat.data_ptr() + flat.numel() <= base + seg.nbytes:
            offset = flat.data_ptr() - base  # packed in the segment (``alloc``)
        else:
            self.alloc(flat.numel()).copy_(flat)  # packed elsewhere (a delta bucket): one more copy
            seg, offset = _WRITER[0], 0
        meta = dict(bucket.meta(), shm=seg.path, shm_key=seg.key, shm_nbytes=seg.nbytes, shm_offset=int(offset))
        dist.send_object_list([meta], dst=0, group=self.group)
        dist.recv(self.ack, src=0, group=self.group)  # rank 0 loaded it (or failed): the segment is ours again

    def close(self):
        send_bucket(None, 0, self.group)


def _from_segment(meta: dict, src: int) -> object:
    """Rank 0: the bucket ``meta`` describes, over its sender's segment (mapped once, kept)."""
    seg = _READERS.get(src)
    if seg is None or seg.key != meta["shm_key"]:
        try:
            seg = _READERS[src] = shm.Segment.attach(meta["shm"], meta["shm_key"], int(meta["shm_nbytes"]))
        except OSError as exc:
            raise WeightSyncError(f"sender rank {src}: its shared-memory segment {meta['shm']} cannot be mapped on "
                                  f"rank 0's host ({exc})") from exc
    off, n = int(meta["shm_offset"]), int(meta["nbytes"])
    if off < 0 or n < 0 or off + n > seg.nbytes:
        raise WeightSyncError(f"sender rank {src}: bucket bytes [{off}, {off + n}) lie outside its shared-memory "
                              f"segment of {seg.nbytes} bytes")
    flat = seg.tensor[off:off + n]
    if meta.get("format") == "delta":
        return DeltaBucket.from_meta(meta, flat)
    return Bucket.empty(meta, buffer=flat)


class _Rank0Channel(SenderChannel):
    """Rank 0's own buckets and, in threads, every other sender's go into ``receiver`` (one at a time: a lock).
    ``local``: the receiver copies rank 0's buckets in as they are sent, so they may hold the tensors uncopied."""

    local = True

    def __init__(self, receiver, groups: Dict[int, Any], timeout_s: float):
        self.receiver, self.timeout_s = receiver, timeout_s
        self.lock = threading.Lock()
        self.errors: List[str] = []
        self.threads = [threading.Thread(target=self._drain, args=(src, g), daemon=True) for src, g in groups.items()]
        for th in self.threads:
            th.start()

    def _drain(self, src: int, group) -> None:
        failed = False
        into = None  # one receive buffer per sender (gloo): each bucket is loaded before the next arrives
        ack = torch.ones(1, dtype=torch.int64)
        while True:
            box = [None]
            try:
                dist.recv_object_list(box, src=src, group=group)
                meta = box[0]
                shared = meta is not None and "shm" in meta
                bucket = None if meta is None or shared else recv_bucket_bytes(meta, src, group, into)
            except Exception as exc:  # noqa: BLE001 - the sender died or timed out
                self.errors.append(f"sender rank {src}: receiving its buckets failed: {type(exc).__name__}: {exc}")
                _READERS.pop(src, None)  # a dead sender's segment is not kept mapped
                return
            if meta is None:
                return
            try:
                if shared:
                    bucket = _from_segment(meta, src)
                elif isinstance(bucket, Bucket):
                    into = bucket.flat if into is None or bucket.flat.numel() > into.numel() else into
                if not failed:  # after a failure: drain, the sender is still sending
                    with self.lock:
                        self.receiver.load(bucket)
            except Exception as exc:  # noqa: BLE001 - reported at close
                self.errors.append(f"sender rank {src}: {type(exc).__name__}: {exc}")
                failed = True
            del bucket
            if failed:
                _READERS.pop(src, None)  # mapped again (by its key) if the sender lives on
            if shared:
                try:
                    dist.send(ack, dst=src, group=group)  # the segment is the sender's again
                except Exception as exc:  # noqa: BLE001 - the sender died
                    self.errors.append(f"sender rank {src}: acknowledging its bucket failed: {exc}")
                    _READERS.pop(src, None)
                    return

    def send(self, bucket):
        with self.lock:
            self.receiver.load(bucket)

    def close(self):
        deadline = time.monotonic() + self.timeout_s
        for th in self.threads:
            th.join(max(0.0, deadline - time.monotonic()))
        late = [th for th in self.threads if th.is_alive()]
        if late:
            self.errors.append(f"{len(late)} sender(s) did not finish within {self.timeout_s:g} s")
        if self.errors:
            raise WeightSyncError("; ".join(self.errors))


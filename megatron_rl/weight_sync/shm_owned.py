"""Async rollouts' owned buckets collected on rank 0 through the senders' channels (``stream.stream_sync`` into a
``Collector``): every sender sends its own buckets as in a streamed sync -- through its shared-memory segment when
``settings.sender_transport`` is "shm" and rank 0 maps it (``in_process``, ``shm_reach``), else over its gloo pair
group -- and rank 0 copies each into memory it owns, then acknowledges. The one rule: rank 0 copies every bucket
before the acknowledgement, since a sender's segment is refilled after it (and rank 0's own buckets hold the model's
tensors, which the next step changes).

A job whose default group is not on the host (NCCL) keeps ``senders.stream_buckets`` (its device path); chosen once
by ``owned_collector``. docs/async_rollouts.md has the measurements.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron_rl.convert.pieces import copy_into
from megatron_rl.parallel.devices import collective_device
from megatron_rl.parallel.rank0 import is_rank0
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.endpoint import WeightEndpoint, WeightReceiver
from megatron_rl.weight_sync.in_process import InProcessSpec
from megatron_rl.weight_sync.senders import stream_buckets
from megatron_rl.weight_sync.settings import WeightSyncSettings
from megatron_rl.weight_sync.stream import stream_sync

__all__ = ["Collector", "owned_collector", "collect_from_senders", "collect_from_stages"]


def _owned(bucket) -> Bucket:
    """A copy of ``bucket`` in fresh memory (one copy of its bytes; a ``HeldBucket``'s tensors packed in its
    ``dtype``, cast as an engine casts them: ``nbytes`` counts them so)."""
    flat = getattr(bucket, "flat", None)
    if flat is not None:
        return Bucket(list(bucket.names), list(bucket.shapes), bucket.dtype, flat.clone())
    out = torch.empty(bucket.nbytes, dtype=torch.uint8)
    off, item = 0, torch.empty((), dtype=bucket.dtype).element_size()
    for _, t in bucket.tensors():
        n = t.numel() * item
        # a ``Pieces`` (a fused qkv's q / k / v, a TP gather's pieces) is valid until the next bucket
        copy_into(t, out[off:off + n].view(bucket.dtype).view(t.shape))
        off += n
    return Bucket(list(bucket.names), list(bucket.shapes), bucket.dtype, out)


class _Receiver(WeightReceiver):
    """One collection: each loaded bucket copied into ``buckets`` (rank 0)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.buckets: List[Bucket] = []
        self.done = False

    def load(self, bucket) -> None:
        self.buckets.append(_owned(bucket))

    def commit(self) -> None:
        self.done = True

    def abort(self, reason: str) -> None:
        self.buckets, self.done = [], False  # nothing half-collected is kept

    def channel(self):
        return InProcessSpec(self.timeout_s)


class Collector(WeightEndpoint):
    """Rank 0's stand-in for an engine in its process: a streamed sync into it leaves the version's buckets, owned,
    in ``receiver.buckets`` (uncast: ``weight_holding`` names no dtype)."""

    def __init__(self):
        self.receiver: Optional[_Receiver] = None
        self._version = None

    @property
    def weight_version(self):
        return self._version

    def update_weights(self, hf_dir, version):  # pragma: no cover - never asked: the collection is in memory
        raise NotImplementedError

    def begin_weight_sync(self, version, timeout_s, groups=None) -> WeightReceiver:
        # any streamed mode opens it (``groups``: distributed's update groups, not needed in rank 0's process)
        self.receiver = _Receiver(timeout_s)
        return self.receiver


def collect_from_senders(actor, settings: WeightSyncSettings, version: str) -> Optional[List[Bucket]]:
    """Collective over every trainer rank: ``version``'s buckets owned by rank 0 (None elsewhere), each sender's
    through its channel of ``settings.sender_transport``; a failed sender ends it on every rank (``stream_sync``:
    named, bounded by ``settings.timeout_s``)."""
    collect = dataclasses.replace(settings, verify_interval=0, delta=False)  # verified when the producer applies it
    collector = Collector() if is_rank0() else None
    stream_sync(actor, collector, collect, version, is_rank0())
    return collector.receiver.buckets if collector is not None else None


def collect_from_stages(actor, settings: WeightSyncSettings, version: str) -> Optional[List[Bucket]]:
    """Collective: every stage's buckets on rank 0 over the default group (staged on its device: NCCL)."""
    buckets = list(stream_buckets(actor, settings.bucket_bytes, None, view=settings.view))
    return buckets if is_rank0() else None


def owned_collector() -> Callable[..., Optional[List[Bucket]]]:
    """How this job's owned buckets reach rank 0, chosen once: the senders' channels (``sender_transport``: shm /
    gloo) when the default group is on the host; else (NCCL) the stages over the default group's device."""
    on_host = not dist.is_initialized() or collective_device(None).type == "cpu"
    return collect_from_senders if on_host else collect_from_stages

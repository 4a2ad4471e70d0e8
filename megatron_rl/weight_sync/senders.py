"""Senders: the trainer side of an in-memory sync, from the model's shards to buckets.

``stream_buckets`` is collective over every trainer rank: on each pipeline stage the TP / EP / ETP shards of one
parameter at a time are gathered into HF tensors (``convert.live.iter_hf_tensors``, the one gatherer), cast to
the engine's dtype and packed into ``buckets.Bucket`` buffers; stage 0's leader (global rank 0) yields its own
buckets, then those of each later stage, whose leader sends them to rank 0 one at a time
(``transport.send_bucket``). Peak extra host memory on a rank: one bucket + the parameter being gathered (+ on
rank 0 the bucket being received), never the model. ``pack`` replaces ``bucketize`` as the packer of every
stage (delta syncs: ``delta_sender.DeltaSender.pack``, whose buckets travel the same way).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rl.convert.live import is_stage_leader, iter_hf_tensors
from megatron_rl.rollout.base import WeightSyncError
from megatron_rl.weight_sync.buckets import Bucket, bucketize
from megatron_rl.weight_sync.transport import recv_bucket, send_bucket

__all__ = ["stream_buckets"]


def stream_buckets(actor, bucket_bytes: int, dtype: Optional[torch.dtype],
                   keep_dtype: Optional[set] = None,
                   pack: Optional[Callable[[Iterable[Tuple[str, torch.Tensor]]], Iterator]] = None) -> Iterator[Bucket]:
    """Collective over every trainer rank: on global rank 0, the model's HF tensors as buckets (stage 0's,
    then each later stage's, received from its leader); on other ranks nothing (they gather and send).
    ``pack(pairs)``: the packer of a stage's ``(name, tensor)`` stream (default: ``bucketize`` with
    ``bucket_bytes`` / ``dtype`` / ``keep_dtype``). Consume it to the end on every rank."""
    if pack is None:
        def pack(pairs):
            return bucketize(pairs, bucket_bytes, dtype, keep_dtype)
    groups = actor.groups
    pairs = iter_hf_tensors(actor.model, actor.model_cfg, actor.hf_target.geometry, groups)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    leader = is_stage_leader(groups)
    if world == 1:
        yield from pack(pairs)
        return
    roles = [None] * world
    dist.all_gather_object(roles, (groups.pp_rank, leader))
    senders = sorted((pp, r) for r, (pp, lead) in enumerate(roles) if lead and pp > 0)
    if rank == 0:
        if not leader or groups.pp_rank != 0:
            raise WeightSyncError("weight sync: global rank 0 is not the leader of pipeline stage 0")
        yield from pack(pairs)
        for _, src in senders:
            while True:
                bucket = recv_bucket(src)
                if bucket is None:
                    break
                yield bucket
    elif leader and groups.pp_rank > 0:
        for bucket in pack(pairs):
            send_bucket(bucket, 0)
            del bucket
        send_bucket(None, 0)
    else:
        for _ in pairs:  # collective partner of the stage leader's gathers
            pass


"""Senders: the trainer side of an in-memory sync, from the model's shards to buckets.

``own_buckets`` (every rank, collectively): the buckets of the tensors THIS rank owns -- on each pipeline stage
the dense tensors on TP rank 0 of the first data-parallel replica (gathered over TP), the routed experts of
each expert-parallel rank on its ETP rank 0 of the first expert replica (gathered over ETP, never over EP).
Those ranks are the senders (``sender_ranks``); each sends its own buckets to the engine, and no rank holds or
forwards another's. Memory on a sender: one bucket + the parameter being gathered.

``stream_buckets`` (every stage's buckets on global rank 0: async rollouts' ``OwnedBuckets``) is collective over
every trainer rank: on each pipeline stage the TP / EP / ETP shards of one
parameter at a time are gathered into HF tensors (``convert.live.iter_hf_tensors``, the one gatherer), cast to
the engine's dtype and packed into ``buckets.Bucket`` buffers; stage 0's leader (global rank 0) yields its own
buckets, then those of each later stage, whose leader sends them to rank 0 one at a time
(``transport.send_bucket``). Peak extra host memory on a rank: one bucket + the parameter being gathered (+ on
rank 0 the bucket being received), never the model. ``pack`` replaces ``bucketize`` as the packer of every
stage (delta syncs: ``delta_sender.DeltaSender.pack``, whose buckets travel the same way).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rl.convert.live import TensorView, is_stage_leader, iter_hf_tensors
from megatron_rl.weight_sync.endpoint import WeightSyncError
from megatron_rl.weight_sync.buckets import Bucket, bucketize, hold_buckets
from megatron_rl.weight_sync.transport import recv_bucket, send_bucket

__all__ = ["stream_buckets", "own_buckets", "sender_ranks"]


def stream_buckets(actor, bucket_bytes: int, dtype: Optional[torch.dtype],
                   keep_dtype: Optional[set] = None,
                   pack: Optional[Callable[[Iterable[Tuple[str, torch.Tensor]]], Iterator]] = None,
                   view: TensorView = None) -> Iterator[Bucket]:
    """Collective over every trainer rank: on global rank 0, the model's HF tensors as buckets (stage 0's,
    then each later stage's, received from its leader); on other ranks nothing (they gather and send).
    ``pack(pairs)``: the packer of a stage's ``(name, tensor)`` stream (default: ``bucketize`` with
    ``bucket_bytes`` / ``dtype`` / ``keep_dtype``); ``view``: how the model is read (``settings.view``: LoRA
    merged). Consume it to the end on every rank."""
    if pack is None:
        def pack(pairs):
            return bucketize(pairs, bucket_bytes, dtype, keep_dtype)
    groups = actor.groups
    pairs = iter_hf_tensors(actor.model, actor.model_cfg, actor.hf_target.geometry, groups, view=view)
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


def own_buckets(actor, bucket_bytes: int, dtype: Optional[torch.dtype], keep_dtype: Optional[set] = None,
                pack: Optional[Callable[[Iterable[Tuple[str, torch.Tensor]]], Iterator]] = None,
                hold: bool = False, alloc: Optional[Callable[[int], torch.Tensor]] = None,
                gather=None, view: TensorView = None) -> Iterator[Bucket]:
    """Collective over every trainer rank: the buckets of the HF tensors this rank owns (none on a rank that
    is not a sender), each sent before the next is packed (one buffer serves them all); ``pack`` and ``view`` as in
    ``stream_buckets``; ``hold``: ``buckets.HeldBucket``s (the engine is in this process); ``alloc``: the channel's
    buffer to pack each bucket into (``bucketize``); ``gather``: how split tensors reach their owner
    (``gather.piece_gather``). Tensors travel as ``convert.pieces.Pieces`` where they can (a fused qkv, the shm
    gather's pieces; not into ``pack``): the engine or the bucket copies them into place. Consume it to the end on
    every rank."""
    # the gathers move the engine's dtype (every rank has the same dtype and keep set: rank 0's plan); not when
    # some tensors stay in a higher precision, whose mcore names are not known before the mapping
    gather_dtype = dtype if not keep_dtype else None
    pairs = iter_hf_tensors(actor.model, actor.model_cfg, actor.hf_target.geometry, actor.groups, owner_only=True,
                            gather_dtype=gather_dtype, gather=gather, view=view, lazy=pack is None)
    if pack is not None:
        yield from pack(pairs)
    elif hold:
        yield from hold_buckets(pairs, bucket_bytes, dtype, keep_dtype)
    else:
        yield from bucketize(pairs, bucket_bytes, dtype, keep_dtype, reuse=True, alloc=alloc)


def is_sender(groups, has_experts: bool) -> bool:
    """Whether this rank owns tensors of the sync (``own_buckets``)."""
    dense = groups.dp_rank == 0 and groups.cp_rank == 0 and groups.tp_rank == 0
    experts = has_experts and groups.edp_rank == 0 and groups.etp_rank == 0
    return dense or experts


_SENDERS: dict = {}


def sender_ranks(actor) -> List[int]:
    """Collective over every trainer rank (once per process): the global ranks of the senders, sorted."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [0]
    key = id(actor.groups)
    if key not in _SENDERS:
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, is_sender(actor.groups, bool(actor.model_cfg.num_moe_experts)))
        _SENDERS[key] = [r for r, f in enumerate(flags) if f]
    return _SENDERS[key]

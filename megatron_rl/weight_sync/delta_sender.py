"""The trainer side of delta syncs (``rollout.weight_sync_delta``): each sender keeps its own HF
tensors as the engine holds them (cast to the engine's dtype; fp32-kept tensors in fp32) and packs, per tensor,
only what changed since (``delta.encode_delta`` -> ``delta.pack_deltas``).

    sender = DeltaSender()                                  # one per rank, for the whole job
    base = sender.base_for(engine) if rank0 else None       # rank 0: the version to send a delta from, or None
    for bucket in sender.pack(pairs, bucket_bytes, dtype, keep, base, "step-4", checks):
        ...                                                 # DeltaBuckets, as bucketize's Buckets travel
    sender.committed("step-4")   /   sender.failed()        # every rank, after the sync's outcome is shared

A version is sent whole (dense) when ``base`` is None -- the first one, the one after a failed or skipped
version, and the one after a server lost its version (restarted, or loaded other weights): rank 0 sends a delta
only while the engine -- every server, asked at the sync -- serves, valid, the version this sender's copies are at.
The copies are updated in place as the tensors pass (no second copy of the model); a failed sync leaves them
at no known version, so the next one is full. ``checks``: HF names whose whole tensor rank 0's verifier needs;
they ride in the bucket after the engine's bytes (``kind`` check) unless they travel dense anyway.

Where the copies live: in this process's HOST memory (CPU tensors, pageable), never on the trainer's device --
whatever device the gathered tensors come from. Each tensor is brought to the host as it passes (the one copy a
full sync makes too, into its bucket) and compared there, so the sync adds no device memory; the copies are
only read at sync time, on the host, so pinning them would lock that much RAM for no transfer. They are not split
by TP: a sender holds whole HF tensors (TP rank 0 of its stage gathers them; the bits that changed are those of
the HF tensor the engine receives). Memory per sender: its own HF tensors once, in the engine's dtype (fp32-kept
tensors in fp32) -- what ``megatron-rl check`` counts per sender (``ops.weight_sync_plan``).
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator, Optional, Set, Tuple

import torch

from megatron_rl.weight_sync.delta import DeltaBucket, TensorDelta, apply_delta, encode_delta, pack_deltas

__all__ = ["DeltaSender"]


class DeltaSender:
    """See the module doc."""

    def __init__(self):
        self.base: Dict[str, torch.Tensor] = {}
        self.version: Optional[str] = None
        """The version ``base`` is at (None: unknown -- the next sync is full)."""

    def base_for(self, engine) -> Optional[str]:
        """Rank 0: the version to send deltas from -- this sender's, when the engine serves it, valid, now
        (``engine.holds_weight_version``: SGLang servers are asked, so a restarted one gets a full sync)."""
        if self.version is None:
            return None
        return self.version if engine.holds_weight_version(self.version) else None

    def pack(self, pairs: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int, dtype: Optional[torch.dtype],
             keep: Set[str], base: Optional[str], version: str, checks: Set[str]) -> Iterator[DeltaBucket]:
        """The deltas of ``pairs`` (cast as ``bucketize`` casts) from ``base`` (None or another version than the
        copies': whole tensors), packed into buckets of about ``bucket_bytes``."""
        if base is not None and base != self.version:
            base = None
        self.version = None  # in flux until committed
        return pack_deltas(self._deltas(pairs, dtype, keep, base is None, checks), bucket_bytes, base, version)

    def _deltas(self, pairs, dtype, keep, full: bool, checks: Set[str]) -> Iterator[TensorDelta]:
        for name, t in pairs:
            if dtype is not None and t.is_floating_point() and name not in keep and t.dtype != dtype:
                t = t.to(dtype)
            t = t.detach().to("cpu")  # compared on the host, where the copy lives (a CPU tensor: itself)
            held = None if full else self.base.get(name)
            d = encode_delta(name, t, held)
            if name in checks and d.kind != "dense":
                yield TensorDelta(name, d.shape, d.dtype, "check", values=t)
            yield d
            # after the packer took ``d`` (its tensors never alias ``held``): bring the copy to the new version
            if held is None or tuple(held.shape) != tuple(t.shape) or held.dtype != t.dtype:
                self.base[name] = t.clone()  # host memory: t is on the host
            elif d.kind == "sparse":
                apply_delta(held, d)
            elif d.kind == "dense":
                held.copy_(t)

    def committed(self, version: str) -> None:
        """The engine now serves ``version``: the copies are at it."""
        self.version = version

    def failed(self) -> None:
        """The sync failed: the next one is full."""
        self.version = None

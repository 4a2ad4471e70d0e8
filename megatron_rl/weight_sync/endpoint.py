"""What an engine is to the weight sync: an endpoint that receives a version (an HF directory, or buckets through a
``WeightReceiver``), commits it, and reports checksums of the tensors it holds.

The engines (``rollout/``) implement ``WeightEndpoint`` and import only this module, ``versions``, their
``receivers/`` end and ``layout``; nothing of the trainer side (publisher, stream, senders, modes). The mode object
(``modes.py``) decides how the bytes travel; an engine never sees a mode string. ``WeightSyncError`` is a
``RolloutError``: a failed sync ends the step like a failed rollout.
"""
from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_rl.errors import RolloutError

__all__ = ["WeightSyncError", "WEIGHT_SYNC_MODES", "SyncCapabilities", "WeightHolding", "WeightReceiver",
           "WeightEndpoint", "tensor_checksum"]

#: How weights reach an engine (``rollout.weight_sync``): an HF export directory, in-memory buckets handed
#: over in the same host / process, or buckets broadcast over a process group to the engine's ranks.
WEIGHT_SYNC_MODES = ("disk", "tensor", "distributed")


class WeightSyncError(RolloutError):
    """Loading new weights into the engine failed."""


def tensor_checksum(t: torch.Tensor) -> str:
    """SGLang's weight checksum of ``t``: sha256 of its contiguous CPU bytes, first 8 bytes in hex."""
    t = t.detach().cpu().contiguous()
    digest = hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).digest()
    return f"{int.from_bytes(digest[:8], 'big'):016x}"


class WeightReceiver(abc.ABC):
    """One in-memory weight update of an engine, bucket by bucket (``WeightEndpoint.begin_weight_sync``).

    Until ``commit`` the engine serves no version the trainer expects (a request answered in between is
    rejected as stale); ``abort`` — allowed before or after ``commit`` — leaves the engine refusing to
    generate until a later sync succeeds, so partially updated weights are never served."""

    @abc.abstractmethod
    def load(self, bucket) -> None:
        """Load one ``weight_sync.buckets.Bucket`` (HF names) into the engine."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Every bucket was loaded: tag the engine with the update's version (checked on every server)."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """The update failed (``reason``): make sure no server serves the partial weights."""

    @abc.abstractmethod
    def channel(self):
        """How every sender reaches this update (a picklable ``weight_sync.transport.ChannelSpec``): each
        model-parallel shard owner sends its own buckets through it; rank 0 then commits or aborts."""


@dataclass(frozen=True)
class SyncCapabilities:
    """The ``rollout.weight_sync`` modes an engine class can receive, declared before one is built."""

    modes: tuple = ("disk",)
    """The modes this engine can receive (of ``WEIGHT_SYNC_MODES``)."""
    deferred: tuple = ("disk",)
    """The modes of ``modes`` whose payload rank 0 alone can apply later, after every trainer rank prepared it
    (``rollout.mode: async``: the producer thread loads it between segments; in memory: the version's buckets
    collected on rank 0, sent by the producer as the one sender)."""
    default_sync: str = "disk"
    """What ``rollout.weight_sync: auto`` means with ``rollout.mode: sync`` (one of ``modes``)."""
    default_async: str = "disk"
    """What ``rollout.weight_sync: auto`` means with ``rollout.mode: async`` (one of ``deferred``)."""

    def __post_init__(self):
        unknown = [m for m in self.modes if m not in WEIGHT_SYNC_MODES]
        if unknown or not set(self.deferred) <= set(self.modes) or self.default_sync not in self.modes \
                or self.default_async not in self.deferred:
            raise ValueError(f"SyncCapabilities: inconsistent declaration {self!r} (modes of {WEIGHT_SYNC_MODES}; "
                             f"deferred within modes; default_sync in modes; default_async in deferred)")

    def default(self, async_rollouts: bool) -> str:
        """The mode ``rollout.weight_sync: auto`` means (``async_rollouts``: ``rollout.mode: async``)."""
        return self.default_async if async_rollouts else self.default_sync


@dataclass(frozen=True)
class WeightHolding:
    """How an engine holds the tensors of one sync (``WeightEndpoint.weight_holding``): what the sender casts to and
    what verification rebuilds and hashes."""

    dtype: Optional[torch.dtype] = None
    """The dtype the engine keeps its weights in (buckets are cast to it); None if unknown."""
    full_precision: frozenset = frozenset()
    """HF names of the sync the engine keeps in a higher precision than ``dtype`` (sent uncast)."""
    checksum: Optional[Callable] = None
    """The function that hashes a tensor exactly as ``weight_checksums`` does; None: this process cannot reproduce
    the engine's hash, or verification was not asked for (nothing is then compared)."""
    layout: tuple = ()
    """The engine tensors ``weight_checksums`` can report (``weight_sync.layout.EngineTensor``), built from the HF
    names; empty: no verification."""
    tp_sizes: tuple = field(default=(1,))
    """The TP sizes of the engine's servers (one checksum per TP rank and tensor)."""


class WeightEndpoint(abc.ABC):
    """The weight side of an engine: what it accepts, how it receives a version, how it holds and hashes it."""

    #: The ``rollout.weight_sync`` modes this engine class can receive (read before building one).
    sync_capabilities: SyncCapabilities = SyncCapabilities()

    #: Whether the engine applies LoRA adapters sent alone (``rollout.lora_sync: adapter``: only A and B travel).
    lora_adapter_sync: bool = False

    #: Why the weights must not be served (a failed sync); None while they are valid.
    _invalid: str | None = None

    # ----------------------------------------------------------------------------------------- receiving
    @property
    @abc.abstractmethod
    def weight_version(self) -> str | None:
        """The weight version the engine is expected to serve (None until known)."""

    @abc.abstractmethod
    def update_weights(self, hf_dir: str, version: str) -> None:
        """Load the HF-format weights in ``hf_dir`` and tag them ``version``; later rollouts must carry it."""

    def begin_weight_sync(self, version: str, timeout_s: float, groups=None) -> WeightReceiver:
        """Start an in-memory update to ``version``. ``groups``: None -- the buckets reach this engine on the
        trainer's host; a ``weight_sync.transport.UpdateGroups`` -- each sender broadcasts in its own update group
        with the engine's ranks. ``timeout_s`` bounds every wait of the update."""
        raise WeightSyncError(f"{type(self).__name__} cannot receive in-memory weight updates "
                              f"(it supports {', '.join(self.sync_capabilities.modes)})")

    def holds_weight_version(self, version: str) -> bool:
        """Whether the engine serves ``version``, valid, right now -- what a delta sync may start from. Engines
        whose servers can lose it on their own (a restarted SGLang server) ask them."""
        return self.weight_version == version and self._invalid is None

    def invalidate_weights(self, reason: str) -> None:
        """Refuse to generate until a later sync succeeds (``reason``: what failed, said by ``generate``)."""
        self._invalid = reason

    # ------------------------------------------------------------------------- holding (verification)
    def weight_holding(self, hf_names, geometry=None, verify: bool = False) -> WeightHolding:
        """How the engine holds the HF tensors ``hf_names``: ``dtype`` and ``full_precision`` always; with
        ``verify`` also ``checksum``, ``layout`` (from ``geometry``: ``convert.geometry.HFGeometry``) and
        ``tp_sizes`` -- an engine asks its servers only for what it is asked (default: no layout, nothing verified)."""
        return WeightHolding(checksum=tensor_checksum if verify else None)

    def weight_checksums(self, names) -> dict:
        """``{server: {engine tensor name: (tensor_checksum of TP rank 0's copy, rank 1's, ...)}}`` for ``names``."""
        raise WeightSyncError(f"{type(self).__name__} cannot report weight checksums")

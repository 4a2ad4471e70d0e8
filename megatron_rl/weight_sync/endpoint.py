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

import torch

from megatron_rl.errors import RolloutError

__all__ = ["WeightSyncError", "WEIGHT_SYNC_MODES", "WeightReceiver", "WeightEndpoint", "tensor_checksum"]

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


class WeightEndpoint(abc.ABC):
    """The weight side of an engine: what it accepts, how it receives a version, how it holds and hashes it."""

    # ------------------------------------------------------------ capabilities (read before building one)
    #: The ``rollout.weight_sync`` modes this engine can receive (see ``WEIGHT_SYNC_MODES``).
    weight_sync_modes: tuple = ("disk",)

    #: The modes of ``weight_sync_modes`` whose payload rank 0 alone can apply later, after every trainer rank
    #: prepared it (``rollout.mode: async``: the producer thread loads it between segments; in memory: the
    #: version's buckets collected on rank 0, sent by the producer as the one sender).
    deferred_weight_sync_modes: tuple = ("disk",)

    #: Whether the engine applies LoRA adapters sent alone (``rollout.lora_sync: adapter``: only A and B travel).
    lora_adapter_sync: bool = False

    #: Why the weights must not be served (a failed sync); None while they are valid.
    _invalid: str | None = None

    @classmethod
    def default_weight_sync_mode(cls, async_rollouts: bool) -> str:
        """The mode ``rollout.weight_sync: auto`` means for this engine: one of ``weight_sync_modes``, and of
        ``deferred_weight_sync_modes`` when ``async_rollouts`` (``rollout.mode: async``)."""
        return "disk"

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
                              f"(it supports {', '.join(self.weight_sync_modes)})")

    def holds_weight_version(self, version: str) -> bool:
        """Whether the engine serves ``version``, valid, right now -- what a delta sync may start from. Engines
        whose servers can lose it on their own (a restarted SGLang server) ask them."""
        return self.weight_version == version and self._invalid is None

    def invalidate_weights(self, reason: str) -> None:
        """Refuse to generate until a later sync succeeds (``reason``: what failed, said by ``generate``)."""
        self._invalid = reason

    # ------------------------------------------------------------------------- holding (verification)
    @property
    def weight_dtype(self):
        """The torch dtype the engine keeps its weights in (buckets are cast to it), None if unknown."""
        return None

    def full_precision_weight_names(self, hf_names=()) -> set:
        """HF names (of ``hf_names``, the tensors of the sync) the engine keeps in a higher precision than
        ``weight_dtype`` (sent uncast)."""
        return set()

    def weight_checksum_fn(self):
        """The function that hashes a tensor exactly as ``weight_checksums`` does (default: ``tensor_checksum``),
        or None when this process cannot reproduce the engine's hash (verification is then skipped)."""
        return tensor_checksum

    def weight_layout(self, hf_names, geometry) -> list:
        """The engine tensors ``weight_checksums`` can report, as ``weight_sync.layout.EngineTensor`` objects built
        from the HF tensors ``hf_names`` (model of ``geometry``: ``convert.geometry.HFGeometry``); empty: no
        verification."""
        return []

    def weight_tp_sizes(self) -> tuple:
        """The TP sizes of the engine's servers (one checksum per TP rank and tensor)."""
        return (1,)

    def weight_checksums(self, names) -> dict:
        """``{server: {engine tensor name: (tensor_checksum of TP rank 0's copy, rank 1's, ...)}}`` for ``names``."""
        raise WeightSyncError(f"{type(self).__name__} cannot report weight checksums")

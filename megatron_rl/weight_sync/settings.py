"""``WeightSyncSettings``: every choice of a job's weight sync, built once from its ``rollout`` section (the mode
resolved there, ``auto`` included); every function of the sync takes it, never the job config.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.weight_sync import shm
from megatron_rl.weight_sync.lora_sync import LoraSync
from megatron_rl.weight_sync.modes import WeightSyncMode, resolve_mode

__all__ = ["WeightSyncSettings"]


@dataclass(frozen=True)
class WeightSyncSettings:
    """How a job's trained versions reach its engine."""

    mode: WeightSyncMode
    """The resolved ``rollout.weight_sync`` (``modes.resolve_mode``: "auto" is the engine class's default)."""
    engine: str
    """``rollout.engine`` (named in errors)."""
    deferred_modes: tuple
    """The modes the engine can apply later, on rank 0 alone (its ``sync_capabilities.deferred``; async rollouts)."""
    bucket_bytes: int
    """``rollout.weight_sync_bucket_mb`` in bytes: the size of one bucket."""
    timeout_s: float
    """``rollout.weight_sync_timeout_s``: the bound of every wait of a sync."""
    verify_interval: int
    """``rollout.weight_sync_verify_interval``: verify every N-th version (0: never)."""
    verify_tensors: int
    """``rollout.weight_sync_verify_tensors``: engine tensors compared per verified version (-1: all)."""
    delta: bool
    """``rollout.weight_sync_delta``: send only the elements changed since the version the engine holds."""
    export_dir: str
    """Where disk exports go: ``rollout.weight_sync_dir``, else ``<trainer.run_dir>/weight_sync``."""
    sender_transport: str = "gloo"
    """How the other senders' buckets reach an engine in rank 0's process (``in_process.SENDER_TRANSPORTS``): "shm"
    (shared memory for the senders on rank 0's host; ``build`` picks it where the host offers it) or "gloo"."""
    tp_gather: str = "gloo"
    """How a sender gathers its split parameters' TP / ETP pieces (``gather.TP_GATHERS``); ``build`` picks "flat"
    (one ``all_gather_into_tensor`` per parameter) with a GPU, else "shm" where the host offers it, else "gloo"."""
    lora: Optional[LoraSync] = None
    """A LoRA job's adapter sync (``actor.lora`` with ``rollout.lora_sync``); None: no adapters."""

    @property
    def view(self):
        """How the sender reads the model (``convert.live.TensorView``): LoRA merged, or None (as it is)."""
        return self.lora.view() if self.lora is not None and self.lora.mode == "merged" else None

    @classmethod
    def build(cls, rollout, run_dir: str, engine, lora=None,
              mode: Optional[WeightSyncMode] = None) -> "WeightSyncSettings":
        """The settings of a validated ``rollout`` config section (``run_dir``: ``trainer.run_dir``; ``engine``:
        the engine class, ``rollout.factory.engine_class(rollout.engine)``; ``lora``: ``actor.lora``; ``mode``: the
        job plan's ``resolve_mode`` result, resolved here when None: tests and tools)."""
        if mode is None:
            mode = resolve_mode(rollout, {rollout.engine: engine})
        return cls(mode=mode, engine=rollout.engine,
                   deferred_modes=tuple(engine.sync_capabilities.deferred),
                   bucket_bytes=int(rollout.weight_sync_bucket_mb * (1 << 20)),
                   timeout_s=float(rollout.weight_sync_timeout_s),
                   verify_interval=int(rollout.weight_sync_verify_interval),
                   verify_tensors=int(rollout.weight_sync_verify_tensors), delta=bool(rollout.weight_sync_delta),
                   export_dir=rollout.weight_sync_dir or os.path.join(run_dir, "weight_sync"),
                   sender_transport="shm" if shm.available() else "gloo",
                   tp_gather="flat" if torch.cuda.is_available() else "shm" if shm.available() else "gloo",
                   lora=LoraSync.of(lora, rollout))

    def due(self, version: int) -> bool:
        """Whether version number ``version`` is verified."""
        return self.verify_interval > 0 and version % self.verify_interval == 0

"""``WeightSyncSettings``: every choice of a job's weight sync, built once from its ``rollout`` section by
``WeightSyncSettings.checked`` (the job plan's builder: the mode resolved there, ``auto`` included, and every
``rollout.weight_sync*`` / ``rollout.lora_sync`` problem collected); every function of the sync takes it, never the
job config.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence

import torch

from megatron_rl.errors import Unbuilt
from megatron_rl.weight_sync import shm
from megatron_rl.weight_sync.lora_sync import LORA_SYNC_MODES, LoraSync
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
    def checked(cls, rollout, run_dir: str, engines: Mapping[str, type], lora=None,
                lora_targets: Sequence[str] = ()) -> "WeightSyncSettings":
        """The job's settings, built once (the mode by ``modes.resolve_mode``: ``auto`` is the engine's default);
        ``Unbuilt`` with the ``rollout.weight_sync*`` / ``rollout.lora_sync`` problems against the engine and
        ``rollout.mode`` (empty when ``rollout.engine`` is not one of ``engines``: that key's own check names it).
        ``engines``: every ``rollout.engine`` value's class; ``lora``: ``actor.lora`` (None: none);
        ``lora_targets``: the engine's problems with ``actor.lora.target_modules`` for adapter sync, reported when
        ``rollout.lora_sync`` has no other."""
        r = rollout
        errs: List[str] = []
        lora_errs = _lora_sync_problems(r, lora, engines) or list(lora_targets)
        mode = None
        try:
            mode = resolve_mode(r, engines)  # the one place a job's mode is built
        except ValueError as exc:
            errs.append(str(exc))
        if not r.weight_sync_bucket_mb > 0:
            errs.append(f"rollout.weight_sync_bucket_mb: must be > 0, got {r.weight_sync_bucket_mb}")
        if r.weight_sync_verify_interval < 0:
            errs.append(f"rollout.weight_sync_verify_interval: must be >= 0 (0: never), got {r.weight_sync_verify_interval}")
        if r.weight_sync_verify_tensors < -1:
            errs.append(f"rollout.weight_sync_verify_tensors: must be >= 0 or -1 (all), got {r.weight_sync_verify_tensors}")
        if not r.weight_sync_timeout_s > 0:
            errs.append(f"rollout.weight_sync_timeout_s: must be > 0, got {r.weight_sync_timeout_s}")
        if r.weight_sync_delta and mode is not None and not lora_errs:
            if r.mode == "async":
                errs.append("rollout.weight_sync_delta: true needs rollout.mode 'sync' (the async producer applies "
                            "whole versions later, possibly skipping some)")
            elif not mode.delta_ok:
                errs.append(f"rollout.weight_sync_delta: true needs rollout.weight_sync 'tensor' (the embedded engine "
                            f"in process; SGLang servers on the trainer's host, through our loader), got {mode.name!r}"
                            + (" (auto)" if mode.auto else "")
                            + ("; SGLang's /update_weights_from_distributed loads whole tensors only"
                               if mode.name == "distributed" else ""))
        errs += lora_errs
        if errs or mode is None:
            raise Unbuilt(errs)
        return cls.build(r, run_dir, engines[r.engine], lora, mode=mode)

    @classmethod
    def build(cls, rollout, run_dir: str, engine, lora=None,
              mode: Optional[WeightSyncMode] = None) -> "WeightSyncSettings":
        """The settings of a validated ``rollout`` config section (``run_dir``: ``trainer.run_dir``; ``engine``:
        the engine class, ``rollout.factory.engine_class(rollout.engine)``; ``lora``: ``actor.lora``; ``mode``: the
        mode ``checked`` resolved, resolved here when None: tests and tools)."""
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


def _lora_sync_problems(r, lora, engines: Mapping[str, type]) -> List[str]:
    """``rollout.lora_sync`` against ``actor.lora`` (``lora``) and the engine: a value it is not, adapter-only
    sync with an engine that cannot apply adapters, or a non-default value without adapters."""
    mode = getattr(r, "lora_sync", "merged")
    if mode not in LORA_SYNC_MODES:
        return [f"rollout.lora_sync: {mode!r} is not one of {', '.join(LORA_SYNC_MODES)}"]
    on = lora is not None and bool(getattr(lora, "rank", 0))
    if mode != "merged" and not on:
        return [f"rollout.lora_sync: {mode!r} needs actor.lora (rank > 0); without adapters the whole model syncs"]
    if mode == "adapter" and r.weight_sync_delta:
        return ["rollout.weight_sync_delta: true with rollout.lora_sync 'adapter': the adapters travel whole (a few "
                "MB); use one or the other"]
    engine = engines.get(r.engine) if isinstance(r.engine, str) else None
    if mode == "adapter" and engine is not None and not engine.lora_adapter_sync:
        return [f"rollout.lora_sync: 'adapter' is not built for rollout.engine {r.engine!r} (its engine cannot "
                f"apply adapters sent alone): use rollout.lora_sync: merged"]
    return []

"""The weight publisher: how a trained version reaches the rollout engine, chosen once when the job is built.

    publisher = build_weight_publisher(settings, actor, engine)  # every rank (engine: rank 0's, None elsewhere)
    metrics = publisher.publish("step-7")                        # collective; the weight_sync/* metrics

``settings.mode`` (resolved once: ``settings.WeightSyncSettings``) picks one class: ``StreamPublisher`` (tensor /
distributed: ``stream.stream_sync``), ``DeltaPublisher`` (tensor with ``rollout.weight_sync_delta``),
``DiskPublisher`` (an HF export the engine loads), ``DeferredPublisher`` (async rollouts: a ``WeightPayload`` handed
to the producer, which applies it later). A payload knows how it is applied (``DiskExport``, ``OwnedBuckets``), so
nobody asks what kind it is. docs/weight_sync.md has the whole story.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Dict, List, Optional

from megatron_rl.parallel.rank0 import from_rank0, is_rank0
from megatron_rl.weight_sync.adapter_sync import adapter_payload
from megatron_rl.weight_sync.delta_sender import DeltaSender
from megatron_rl.weight_sync.endpoint import WeightSyncError
from megatron_rl.weight_sync.exports import export_report, prune_exports
from megatron_rl.weight_sync.modes import WeightSyncMode
from megatron_rl.weight_sync.report import SyncReport
from megatron_rl.weight_sync.settings import WeightSyncSettings
from megatron_rl.weight_sync.shm_owned import owned_collector
from megatron_rl.weight_sync.stream import stream_sync
from megatron_rl.weight_sync.verify import verify_buckets, verify_export
from megatron_rl.weight_sync.versions import parse_version

__all__ = ["WeightPayload", "DiskExport", "OwnedBuckets", "WeightPublisher", "StreamPublisher", "DeltaPublisher",
           "DiskPublisher", "DeferredPublisher", "AdapterPublisher", "build_weight_publisher", "deferred_publisher",
           "payload_maker"]


# ----------------------------------------------------------------------------------------------- payloads

class WeightPayload:
    """A version's weights, made now and applied to the engine now or later (rank 0)."""

    def apply(self, engine, settings: WeightSyncSettings, version: str, actor=None) -> SyncReport:
        """Load into ``engine``, tag ``version`` and verify when due (``actor``: the model's geometry for owned
        buckets; None: not verified). A failed verification marks the engine invalid."""
        raise NotImplementedError

    def report(self) -> SyncReport:
        """What the payload moves (bytes, buckets)."""
        raise NotImplementedError

    def release(self, keep_versions: set) -> None:
        """Free what no engine may load any more (disk: exports of versions outside ``keep_versions``)."""


class DiskExport(WeightPayload):
    """An HF export directory ``run_dir/weight_sync/step-N`` (or ``rollout.weight_sync_dir``)."""

    def __init__(self, path: str):
        self.path = path

    def apply(self, engine, settings, version, actor=None) -> SyncReport:
        engine.update_weights(self.path, version)
        return _verified(engine, version, lambda: verify_export(engine, settings, self.path, version))

    def report(self) -> SyncReport:
        return export_report(self.path)

    def release(self, keep_versions: set) -> None:
        prune_exports(os.path.dirname(self.path), keep_versions)


class OwnedBuckets(WeightPayload):
    """The model's HF tensors as buckets owned by rank 0 (uncast: the engine casts on load, so tensors it keeps
    in higher precision than its compute dtype arrive exact)."""

    def __init__(self, buckets: List, mode: WeightSyncMode):
        self.buckets = buckets
        self.mode = mode

    def apply(self, engine, settings, version, actor=None) -> SyncReport:
        self.mode.load(engine, self.buckets, version, settings.timeout_s)
        if actor is None:
            return SyncReport()
        return _verified(engine, version, lambda: verify_buckets(engine, settings, actor, self.buckets, version))

    def report(self) -> SyncReport:
        return SyncReport(bytes=sum(b.nbytes for b in self.buckets), buckets=len(self.buckets))


def _verified(engine, version: str, verify: Callable[[], SyncReport]) -> SyncReport:
    try:
        return verify()
    except Exception as exc:
        engine.invalidate_weights(f"weight sync to {version!r}: {type(exc).__name__}: {exc}")
        raise


def export_payload(actor, settings: WeightSyncSettings, version: str) -> DiskExport:
    """Collective: ``version`` as an HF export in ``settings.export_dir``."""
    path = os.path.join(settings.export_dir, version)
    actor.export_hf(path, view=settings.view)
    return DiskExport(path)


def bucket_payload(actor, settings: WeightSyncSettings, collect: Callable, version: str) -> Optional[OwnedBuckets]:
    """Collective: ``version`` as buckets owned by rank 0 (None elsewhere), applied in ``settings.mode``;
    ``collect``: how they reach rank 0 (``shm_owned.owned_collector``, chosen once by ``payload_maker``)."""
    buckets = collect(actor, settings, version)
    return OwnedBuckets(buckets, settings.mode) if is_rank0() else None


def payload_maker(actor, settings: WeightSyncSettings) -> Callable[[str], Optional[WeightPayload]]:
    """The collective ``version -> payload`` of ``settings.mode``, chosen once (disk: an export; otherwise owned
    buckets on rank 0; ``rollout.lora_sync: adapter``: the adapters alone, ``adapter_sync.AdapterPayload``)."""
    if settings.lora is not None and settings.lora.mode == "adapter":
        return functools.partial(adapter_payload, actor, settings)
    if not settings.mode.streamed:
        return functools.partial(export_payload, actor, settings)
    return functools.partial(bucket_payload, actor, settings, owned_collector())


# --------------------------------------------------------------------------------------------- publishers

class WeightPublisher:
    """Pushes the actor's current weights towards the engine as ``version`` (collective over every rank)."""

    def publish(self, version: str) -> Dict[str, float]:
        """Returns the ``weight_sync/*`` metrics; an engine failure on rank 0 is raised on every rank."""
        raise NotImplementedError


class StreamPublisher(WeightPublisher):
    """Modes tensor / distributed: buckets streamed to the engine's receiver and verified in passing.
    ``corrupt(bucket)`` (tests only) alters a bucket after its checksums were taken, like a fault in transit."""

    def __init__(self, actor, engine, settings: WeightSyncSettings, corrupt=None):
        self.actor, self.engine, self.settings, self.corrupt = actor, engine, settings, corrupt

    def publish(self, version: str) -> Dict[str, float]:
        return stream_sync(self.actor, self.engine, self.settings, version, is_rank0(), self.corrupt).metrics()


class DeltaPublisher(StreamPublisher):
    """``rollout.weight_sync_delta``: streamed like ``StreamPublisher``, but per tensor only the elements changed
    since the version the engine holds (``delta_sender.DeltaSender``, one per rank for the whole job); a full
    sync first and after a failed or skipped version."""

    def __init__(self, actor, engine, settings: WeightSyncSettings, corrupt=None):
        super().__init__(actor, engine, settings, corrupt)
        self.sender = DeltaSender()

    def publish(self, version: str) -> Dict[str, float]:
        try:
            report = stream_sync(self.actor, self.engine, self.settings, version, is_rank0(), self.corrupt,
                                 delta=self.sender)
        except BaseException:
            self.sender.failed()
            raise
        self.sender.committed(version)
        return report.metrics()


class DiskPublisher(WeightPublisher):
    """Mode disk: an export the engine loads now; only the newest export is kept."""

    def __init__(self, actor, engine, settings: WeightSyncSettings):
        self.actor, self.engine, self.settings = actor, engine, settings

    def publish(self, version: str) -> Dict[str, float]:
        payload = export_payload(self.actor, self.settings, version)

        def apply() -> SyncReport:
            moved, done = payload.report(), payload.apply(self.engine, self.settings, version, self.actor)
            moved.checked, moved.verified, moved.verified_frac = done.checked, done.verified, done.verified_frac
            if version.startswith("step-"):  # a training version: older exports are no longer needed
                payload.release({parse_version(version)})
            return moved

        return from_rank0(apply).metrics()


class DeferredPublisher(WeightPublisher):
    """Async rollouts: the payload goes to rank 0's producer, which applies (and verifies) it in its thread when
    its schedule needs it -- a failure there surfaces at a later step's rollouts; this step's
    ``weight_sync/verified_param_frac`` is 0."""

    def __init__(self, actor, settings: WeightSyncSettings, producer=None):
        if settings.mode.name not in settings.deferred_modes:
            raise WeightSyncError(f"rollout.weight_sync {settings.mode.name!r} with rollout.engine {settings.engine!r} "
                                  f"cannot be applied later by the async producer (use rollout.weight_sync: disk)")
        self.actor, self.settings, self.producer = actor, settings, producer
        self.make = payload_maker(actor, settings)

    def publish(self, version: str) -> Dict[str, float]:
        payload = self.make(version)

        def hand_over() -> SyncReport:
            self.producer.publish(parse_version(version), payload)
            payload.release(self.producer.versions_in_use())
            return payload.report()

        return from_rank0(hand_over).metrics()


class AdapterPublisher(WeightPublisher):
    """``rollout.lora_sync: adapter``: each version's LoRA adapters alone, loaded into the engine right away and
    verified by the probe's log-probs when due (``adapter_sync``)."""

    def __init__(self, actor, engine, settings: WeightSyncSettings):
        self.actor, self.engine, self.settings = actor, engine, settings

    def publish(self, version: str) -> Dict[str, float]:
        payload = adapter_payload(self.actor, self.settings, version)

        def apply() -> SyncReport:
            moved, done = payload.report(), payload.apply(self.engine, self.settings, version)
            moved.verified, moved.verified_frac = done.verified, done.verified_frac
            return moved

        return from_rank0(apply).metrics()


def build_weight_publisher(settings: WeightSyncSettings, actor, engine, corrupt=None) -> WeightPublisher:
    """The publisher that loads each version into the engine right away (every rank; ``engine``: rank 0's)."""
    if settings.lora is not None and settings.lora.mode == "adapter":
        return AdapterPublisher(actor, engine, settings)
    if not settings.mode.streamed:
        return DiskPublisher(actor, engine, settings)
    if settings.delta:
        return DeltaPublisher(actor, engine, settings, corrupt)
    return StreamPublisher(actor, engine, settings, corrupt)


def deferred_publisher(settings: WeightSyncSettings, actor) -> DeferredPublisher:
    """The publisher of async rollouts (its ``producer``, rank 0's, is set once it runs; None elsewhere). Raises
    ``WeightSyncError`` when the mode cannot be applied later -- before any producer exists."""
    return DeferredPublisher(actor, settings)

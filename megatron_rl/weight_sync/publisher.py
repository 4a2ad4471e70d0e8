"""The weight publisher: how a trained version reaches the rollout engine, chosen once when the job is built.

    publisher = build_weight_publisher(cfg, actor, engine)      # every rank (engine: rank 0's, None elsewhere)
    metrics = publisher.publish("step-7")                        # collective; the weight_sync/* metrics

The mode is resolved once, as an object (``modes.weight_sync_mode``: ``rollout.weight_sync``, or for "auto" the
engine class's own default -- ``default_weight_sync_mode`` -- for sync or async rollouts), and picks one class:

* ``StreamPublisher`` (tensor / distributed): buckets streamed from every rank to rank 0's engine receiver and
  verified as they pass (``stream.stream_sync``).
* ``DeltaPublisher`` (tensor with ``rollout.weight_sync_delta``): the same stream, carrying per tensor only the
  elements changed since the version the engine holds (``delta.py``, ``delta_sender.py``).
* ``DiskPublisher`` (disk): an HF export that rank 0's engine loads, then verifies; older exports are pruned.
* ``DeferredPublisher`` (async rollouts, after the producer started): the version is turned into a
  ``WeightPayload`` now (an export, or owned buckets on rank 0) and handed to the producer, which applies it in
  its own thread when its schedule needs it (``payload.apply``, verification included).

A ``WeightPayload`` knows how it is applied and what it holds, so nobody asks what kind of payload it is:
``DiskExport(path)`` (``engine.update_weights`` from the directory) and ``OwnedBuckets(buckets)`` (an in-memory
update from buckets copied to rank 0, which the async producer loads as the one sender: into the embedded
engine, or SGLang servers through shared memory or its own update group). Streaming: ``stream.py``; verification:
``verify.py``; pruning: ``exports.py``.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Dict, List, Optional

from megatron_rl.config import JobConfig
from megatron_rl.parallel.rank0 import from_rank0, is_rank0
from megatron_rl.rollout.base import WeightSyncError
from megatron_rl.rollout.factory import engine_class
from megatron_rl.rollout.versions import parse_version
from megatron_rl.weight_sync.delta_sender import DeltaSender
from megatron_rl.weight_sync.exports import export_report, prune_exports
from megatron_rl.weight_sync.modes import WeightSyncMode, weight_sync_mode
from megatron_rl.weight_sync.report import SyncReport
from megatron_rl.weight_sync.senders import stream_buckets
from megatron_rl.weight_sync.stream import stream_sync
from megatron_rl.weight_sync.verify import verify_buckets, verify_export

__all__ = ["weight_sync_mode", "WeightPayload", "DiskExport", "OwnedBuckets", "WeightPublisher", "StreamPublisher",
           "DeltaPublisher",
           "DiskPublisher", "DeferredPublisher", "build_weight_publisher", "deferred_publisher", "payload_maker"]


# ----------------------------------------------------------------------------------------------- payloads

class WeightPayload:
    """A version's weights, made now and applied to the engine now or later (rank 0)."""

    def apply(self, engine, cfg: JobConfig, version: str, actor=None) -> SyncReport:
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

    def apply(self, engine, cfg, version, actor=None) -> SyncReport:
        engine.update_weights(self.path, version)
        return _verified(engine, version, lambda: verify_export(engine, cfg, self.path, version))

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

    def apply(self, engine, cfg, version, actor=None) -> SyncReport:
        self.mode.load(engine, self.buckets, version, cfg.rollout.weight_sync_timeout_s)
        if actor is None:
            return SyncReport()
        return _verified(engine, version, lambda: verify_buckets(engine, cfg, actor, self.buckets, version))

    def report(self) -> SyncReport:
        return SyncReport(bytes=sum(b.nbytes for b in self.buckets), buckets=len(self.buckets))


def _verified(engine, version: str, verify: Callable[[], SyncReport]) -> SyncReport:
    try:
        return verify()
    except Exception as exc:
        engine._mark_invalid(f"weight sync to {version!r}: {type(exc).__name__}: {exc}")
        raise


def export_payload(actor, cfg: JobConfig, version: str) -> DiskExport:
    """Collective: ``version`` as an HF export (``rollout.weight_sync_dir`` or ``run_dir/weight_sync``)."""
    out = cfg.rollout.weight_sync_dir or os.path.join(cfg.trainer.run_dir, "weight_sync")
    path = os.path.join(out, version)
    actor.export_hf(path)
    return DiskExport(path)


def bucket_payload(actor, cfg: JobConfig, version: str, mode: WeightSyncMode) -> Optional[OwnedBuckets]:
    """Collective: ``version`` as buckets owned by rank 0 (None elsewhere), applied in ``mode``."""
    buckets = list(stream_buckets(actor, int(cfg.rollout.weight_sync_bucket_mb * (1 << 20)), None))
    return OwnedBuckets(buckets, mode) if is_rank0() else None


def payload_maker(actor, cfg: JobConfig, mode: WeightSyncMode) -> Callable[[str], Optional[WeightPayload]]:
    """The collective ``version -> payload`` of ``mode``, chosen once (disk: an export; otherwise owned buckets on
    rank 0)."""
    if not mode.streamed:
        return functools.partial(export_payload, actor, cfg)
    return lambda version: bucket_payload(actor, cfg, version, mode)


# --------------------------------------------------------------------------------------------- publishers

class WeightPublisher:
    """Pushes the actor's current weights towards the engine as ``version`` (collective over every rank)."""

    def publish(self, version: str) -> Dict[str, float]:
        """Returns the ``weight_sync/*`` metrics; an engine failure on rank 0 is raised on every rank."""
        raise NotImplementedError


class StreamPublisher(WeightPublisher):
    """Modes tensor / distributed: buckets streamed to the engine's receiver and verified in passing.
    ``corrupt(bucket)`` (tests only) alters a bucket after its checksums were taken, like a fault in transit."""

    def __init__(self, actor, engine, cfg: JobConfig, mode: WeightSyncMode, corrupt=None):
        self.actor, self.engine, self.cfg, self.mode, self.corrupt = actor, engine, cfg, mode, corrupt

    def publish(self, version: str) -> Dict[str, float]:
        return stream_sync(self.actor, self.engine, self.cfg, self.mode, version, is_rank0(), self.corrupt).metrics()


class DeltaPublisher(StreamPublisher):
    """``rollout.weight_sync_delta``: streamed like ``StreamPublisher``, but per tensor only the elements changed
    since the version the engine holds (``delta_sender.DeltaSender``, one per rank for the whole job); a full
    sync first and after a failed or skipped version."""

    def __init__(self, actor, engine, cfg: JobConfig, mode: WeightSyncMode, corrupt=None):
        super().__init__(actor, engine, cfg, mode, corrupt)
        self.sender = DeltaSender()

    def publish(self, version: str) -> Dict[str, float]:
        try:
            report = stream_sync(self.actor, self.engine, self.cfg, self.mode, version, is_rank0(), self.corrupt,
                                 delta=self.sender)
        except BaseException:
            self.sender.failed()
            raise
        self.sender.committed(version)
        return report.metrics()


class DiskPublisher(WeightPublisher):
    """Mode disk: an export the engine loads now; only the newest export is kept."""

    def __init__(self, actor, engine, cfg: JobConfig):
        self.actor, self.engine, self.cfg = actor, engine, cfg

    def publish(self, version: str) -> Dict[str, float]:
        payload = export_payload(self.actor, self.cfg, version)

        def apply() -> SyncReport:
            moved, done = payload.report(), payload.apply(self.engine, self.cfg, version, self.actor)
            moved.checked, moved.verified, moved.verified_frac = done.checked, done.verified, done.verified_frac
            if version.startswith("step-"):  # a training version: older exports are no longer needed
                payload.release({parse_version(version)})
            return moved

        return from_rank0(apply).metrics()


class DeferredPublisher(WeightPublisher):
    """Async rollouts: the payload goes to rank 0's producer, which applies (and verifies) it in its thread when
    its schedule needs it -- a failure there surfaces at a later step's rollouts; this step's
    ``weight_sync/verified_param_frac`` is 0."""

    def __init__(self, actor, cfg: JobConfig, mode: WeightSyncMode, producer=None):
        if mode.name not in engine_class(cfg.rollout.engine).deferred_weight_sync_modes:
            raise WeightSyncError(f"rollout.weight_sync {mode.name!r} with rollout.engine {cfg.rollout.engine!r} cannot "
                                  f"be applied later by the async producer (use rollout.weight_sync: disk)")
        self.actor, self.cfg, self.mode, self.producer = actor, cfg, mode, producer
        self.make = payload_maker(actor, cfg, mode)

    def publish(self, version: str) -> Dict[str, float]:
        payload = self.make(version)

        def hand_over() -> SyncReport:
            self.producer.publish(parse_version(version), payload)
            payload.release(self.producer.versions_in_use())
            return payload.report()

        return from_rank0(hand_over).metrics()


def build_weight_publisher(cfg: JobConfig, actor, engine, corrupt=None) -> WeightPublisher:
    """The publisher that loads each version into the engine right away (every rank; ``engine``: rank 0's)."""
    mode = weight_sync_mode(cfg)
    if not mode.streamed:
        return DiskPublisher(actor, engine, cfg)
    if cfg.rollout.weight_sync_delta:
        return DeltaPublisher(actor, engine, cfg, mode, corrupt)
    return StreamPublisher(actor, engine, cfg, mode, corrupt)


def deferred_publisher(cfg: JobConfig, actor) -> DeferredPublisher:
    """The publisher of async rollouts (its ``producer``, rank 0's, is set once it runs; None elsewhere). Raises
    ``WeightSyncError`` when the mode cannot be applied later -- before any producer exists."""
    return DeferredPublisher(actor, cfg, weight_sync_mode(cfg))

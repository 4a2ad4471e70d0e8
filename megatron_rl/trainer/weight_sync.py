"""Trainer -> rollout engine weight sync (``rollout.weight_sync``), collective over every trainer rank.

Modes (``resolve_mode``; "auto" picks tensor for the embedded engine, distributed for SGLang, and disk for
SGLang in ``rollout.mode: async``):

* ``disk`` — rank 0 writes an HF export (``actor.export_hf``) and the engine loads the directory
  (SGLang ``/update_weights_from_disk``). Memory: the full model on rank 0; the fallback.
* ``tensor`` / ``distributed`` — buckets streamed from ``convert.live.iter_hf_tensors`` (the one gatherer):
  on each pipeline stage the TP / EP / ETP shards of one parameter at a time are gathered, cast to the
  engine's dtype and packed into ``weight_buckets.Bucket`` buffers of ``rollout.weight_sync_bucket_mb``;
  stage 0's leader (global rank 0) hands its buckets to the engine's ``WeightReceiver`` as they fill,
  the leaders of the later stages send theirs to rank 0 one at a time (``send``/``recv``), which hands
  them on. Peak extra host memory on a rank: one bucket + the parameter being gathered (+ on rank 0 the
  bucket being received), never the model. tensor: the embedded engine copies each bucket into its model
  in process; SGLang gets ``/update_weights_from_tensor`` (same host). distributed: SGLang receives each
  bucket by broadcast in a gloo (CPU) / NCCL (GPU) group with rank 0 (``/update_weights_from_distributed``).
* Failures: a bucket the engine rejects, a dead server or a timeout is caught on rank 0, the rest of the
  stream is drained (so no rank waits in a send), ``WeightReceiver.abort`` makes sure no server serves the
  partial weights, and the error is raised on every rank.
* Verification of the disk mode (``verify_disk_sync``): after the engine loaded the export, sampled tensors
  of the export (cast as the engine's loader casts them) are compared with the engine's copies.
* Verification (every ``rollout.weight_sync_verify_interval`` versions): rank 0 takes the checksum
  (``weight_buckets.tensor_checksum``, SGLang's ``/weights_checker`` format) of
  ``rollout.weight_sync_verify_tensors`` sampled tensors as they stream — spread over the whole model,
  so every stage is sampled, rotated by version — and compares them with the engine's own copies
  (``RolloutEngine.weight_checksums``); a mismatch aborts the sync naming every tensor that differs.
* Async rollouts (``rollout.mode: async``): the producer thread applies weights later, on rank 0 alone.
  disk: the export directory is the payload; tensor (embedded engine): the buckets are collected on rank 0
  (owned copies: the full model there, as before) and applied by the producer. distributed / SGLang
  tensor need the engine's group at apply time and are rejected by config validation.

Metrics: ``weight_sync/bytes``, ``weight_sync/buckets``, ``weight_sync/verified`` (1 when verified);
the loop times the call as ``timing/weight_sync_s``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron_rl.config import JobConfig
from megatron_rl.convert.live import is_stage_leader, iter_hf_tensors
from megatron_rl.convert.mapping import param_rules
from megatron_rl.rollout.base import WeightSyncError
from megatron_rl.rollout.weight_buckets import DTYPE_NAMES, Bucket, bucketize, tensor_checksum
from megatron_rl.trainer.async_rollout import parse_version
from megatron_rl.trainer.rollout_phase import share_from_rank0

__all__ = ["resolve_mode", "stream_buckets", "weights_payload", "apply_weights", "sync_weights", "SyncReport"]


def resolve_mode(cfg: JobConfig) -> str:
    """The weight-sync mode of ``cfg`` ("auto" resolved per engine and rollout mode)."""
    r = cfg.rollout
    if r.weight_sync != "auto":
        return r.weight_sync
    if r.engine == "embedded":
        return "tensor"
    return "disk" if r.mode == "async" else "distributed"


@dataclass
class SyncReport:
    """What one sync moved (metrics of the step)."""

    bytes: int = 0
    """Bytes handed to the engine (in the engine's dtype; the export size for disk)."""
    buckets: int = 0
    """Buckets handed to the engine (0 for disk)."""
    verified: bool = False
    """The engine's copies of the sampled tensors matched the trainer's."""
    checked: List[str] = field(default_factory=list)
    """The tensors whose checksums were compared."""

    def metrics(self) -> Dict[str, float]:
        return {"weight_sync/bytes": float(self.bytes), "weight_sync/buckets": float(self.buckets),
                "weight_sync/verified": 1.0 if self.verified else 0.0}


# ------------------------------------------------------------------------------------- bucket stream

def _send_bucket(bucket: Optional[Bucket], dst: int) -> None:
    dist.send_object_list([None if bucket is None else bucket.meta()], dst=dst)
    if bucket is not None:
        dist.send(bucket.flat.contiguous(), dst=dst)


def _recv_bucket(src: int) -> Optional[Bucket]:
    box = [None]
    dist.recv_object_list(box, src=src)
    if box[0] is None:
        return None
    bucket = Bucket.empty(box[0])
    dist.recv(bucket.flat, src=src)
    return bucket


def stream_buckets(actor, bucket_bytes: int, dtype: Optional[torch.dtype],
                   keep_dtype: Optional[set] = None) -> Iterator[Bucket]:
    """Collective over every trainer rank: on global rank 0, the model's HF tensors as buckets (stage 0's,
    then each later stage's, received from its leader); on other ranks nothing (they gather and send).
    Consume it to the end on every rank."""
    groups = actor.groups
    pairs = iter_hf_tensors(actor.model, actor.model_cfg, actor.hf_target.geometry, groups)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    leader = is_stage_leader(groups)
    if world == 1:
        yield from bucketize(pairs, bucket_bytes, dtype, keep_dtype)
        return
    roles = [None] * world
    dist.all_gather_object(roles, (groups.pp_rank, leader))
    senders = sorted((pp, r) for r, (pp, lead) in enumerate(roles) if lead and pp > 0)
    if rank == 0:
        if not leader or groups.pp_rank != 0:
            raise WeightSyncError("weight sync: global rank 0 is not the leader of pipeline stage 0")
        yield from bucketize(pairs, bucket_bytes, dtype, keep_dtype)
        for _, src in senders:
            while True:
                bucket = _recv_bucket(src)
                if bucket is None:
                    break
                yield bucket
    elif leader and groups.pp_rank > 0:
        for bucket in bucketize(pairs, bucket_bytes, dtype, keep_dtype):
            _send_bucket(bucket, 0)
            del bucket
        _send_bucket(None, 0)
    else:
        for _ in pairs:  # collective partner of the stage leader's gathers
            pass


def _version_number(tag: str) -> int:
    """The number of a ``step-N`` version tag (0 for any other tag: verified like version 0)."""
    try:
        return parse_version(tag)
    except ValueError:
        return 0


def _sample(names: List[str], k: int, version: int) -> List[str]:
    """``k`` names spread evenly over ``names`` (model order, so every stage), rotated by ``version``."""
    if k < 0 or k >= len(names):
        return list(names)
    if k == 0:
        return []
    step = len(names) / k
    return sorted({names[(int(i * step) + version) % len(names)] for i in range(k)}, key=names.index)


def _expected_names(actor) -> List[str]:
    return [n for r in param_rules(actor.hf_target.geometry) for n in r.hf_names]


def _stream_sync(actor, engine, cfg: JobConfig, mode: str, version: str, rank0: bool,
                 corrupt=None) -> SyncReport:
    """Collective: stream buckets to rank 0's engine receiver, verify, share any error; see the module doc.
    ``corrupt(bucket)`` (tests) alters a bucket after its checksums were taken, like a fault in transit."""
    rc = cfg.rollout
    report = SyncReport()
    error: Optional[BaseException] = None
    receiver = None
    plan = None
    if rank0:
        try:
            receiver = engine.begin_weight_sync(mode, version, master_address=rc.weight_sync_master_address,
                                                timeout_s=rc.weight_sync_timeout_s)
            names = _expected_names(actor)
            v = _version_number(version)
            verify = rc.weight_sync_verify_interval > 0 and v % rc.weight_sync_verify_interval == 0
            checkable = engine.checkable_weight_names() if verify else set()
            sample = _sample([n for n in names if n in checkable], rc.weight_sync_verify_tensors, v)
            dt = engine.weight_dtype
            plan = (DTYPE_NAMES.get(dt), set(sample), names, sorted(engine.full_precision_weight_names()))
        except Exception as exc:  # noqa: BLE001 - shared below
            error = exc
    box = share_from_rank0((error, plan[0] if plan else None, plan[3] if plan else None))
    if box[0] is not None:
        raise box[0]
    dtype = getattr(torch, box[1]) if box[1] else None
    keep = set(box[2] or ())
    expected: Dict[str, str] = {}
    seen: Dict[str, int] = {}
    for bucket in stream_buckets(actor, int(rc.weight_sync_bucket_mb * (1 << 20)), dtype, keep):
        if not rank0 or error is not None:
            continue  # drain: the other ranks are still sending
        try:
            for name, t in bucket.tensors():
                seen[name] = seen.get(name, 0) + 1
                if name in plan[1]:
                    expected[name] = tensor_checksum(t)
            if corrupt is not None:
                corrupt(bucket)
            receiver.load(bucket)
            report.bytes += bucket.nbytes
            report.buckets += 1
        except Exception as exc:  # noqa: BLE001 - shared below
            error = exc
        del bucket
    if rank0:
        try:
            if error is None:
                missing = [n for n in plan[2] if n not in seen]
                twice = [n for n, c in seen.items() if c > 1]
                if missing or twice:
                    raise WeightSyncError(f"weight sync to {version!r}: the trainer's stream missed {missing[:8]} "
                                          f"and sent twice {twice[:8]}")
                receiver.commit()
                if expected:
                    _check_engine_copies(engine, expected, f"weight sync to {version!r}", "trainer", "the trainer's")
                    report.verified = True
                    report.checked = sorted(expected)
        except Exception as exc:  # noqa: BLE001 - shared below
            error = exc
        if error is not None and receiver is not None:
            try:
                receiver.abort(f"{type(error).__name__}: {error}")
            except Exception as exc:  # noqa: BLE001 - the first failure is the one reported
                error = WeightSyncError(f"{error} (and aborting the update failed: {type(exc).__name__}: {exc})")
    error = share_from_rank0(error)
    if error is not None:
        raise error
    return share_from_rank0(report)


def verify_disk_sync(engine, cfg: JobConfig, export_dir: str, version: str) -> List[str]:
    """Rank 0, after the engine loaded ``export_dir``: compare the engine's copies of
    ``rollout.weight_sync_verify_tensors`` sampled tensors with the export's own tensors (cast to the engine's
    dtype, the cast the engine's loader makes) on every ``weight_sync_verify_interval``-th version; a mismatch
    raises ``WeightSyncError`` naming each tensor. Returns the names checked (empty: not due, or the engine
    cannot report checksums)."""
    from safetensors import safe_open

    rc = cfg.rollout
    v = _version_number(version)
    if rc.weight_sync_verify_interval <= 0 or v % rc.weight_sync_verify_interval:
        return []
    checkable = engine.checkable_weight_names()
    files = sorted(f for f in os.listdir(export_dir) if f.endswith(".safetensors"))
    where = {}
    for f in files:
        with safe_open(os.path.join(export_dir, f), framework="pt") as fh:
            for name in fh.keys():
                if name in checkable:
                    where[name] = f
    sample = _sample(sorted(where), rc.weight_sync_verify_tensors, v)
    if not sample:
        return []
    keep, dt = engine.full_precision_weight_names(), engine.weight_dtype
    expected = {}
    for name in sample:
        with safe_open(os.path.join(export_dir, where[name]), framework="pt") as fh:
            t = fh.get_tensor(name)
        expected[name] = tensor_checksum(t if (dt is None or name in keep or not t.is_floating_point()) else t.to(dt))
    _check_engine_copies(engine, expected, f"weight sync to {version!r} (disk)", "export", export_dir)
    return sample


def _check_engine_copies(engine, expected: Dict[str, str], what: str, source: str, source_text: str) -> None:
    """Compare ``{name: checksum}`` taken from ``source`` with the engine's copies; a mismatch raises
    ``WeightSyncError`` naming every tensor that differs."""
    names = sorted(expected)
    got = engine.weight_checksums(names)
    bad = [f"{n} ({source} {expected[n]}, engine {got.get(n)})" for n in names if got.get(n) != expected[n]]
    if bad:
        raise WeightSyncError(f"{what}: verification failed, the engine's copy of {len(bad)} of {len(expected)} "
                              f"sampled tensor(s) differs from {source_text}: " + "; ".join(bad))


# ------------------------------------------------------------------------------- the loop's entry points

def weights_payload(actor, cfg: JobConfig, version: str):
    """Collective: what rank 0 hands the engine for ``version`` when it is applied later (async producer) or
    from disk: the path of an HF export (mode disk), or the list of owned buckets (mode tensor, embedded
    engine: the full model on rank 0). None on the other ranks for the buckets."""
    mode = resolve_mode(cfg)
    if mode == "disk":
        out = cfg.rollout.weight_sync_dir or os.path.join(cfg.trainer.run_dir, "weight_sync")
        path = os.path.join(out, version)
        actor.export_hf(path)
        return path
    if mode != "tensor" or cfg.rollout.engine != "embedded":
        raise WeightSyncError(f"rollout.weight_sync {mode!r} with rollout.engine {cfg.rollout.engine!r} cannot be "
                              f"applied later by the async producer (use rollout.weight_sync: disk)")
    # uncast (the trainer's dtype): the engine casts on load, and tensors it keeps in higher precision than its
    # compute dtype (DeepSeek-V3's fp32 e_score_correction_bias) arrive exact; only rank 0 knows the engine
    buckets = list(stream_buckets(actor, int(cfg.rollout.weight_sync_bucket_mb * (1 << 20)), None))
    return buckets if dist.get_rank() == 0 else None


def apply_weights(engine, cfg: JobConfig, payload, version: str) -> None:
    """Rank 0: load a ``weights_payload`` into the engine and tag it ``version``."""
    engine.sync_weights(payload, version, "disk" if isinstance(payload, str) else resolve_mode(cfg))


def sync_weights(actor, engine, cfg: JobConfig, version: str, rank0: bool, producer=None,
                 corrupt=None, deferred: bool = False) -> Dict[str, float]:
    """Push the actor's current weights to the engine and tag them ``version`` (collective; an engine failure
    on rank 0 is raised on every rank). With an async ``producer`` the weights are published to it instead;
    it loads them in its own thread when the schedule needs them (a failure there surfaces at the next
    step's rollouts, on every rank). ``deferred`` must be the same on every rank (only rank 0 holds the
    producer): True in async mode after the producer started. Returns the ``weight_sync/*`` metrics."""
    mode = resolve_mode(cfg)
    if rank0 and deferred != (producer is not None):
        raise RuntimeError("sync_weights: rank 0 must hold the async producer exactly when deferred is True")
    if not deferred and mode != "disk":
        return _stream_sync(actor, engine, cfg, mode, version, rank0, corrupt).metrics()
    payload = weights_payload(actor, cfg, version)
    error = None
    report = SyncReport()
    if rank0:
        try:
            if isinstance(payload, str):
                report.bytes = sum(os.path.getsize(os.path.join(payload, f)) for f in os.listdir(payload)
                                   if f.endswith(".safetensors"))
            else:
                report.bytes, report.buckets = sum(b.nbytes for b in payload), len(payload)
            if producer is not None:
                producer.publish(parse_version(version), payload)
            else:
                apply_weights(engine, cfg, payload, version)
                if isinstance(payload, str):
                    report.checked = verify_disk_sync(engine, cfg, payload, version)
                    report.verified = bool(report.checked)
        except Exception as exc:  # noqa: BLE001 - shared below
            error = exc
    error = share_from_rank0(error)
    if error is not None:
        raise error
    return share_from_rank0(report).metrics()

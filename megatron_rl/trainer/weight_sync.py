"""Trainer -> rollout engine weight sync (``rollout.weight_sync``), collective over every trainer rank.

The mechanics behind ``weight_publisher.py`` (which chooses the mode once, from ``rollout.weight_sync`` or the engine
class's default: tensor for the embedded engine, distributed for SGLang, disk for SGLang in ``rollout.mode: async``):

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
* Verification (``weight_verify.WeightVerifier``, every ``rollout.weight_sync_verify_interval``-th version,
  in every mode, sync and async): ``rollout.weight_sync_verify_tensors`` of the ENGINE's tensors (-1: all),
  spread over the model and rotated by version, are rebuilt from the trainer's HF tensors as the engine
  holds them (fused qkv / gate_up / experts, zero-padded vocabulary rows, one shard per server TP rank:
  ``rollout.weight_layout``) and their checksums compared with the engine's (``weights_checker`` on SGLang);
  a mismatch fails the sync naming each engine tensor, its HF sources and the TP rank. Streamed: taken from
  the buckets as they pass; disk: from the export after the engine loaded it; async: by the producer after
  it applied the version (a failure surfaces at the next step's rollouts).
* Disk exports: only the versions an engine may still load or holds are kept (sync: the last one; async:
  ``RolloutProducer.versions_in_use``); older ``step-N`` exports are deleted.
* Async rollouts (``rollout.mode: async``): the producer thread applies weights later, on rank 0 alone.
  disk: the export directory is the payload; tensor (embedded engine): the buckets are collected on rank 0
  (owned copies: the full model there, as before) and applied by the producer. distributed / SGLang
  tensor need the engine's group at apply time and are rejected by config validation.

Metrics: ``weight_sync/bytes``, ``weight_sync/buckets``, ``weight_sync/verified`` (1 when verified),
``weight_sync/verified_param_frac`` (parameters inside the compared engine tensors / all parameters; in async
mode the producer verifies later, so the step's metric is 0 and a failure surfaces at the next rollouts);
the loop times the call as ``timing/weight_sync_s``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron_rl.config import JobConfig
from megatron_rl.convert.live import is_stage_leader, iter_hf_tensors
from megatron_rl.convert.mapping import param_rules
from megatron_rl.parallel.devices import recv_, send_
from megatron_rl.rollout.base import WeightSyncError
from megatron_rl.rollout.weight_buckets import DTYPE_NAMES, Bucket, bucketize
from megatron_rl.rollout.versions import parse_version
from megatron_rl.parallel.rank0 import share_from_rank0
from megatron_rl.trainer.weight_verify import WeightVerifier

__all__ = ["stream_buckets", "stream_sync", "SyncReport", "verify_export", "verify_buckets", "export_report",
           "prune_exports", "verify_disk_sync"]


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
    """The engine tensors whose checksums were compared."""
    verified_frac: float = 0.0
    """Fraction of the model's parameters (elements) inside the engine tensors compared."""

    def metrics(self) -> Dict[str, float]:
        return {"weight_sync/bytes": float(self.bytes), "weight_sync/buckets": float(self.buckets),
                "weight_sync/verified": 1.0 if self.verified else 0.0,
                "weight_sync/verified_param_frac": float(self.verified_frac)}


# ------------------------------------------------------------------------------------- bucket stream

def _send_bucket(bucket: Optional[Bucket], dst: int) -> None:
    """A later stage's leader -> ``dst``: the bucket's meta, then its host bytes (staged on the default group's
    device: NCCL takes CUDA tensors only)."""
    dist.send_object_list([None if bucket is None else bucket.meta()], dst=dst)
    if bucket is not None:
        send_(bucket.flat, dst=dst)


def _recv_bucket(src: int) -> Optional[Bucket]:
    box = [None]
    dist.recv_object_list(box, src=src)
    if box[0] is None:
        return None
    bucket = Bucket.empty(box[0])
    recv_(bucket.flat, src=src)
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


def _expected_names(actor) -> List[str]:
    return [n for r in param_rules(actor.hf_target.geometry) for n in r.hf_names]


def stream_sync(actor, engine, cfg: JobConfig, mode: str, version: str, rank0: bool,
                 corrupt=None) -> SyncReport:
    """Collective: stream buckets to rank 0's engine receiver, verify, share any error; see the module doc.
    ``corrupt(bucket)`` (tests) alters a bucket after its checksums were taken, like a fault in transit."""
    rc = cfg.rollout
    report = SyncReport()
    error: Optional[BaseException] = None
    receiver = None
    plan = None
    verifier = None
    if rank0:
        try:
            receiver = engine.begin_weight_sync(mode, version, master_address=rc.weight_sync_master_address,
                                                timeout_s=rc.weight_sync_timeout_s)
            names = _expected_names(actor)
            dt = engine.weight_dtype
            keep_names = engine.full_precision_weight_names(names)
            verifier = _verifier(actor.hf_target.geometry, engine, cfg, names, version, dt, keep_names)
            plan = (DTYPE_NAMES.get(dt), None, names, sorted(keep_names))
        except Exception as exc:  # noqa: BLE001 - shared below
            error = exc
    box = share_from_rank0((error, plan[0] if plan else None, plan[3] if plan else None))
    if box[0] is not None:
        raise box[0]
    dtype = getattr(torch, box[1]) if box[1] else None
    keep = set(box[2] or ())
    seen: Dict[str, int] = {}
    for bucket in stream_buckets(actor, int(rc.weight_sync_bucket_mb * (1 << 20)), dtype, keep):
        if not rank0 or error is not None:
            continue  # drain: the other ranks are still sending
        try:
            for name, t in bucket.tensors():
                seen[name] = seen.get(name, 0) + 1
                verifier.offer(name, t)
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
                _finish_verify(verifier, report, f"weight sync to {version!r}", "the trainer's tensors")
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


def _verifier(geometry, engine, cfg: JobConfig, names: List[str], version: str, dtype, keep) -> WeightVerifier:
    """Rank 0: the verifier of this version (samples nothing unless a verification is due)."""
    rc = cfg.rollout
    v = _version_number(version)
    due = rc.weight_sync_verify_interval > 0 and v % rc.weight_sync_verify_interval == 0
    verifier = WeightVerifier(engine, names, geometry, rc.weight_sync_verify_tensors if due else 0, v, dtype, keep)
    if due and verifier.hash is None and not _UNVERIFIABLE_SAID:
        _UNVERIFIABLE_SAID.append(True)
        print(f"[megatron-rl] WARNING: weight-sync verification skipped -- OFF for this whole run: "
              f"{type(engine).__name__}'s checksums cannot be reproduced in this process. SGLang on a GPU hashes "
              f"its tensors with its Triton kernel, which the trainer runs only with sglang importable in its own "
              f"environment and a CUDA device (SGLang in a separate venv, MEGATRON_RL_SGLANG_PYTHON, cannot be "
              f"verified); weight_sync/verified_param_frac stays 0. To verify: install sglang in the trainer's "
              f"environment on the GPU nodes", flush=True)
    return verifier


_UNVERIFIABLE_SAID: List[bool] = []  # the warning above, once per process


def _finish_verify(verifier: WeightVerifier, report: SyncReport, what: str, source_text: str) -> None:
    report.checked = verifier.check(what, source_text)
    report.verified = bool(report.checked)
    report.verified_frac = verifier.verified_frac


def verify_disk_sync(engine, cfg: JobConfig, export_dir: str, version: str) -> List[str]:
    """Rank 0, after the engine loaded ``export_dir``: compare the engine's copies of sampled engine tensors
    with the same fusion of the export's tensors (cast to the engine's dtype as its loader casts them;
    fp32-kept tensors in their own dtype) when due; a mismatch raises ``WeightSyncError`` naming each tensor.
    Returns the engine tensors checked (empty: not due, or the engine cannot report checksums)."""
    return verify_export(engine, cfg, export_dir, version).checked


def verify_export(engine, cfg: JobConfig, export_dir: str, version: str) -> SyncReport:
    from safetensors import safe_open

    from megatron_rl.convert.geometry import HFGeometry

    with open(os.path.join(export_dir, "config.json")) as fh:
        geometry = HFGeometry.from_hf_config(json.load(fh))
    files = sorted(f for f in os.listdir(export_dir) if f.endswith(".safetensors"))
    names = []
    for f in files:
        with safe_open(os.path.join(export_dir, f), framework="pt") as fh:
            names += list(fh.keys())
    verifier = _verifier(geometry, engine, cfg, names, version, engine.weight_dtype,
                         engine.full_precision_weight_names(names))
    report = SyncReport()
    if not verifier.tensors:
        return report
    for f in files:
        with safe_open(os.path.join(export_dir, f), framework="pt") as fh:
            for name in fh.keys():
                if verifier.needs(name):
                    verifier.offer(name, fh.get_tensor(name))
                else:
                    n = 1
                    for d in fh.get_slice(name).get_shape():
                        n *= int(d)
                    verifier.count(name, n)
    _finish_verify(verifier, report, f"weight sync to {version!r} (disk)", export_dir)
    return report


def verify_buckets(engine, cfg: JobConfig, actor, buckets, version: str) -> SyncReport:
    """Rank 0, after the engine applied owned ``buckets`` (async tensor mode): as ``verify_disk_sync``."""
    names = [n for b in buckets for n in b.names]
    verifier = _verifier(actor.hf_target.geometry, engine, cfg, names, version, engine.weight_dtype,
                         engine.full_precision_weight_names(names))
    report = SyncReport()
    if verifier.tensors:
        for bucket in buckets:
            for name, t in bucket.tensors():
                verifier.offer(name, t)
        _finish_verify(verifier, report, f"weight sync to {version!r}", "the trainer's tensors")
    return report


def export_report(path: str) -> SyncReport:
    """What an HF export moves: the bytes of its safetensors files."""
    return SyncReport(bytes=sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                                if f.endswith(".safetensors")))


# ------------------------------------------------------------------------------------------ disk exports

def prune_exports(out_dir: str, keep_versions: set) -> List[str]:
    """Rank 0, disk mode: delete the ``step-N`` exports in ``out_dir`` whose N is not in ``keep_versions`` (what
    an engine may still load or holds); other entries are left alone. Returns the deleted paths."""
    import shutil

    gone = []
    for entry in sorted(os.listdir(out_dir)):
        try:
            v = parse_version(entry)
        except ValueError:
            continue
        if v not in keep_versions and os.path.isdir(os.path.join(out_dir, entry)):
            shutil.rmtree(os.path.join(out_dir, entry))
            gone.append(os.path.join(out_dir, entry))
    return gone

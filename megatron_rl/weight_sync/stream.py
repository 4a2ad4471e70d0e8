"""The streamed sync (``rollout.weight_sync: tensor | distributed``), collective over every trainer rank:
``senders.stream_buckets`` brings every stage's buckets to global rank 0, which hands each to the engine's
``WeightReceiver`` and offers it to the version's ``verify.WeightVerifier`` as it passes; after the last bucket
the receiver commits (or, on any failure, drains the stream and aborts so no server serves partial weights)
and rank 0's outcome is raised on every rank. ``corrupt(bucket)`` (tests) alters a bucket after its
checksums were taken, like a fault in transit.

Delta syncs (``delta``: the rank's ``delta_sender.DeltaSender``): rank 0 picks the version to send deltas from
(``DeltaSender.base_for``: None -> whole tensors) and the HF tensors its verifier needs whole; every stage packs
``delta.DeltaBucket``s instead of buckets; the verifier is offered the whole tensors they carry and counts the
others; the report adds the elements changed."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron_rl.config import JobConfig
from megatron_rl.convert.mapping import param_rules
from megatron_rl.parallel.rank0 import share_from_rank0
from megatron_rl.rollout.base import WeightSyncError
from megatron_rl.weight_sync.buckets import DTYPE_NAMES
from megatron_rl.weight_sync.report import SyncReport
from megatron_rl.weight_sync.senders import stream_buckets
from megatron_rl.weight_sync.verify import finish_verify, verifier_for

__all__ = ["stream_sync"]


def _expected_names(actor) -> List[str]:
    return [n for r in param_rules(actor.hf_target.geometry) for n in r.hf_names]


def stream_sync(actor, engine, cfg: JobConfig, mode: str, version: str, rank0: bool,
                 corrupt=None, delta=None) -> SyncReport:
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
            verifier = verifier_for(actor.hf_target.geometry, engine, cfg, names, version, dt, keep_names)
            plan = (DTYPE_NAMES.get(dt), None, names, sorted(keep_names))
            if delta is not None:
                plan = plan + (delta.base_for(engine), sorted(n for n in names if verifier.needs(n)))
        except Exception as exc:  # noqa: BLE001 - shared below
            error = exc
    box = share_from_rank0((error, plan[0] if plan else None, plan[3] if plan else None,
                            plan[4:] if plan and delta is not None else None))
    if box[0] is not None:
        raise box[0]
    dtype = getattr(torch, box[1]) if box[1] else None
    keep = set(box[2] or ())
    bucket_bytes = int(rc.weight_sync_bucket_mb * (1 << 20))
    pack = None
    if delta is not None:
        base, checks = box[3]

        def pack(pairs):
            return delta.pack(pairs, bucket_bytes, dtype, keep, base, version, set(checks))
    seen: Dict[str, int] = {}
    for bucket in stream_buckets(actor, bucket_bytes, dtype, keep, pack):
        if not rank0 or error is not None:
            continue  # drain: the other ranks are still sending
        try:
            if delta is None:
                items = bucket.tensors()
                names_in = [n for n, _ in items]
            else:
                items = bucket.full_tensors()
                names_in = bucket.names
                for name, numel, changed in bucket.counts():
                    verifier.count(name, numel)
                    report.elements += numel
                    report.changed += changed
            for name in names_in:
                seen[name] = seen.get(name, 0) + 1
            for name, t in items:
                verifier.offer(name, t)
            if corrupt is not None:
                corrupt(bucket)
            receiver.load(bucket)
            report.bytes += bucket.nbytes if delta is None else bucket.engine_nbytes
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
                finish_verify(verifier, report, f"weight sync to {version!r}", "the trainer's tensors")
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

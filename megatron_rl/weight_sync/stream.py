"""The streamed sync (``rollout.weight_sync: tensor | distributed``) with several senders, collective over
every trainer rank.

1. Rank 0 opens the update (``mode.open``: the engine's ``WeightReceiver``) and the version's
   ``verify.WeightVerifier``, and hands every rank the receiver's ``channel()`` spec and a verifier copy.
2. Every sender (``senders.sender_ranks``: each pipeline stage's and each expert-parallel rank's shard owner)
   sends its own buckets (``senders.own_buckets``) through its own channel, in parallel with the others,
   offering each to its verifier copy as it passes; the engine loads them as they arrive.
3. Each sender posts its outcome (error, tensor names, bytes, verifier part) on the ``board.Board``; rank 0
   waits for all of them (bounded by ``rollout.weight_sync_timeout_s``; a sender never heard of is named),
   checks that every tensor came exactly once, commits -- or, on any failure, aborts on every server, so no
   server serves part of the version -- verifies, and posts the decision, which every rank raises.

Delta syncs (``delta``: the rank's ``delta_sender.DeltaSender``): rank 0 picks the version to send deltas from
(``DeltaSender.base_for``: None -> whole tensors) and the HF tensors its verifier needs whole; every sender packs
``delta.DeltaBucket``s of its own tensors instead of buckets; its verifier copy is offered the whole tensors
they carry and counts the others; the report adds the elements changed.

``corrupt(bucket)`` (tests) alters a bucket after its checksums were taken, like a fault in transit."""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from megatron_rl.convert.mapping import param_rules
from megatron_rl.convert.pieces import materialize
from megatron_rl.parallel.rank0 import share_from_rank0
from megatron_rl.weight_sync.endpoint import WeightSyncError
from megatron_rl.weight_sync.board import Board, world
from megatron_rl.weight_sync.buckets import DTYPE_NAMES
from megatron_rl.weight_sync.gather import piece_gather
from megatron_rl.weight_sync.report import SyncReport
from megatron_rl.weight_sync.senders import own_buckets, sender_ranks
from megatron_rl.weight_sync.settings import WeightSyncSettings
from megatron_rl.weight_sync.verify import finish_verify, verifier_for

__all__ = ["stream_sync", "SenderOutcome"]


def _expected_names(actor) -> List[str]:
    return [n for r in param_rules(actor.hf_target.geometry) for n in r.hf_names]


@dataclass
class SenderOutcome:
    """What one sender did in a sync (posted on the board)."""

    rank: int
    """Its global rank."""
    error: Optional[str] = None
    """What failed on it (None: every bucket was taken)."""
    names: Dict[str, int] = field(default_factory=dict)
    """HF tensor name -> times sent."""
    bytes: int = 0
    """Bytes it sent."""
    buckets: int = 0
    """Buckets it sent."""
    verify: Optional[tuple] = None
    """Its verifier copy's part (``WeightVerifier.part``); None on rank 0 (its verifier is the main one)."""
    elements: int = 0
    """Delta syncs: elements of its tensors."""
    changed: int = 0
    """Delta syncs: elements it sent as changed."""


_SEQ = [0]  # syncs so far in this process: the same count on every rank, so board keys never collide


def _shareable(exc: Optional[BaseException]) -> Optional[BaseException]:
    if exc is None:
        return None
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001 - e.g. an exception holding a socket
        return WeightSyncError(f"{type(exc).__name__}: {exc}")


def _send_own(actor, channel, verifier, bucket_bytes: int, dtype, keep, rank: int, corrupt,
              pack=None, gather=None, view=None) -> SenderOutcome:
    """Every rank: gather and send this rank's own buckets through ``channel`` (None: not a sender; it still
    takes part in the gathers). ``pack``: a delta sync's packer; ``gather``: the TP / ETP gatherer; ``view``: how
    the model is read (LoRA merged). After a failure to send, the rest of the stream is gathered but not sent; a
    failure to gather ends it (posted like any other)."""
    out = SenderOutcome(rank)
    hold = getattr(channel, "local", False) and corrupt is None  # corrupt() alters a bucket: a copy, not the model
    alloc = getattr(channel, "alloc", None)  # a channel whose own memory the buckets are packed into
    stream = own_buckets(actor, bucket_bytes, dtype, keep, pack, hold, alloc, gather, view)
    while True:
        try:
            bucket = next(stream)
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001 - a gather or pack failed: posted (rank 0 aborts the update)
            out.error = out.error or f"sender rank {rank}: gathering its tensors failed: {type(exc).__name__}: {exc}"
            break
        if channel is None or out.error is not None:
            continue
        try:
            if pack is None:
                items = bucket.tensors()
                names_in = [n for n, _ in items]
            else:
                items = bucket.full_tensors()
                names_in = bucket.names
                for name, numel, changed in bucket.counts():
                    verifier.count(name, numel)
                    out.elements += numel
                    out.changed += changed
            for name in names_in:
                out.names[name] = out.names.get(name, 0) + 1
            for name, t in items:  # a ``Pieces`` assembled only when its values are hashed
                verifier.offer(name, materialize(t) if verifier.needs(name) else t)
            if corrupt is not None:
                corrupt(bucket)
            channel.send(bucket)
            out.bytes += bucket.nbytes if pack is None else bucket.engine_nbytes
            out.buckets += 1
        except Exception as exc:  # noqa: BLE001 - posted
            out.error = f"sender rank {rank}: {type(exc).__name__}: {exc}"
        del bucket
    if channel is not None:
        try:
            channel.close()
        except Exception as exc:  # noqa: BLE001 - posted
            out.error = out.error or f"{type(exc).__name__}: {exc}"
    return out


def stream_sync(actor, engine, settings: WeightSyncSettings, version: str, rank0: bool,
                corrupt=None, delta=None) -> SyncReport:
    """Collective: every sender's buckets into the engine, verified, committed only when every sender is done;
    see the module doc."""
    timeout_s = settings.timeout_s
    rank, size = world()
    _SEQ[0] += 1
    error: Optional[BaseException] = None
    receiver = verifier = plan = None
    if rank0:
        try:
            base = delta.base_for(engine) if delta else None  # before the update session retags the servers
            receiver = settings.mode.open(engine, version, timeout_s)
            names = _expected_names(actor)
            verifier = verifier_for(actor.hf_target.geometry, engine, settings, names, version)
            dt, keep_names = verifier.dtype, verifier.keep
            plan = (DTYPE_NAMES.get(dt), sorted(keep_names), receiver.channel(), verifier.for_sender(),
                    (base, sorted(n for n in names if verifier.needs(n))) if delta else None,
                    names)
        except Exception as exc:  # noqa: BLE001 - shared below
            error = exc
            if receiver is not None:
                receiver.abort(f"{type(exc).__name__}: {exc}")
    box = share_from_rank0((_shareable(error), plan[:5] if plan else None))
    if box[0] is not None:
        raise box[0]
    dtype_name, keep, spec, copy, delta_plan = box[1]
    dtype = getattr(torch, dtype_name) if dtype_name else None
    bucket_bytes = settings.bucket_bytes
    pack = None
    if delta is not None:
        base, checks = delta_plan

        def pack(pairs):
            return delta.pack(pairs, bucket_bytes, dtype, set(keep), base, version, set(checks))
    senders = sender_ranks(actor)
    try:
        channel = spec.open(rank, senders, receiver, settings.sender_transport)
    except Exception as exc:  # noqa: BLE001 - posted: rank 0 aborts
        channel, failed = None, SenderOutcome(rank, f"sender rank {rank}: opening its channel: "
                                                     f"{type(exc).__name__}: {exc}")
    else:
        failed = None
    mine = _send_own(actor, channel, verifier if rank0 else copy, bucket_bytes, dtype, set(keep), rank, corrupt,
                     pack, piece_gather(settings.tp_gather, bucket_bytes, timeout_s), settings.view)
    if failed is not None:
        mine = failed
    if size == 1:
        outcomes, missing = {0: mine}, []
    else:
        board = Board(_SEQ[0])
        if rank in senders and not rank0:
            mine.verify = copy.part()
            board.post(rank, mine)
        if not rank0:
            error = board.decision(2 * timeout_s + 60)
            if error is not None:
                raise error
            return board_report(board)
        outcomes, missing = board.collect([s for s in senders if s != 0], timeout_s)
        outcomes[0] = mine
    report = SyncReport(senders=len(senders))
    try:
        errors = [o.error for o in outcomes.values() if o.error]
        errors += [f"sender rank {r} posted no outcome within rollout.weight_sync_timeout_s="
                   f"{timeout_s:g} s (it died or hangs)" for r in missing]
        if errors:
            raise WeightSyncError(f"weight sync to {version!r}: " + "; ".join(errors))
        seen: Dict[str, int] = {}
        for o in outcomes.values():
            report.bytes += o.bytes
            report.buckets += o.buckets
            report.elements += o.elements
            report.changed += o.changed
            report.bytes_by_sender[o.rank] = o.bytes
            for n, c in o.names.items():
                seen[n] = seen.get(n, 0) + c
            if o.verify is not None:
                verifier.merge(o.verify)
        missing_names = [n for n in plan[5] if n not in seen]
        twice = [n for n, c in seen.items() if c > 1]
        if missing_names or twice:
            raise WeightSyncError(f"weight sync to {version!r}: the trainer's senders missed {missing_names[:8]} "
                                  f"and sent twice {twice[:8]}")
        receiver.commit()
        finish_verify(verifier, report, f"weight sync to {version!r}", "the trainer's tensors")
    except Exception as exc:  # noqa: BLE001 - shared below
        error = exc
        try:
            receiver.abort(f"{type(exc).__name__}: {exc}")
        except Exception as exc2:  # noqa: BLE001 - the first failure is the one reported
            error = WeightSyncError(f"{exc} (and aborting the update failed: {type(exc2).__name__}: {exc2})")
    if size > 1:
        board.store.set(board.prefix + "report", pickle.dumps(report))
        board.decide(_shareable(error))
    if error is not None:
        raise error
    return report


def board_report(board: Board) -> SyncReport:
    """Rank 0's report of a committed sync, on every other rank (posted with the decision)."""
    return pickle.loads(board.store.get(board.prefix + "report"))

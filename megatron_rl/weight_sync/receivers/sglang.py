"""In-memory weight updates of SGLang servers (``rollout.weight_sync: tensor | distributed``): rank 0's update
session (``SGLangReceiver``) and each sender's channel to the servers.

Every update is a session on every server -- ``updating:<version>`` tag, ``/begin_weight_update``, one update
call per bucket, ``/end_weight_update``, the new version tag -- so a reply produced on partial weights never carries
a version the trainer expects; a failure tags every reachable server ``sync-failed:<version>`` and the engine
refuses to generate until a later sync succeeds. tensor: ``/update_weights_from_tensor`` with CPU tensors as
shared-memory handles (same host; torch's ``file_system`` sharing strategy, the default one kills the server);
distributed: each sender's own update group (``/init_weights_update_group``; gloo on CPU, NCCL on GPU), a bucket
broadcast there per ``/update_weights_from_distributed``. docs/weight_sync.md ("What the pinned SGLang needs")
has what was measured on SGLang 0.5.23: the checker's checksums, fp32-kept tensors, the group's store.
"""
from __future__ import annotations

import base64
import io
import json
from datetime import timedelta
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_rl.weight_sync.endpoint import WeightReceiver, WeightSyncError
from megatron_rl.weight_sync.buckets import DTYPE_NAMES
from megatron_rl.weight_sync.delta import DeltaBucket
from megatron_rl.weight_sync.server_loader import LOADER, SERVER_FLAGS
from megatron_rl.weight_sync.transport import (ChannelSpec, SenderChannel, ServerSet, drop_update_group, run_parallel,
                                               update_group)

__all__ = ["SGLangReceiver", "SGLangChannelSpec", "SGLangTensorChannel", "SGLangBroadcastChannel", "serialize_for_server",
           "checksums_by_name", "FP32_KEPT_SUFFIXES", "ServerSet", "drop_update_group"]

#: Tensors SGLang keeps in fp32 in a bf16 model (its DeepSeek MoEGate allocates the bias in fp32).
FP32_KEPT_SUFFIXES = ("e_score_correction_bias",)


def serialize_for_server(named: List) -> str:
    """``[(name, tensor)]`` as SGLang's ``MultiprocessingSerializer`` payload (base64), CPU tensors shared
    through named shared memory (``file_system`` strategy; restored afterwards)."""
    from multiprocessing.reduction import ForkingPickler

    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(named)
    finally:
        torch.multiprocessing.set_sharing_strategy(old)
    return base64.b64encode(buf.getvalue()).decode()


class SGLangTensorChannel(SenderChannel):
    """A sender's ``/update_weights_from_tensor`` per bucket to every server (servers on the sender's host)."""

    def __init__(self, servers: ServerSet, timeout_s: float):
        self.servers, self.timeout_s = servers, timeout_s

    def send(self, bucket) -> None:
        """A ``Bucket`` (SGLang's own loader), or a ``delta.DeltaBucket``: its meta (JSON) and the bytes the engine
        needs, for our loader in the server (``server_loader.py``: ``load_format`` names it)."""
        request = {"flush_cache": True}
        if isinstance(bucket, DeltaBucket):
            payload = serialize_for_server([(json.dumps(bucket.engine_meta()), bucket.flat[:bucket.engine_nbytes])])
            request["load_format"] = LOADER
        else:
            payload = serialize_for_server(bucket.tensors())
        try:
            _each(self.servers, lambda u, n: self.servers.post_ok(
                u, "/update_weights_from_tensor", {"serialized_named_tensors": [payload] * n, **request},
                self.timeout_s), _label(bucket))
        except WeightSyncError as exc:
            if "load_format" in request and "load_format" in str(exc):
                raise WeightSyncError(f"{exc} -- a delta sync needs the servers started with "
                                      f"{' '.join(SERVER_FLAGS)}") from exc
            raise


class SGLangBroadcastChannel(SenderChannel):
    """A sender's ``/update_weights_from_distributed`` per bucket, the bytes broadcast in the sender's own
    ``UpdateGroup`` with every server (set up on first use and kept; dropped when a bucket fails)."""

    def __init__(self, servers: ServerSet, timeout_s: float, backend: str, master_address: Optional[str]):
        self.servers, self.timeout_s = servers, timeout_s
        self.group = update_group(servers, master_address, timeout_s, backend)

    def send(self, bucket) -> None:
        if isinstance(bucket, DeltaBucket):
            raise WeightSyncError("a delta sync cannot go through /update_weights_from_distributed (SGLang loads "
                                  "whole tensors there): use rollout.weight_sync: tensor")
        meta = {"names": list(bucket.names), "dtypes": [DTYPE_NAMES[bucket.dtype]] * len(bucket.names),
                "shapes": [list(s) for s in bucket.shapes], "group_name": self.group.name,
                "load_format": "flattened_bucket", "flush_cache": True}
        flat = bucket.flat.to(self.group.device)
        work = dist.broadcast(flat, src=0, group=self.group.pg, async_op=True)
        urls = self.servers.urls
        results = run_parallel([lambda u=u: self.servers.post_ok(u, "/update_weights_from_distributed", meta,
                                                                 self.timeout_s) for u in urls])
        errors = [f"{u}: {r}" for u, r in zip(urls, results) if isinstance(r, BaseException)]
        if not errors:  # every server received: the broadcast is complete; else do not wait on a dead peer
            try:
                work.wait(timedelta(seconds=self.timeout_s))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"trainer broadcast: {exc}")
        if errors:
            drop_update_group(urls)  # a broken group is rebuilt by the next sync
            raise WeightSyncError(f"{_label(bucket)}: " + "; ".join(errors))


@dataclass(frozen=True)
class SGLangChannelSpec(ChannelSpec):
    """How every sender reaches the servers: ``/update_weights_from_tensor`` (``backend`` None) or its own
    update group (``backend`` gloo / nccl)."""

    servers: ServerSet
    """The servers."""
    timeout_s: float
    """Bound of each request and broadcast."""
    backend: Optional[str] = None
    """The update groups' backend; None: tensors through shared memory."""
    master_address: Optional[str] = None
    """The address the servers reach global rank 0 at (other senders find theirs: ``master_address_for``)."""

    def open(self, rank: int, senders: List[int], receiver=None, transport: str = "gloo") -> Optional[SenderChannel]:
        if rank not in senders:  # ``transport``: unused (each sender reaches the servers itself)
            return None
        if self.backend is None:
            return SGLangTensorChannel(self.servers, self.timeout_s)
        return SGLangBroadcastChannel(self.servers, self.timeout_s, self.backend,
                                      self.master_address if rank == 0 else None)


def _label(bucket) -> str:
    """A bucket in an error message (a delta bucket may carry no tensor when none changed)."""
    names = list(bucket.names)
    return f"bucket of {len(names)} tensor(s)" + (f" {names[0]} .. {names[-1]}" if names else "")


def _each(servers: ServerSet, fn: Callable[[str, int], Any], what: str) -> None:
    """``fn(url, tp_size)`` on every server at once; every failure raised together."""
    results = run_parallel([lambda u=u, n=n: fn(u, n) for u, n in zip(servers.urls, servers.tp_sizes)])
    errors = [f"{u}: {r}" for u, r in zip(servers.urls, results) if isinstance(r, BaseException)]
    if errors:
        raise WeightSyncError(f"{what}: " + "; ".join(errors))


class SGLangReceiver(WeightReceiver):
    """One update session on every server (rank 0): begin, the senders' buckets, then commit or abort on every
    server. ``backend`` as in ``SGLangChannelSpec``."""

    def __init__(self, engine, version: str, timeout_s: float, backend: Optional[str] = None,
                 master_address: Optional[str] = None):
        self.engine = engine
        self.version = version
        self.timeout_s = timeout_s
        self.spec = SGLangChannelSpec(engine.server_set(), timeout_s, backend, master_address)
        self._local: Optional[SenderChannel] = None
        self.opened: List[str] = []
        try:
            for url in engine.urls:
                engine._post_ok(url, "/update_weight_version",
                                {"new_version": f"updating:{version}", "abort_all_requests": False}, timeout_s)
                engine._post_ok(url, "/begin_weight_update", {}, timeout_s)
                self.opened.append(url)
        except Exception:
            self.abort("could not open the update session")
            raise

    def channel(self) -> SGLangChannelSpec:
        return self.spec

    def load(self, bucket) -> None:
        """Rank 0 as the one sender (buckets it owns)."""
        if self._local is None:
            self._local = self.spec.open(0, [0])
        try:
            self._local.send(bucket)
        except WeightSyncError as exc:
            raise WeightSyncError(f"weight sync to {self.version!r}, {exc}") from exc

    def commit(self) -> None:
        what = f"weight sync to {self.version!r}"
        post = self.engine._post_ok
        _each(self.spec.servers, lambda u, n: post(u, "/end_weight_update", {}, self.timeout_s), what)
        self.opened = []
        _each(self.spec.servers, lambda u, n: post(u, "/update_weight_version",
                                                    {"new_version": self.version, "abort_all_requests": False},
                                                    self.timeout_s), what)
        self.engine._check_versions(self.version)

    def abort(self, reason: str) -> None:
        self.engine.invalidate_weights(f"weight sync to {self.version!r} failed: {reason}")
        for url in self.engine.urls:
            try:
                if url in self.opened:
                    self.engine._post_ok(url, "/end_weight_update", {}, 30)
                self.engine._post_ok(url, "/update_weight_version",
                                     {"new_version": f"sync-failed:{self.version}", "abort_all_requests": True}, 30)
            except Exception:  # noqa: BLE001 - a dead server serves nothing
                pass
        self.opened = []


def checksums_by_name(reply: Dict, url: str) -> Dict[str, tuple]:
    """``/weights_checker`` reply -> ``{name: (TP rank 0's checksum, rank 1's, ...)}``: ranks of the first data-
    parallel replica, pipeline stages merged; a rank without its placement, or a TP rank missing, raises."""
    ranks = reply.get("ranks") if isinstance(reply, dict) else None
    if not isinstance(reply, dict) or not reply.get("success") or not isinstance(ranks, list) or not ranks:
        raise WeightSyncError(f"{url}/weights_checker: no checksums ({str(reply)[:300]})")
    by_tp: Dict[int, Dict[str, str]] = {}
    tp_size = 1
    for i, r in enumerate(ranks):
        info = r.get("parallelism_info") if isinstance(r, dict) else None
        if isinstance(info, list):  # one entry per model role; the served model is "target"
            info = next((x for x in info if isinstance(x, dict) and x.get("role", "target") == "target"), None)
        if not isinstance(info, dict) and len(ranks) > 1:
            raise WeightSyncError(f"{url}/weights_checker: ranks[{i}] has no parallelism_info (its TP rank)")
        info = info or {}
        if int(info.get("dp_rank") or 0) != 0:
            continue
        tp_size = int(info.get("tp_size") or 1)
        by_tp.setdefault(int(info.get("tp_rank") or 0), {}).update(r["checksums"])
    if sorted(by_tp) != list(range(tp_size)):
        raise WeightSyncError(f"{url}/weights_checker: TP ranks {sorted(by_tp)} reported, expected 0..{tp_size - 1}")
    names = set().union(*by_tp.values())
    return {n: tuple(by_tp[r].get(n) for r in range(tp_size)) for n in names}

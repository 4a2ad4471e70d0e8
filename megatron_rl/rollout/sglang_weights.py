"""In-memory weight updates of SGLang servers (``rollout.weight_sync: tensor | distributed``), measured on
the pinned SGLang (0.5.23, CPU server):

* Every in-memory update is a session: ``/begin_weight_update`` -> one update call per bucket ->
  ``/end_weight_update`` (an update outside a session is refused). The session first tags the server
  ``updating:<version>`` (``/update_weight_version``), so a reply produced on partial weights never carries a
  version the trainer expects; the new version is set only after ``/end_weight_update`` on every server.
* tensor: ``/update_weights_from_tensor`` with ``serialized_named_tensors`` = one base64 ForkingPickler
  payload per server TP rank. CPU tensors travel as shared-memory handles, so the server must be on the
  same host, and torch's ``file_system`` sharing strategy is required (the default ``file_descriptor``
  one hands out fds through a socket whose authkey the server rejects — and the server process dies).
  Rejected for data-parallel servers by SGLang itself.
* distributed: ``/init_weights_update_group`` (master = trainer rank 0, which is rank 0 of the group; each
  server's TP ranks follow at ``rank_offset``; backend gloo works on the CPU server, NCCL on GPU) once per
  engine; per bucket ``/update_weights_from_distributed`` with ``load_format: flattened_bucket`` while rank 0
  broadcasts the bucket's bytes in the group — one broadcast reaches every server.
* Verification reads ``/weights_checker`` (``action: checksum``): sha256 checksums of the server's own
  tensors by SGLang name, one entry per scheduler rank (``parallelism_info.tp_rank``: each TP rank reports
  its shard). ``checksums_by_name`` turns that into ``{name: (rank 0's checksum, rank 1's, ...)}``; the
  trainer builds the same fused / padded / sharded tensors (``weight_layout.sglang_layout``) to compare.
  ``/get_weights_by_name`` is not implemented for Qwen2 in this version.
* fp32-kept tensors (``FP32_KEPT_SUFFIXES``): DeepSeek-V3's ``e_score_correction_bias`` is an fp32 parameter
  of SGLang's bf16 model; it is sent and compared in fp32.
* The update group's store is the trainer's own ``TCPStore(is_master=True)`` (never torch's rendezvous,
  which makes a client of the launcher's agent store under ``TORCHELASTIC_USE_AGENT_STORE=True``), at the
  address of this host's interface that routes to the servers (``master_address_for``).
* Failure (any server): every reachable server is tagged ``sync-failed:<version>`` and the engine refuses
  to generate until a later sync succeeds — no server is left serving a mix of versions as a valid one.
"""
from __future__ import annotations

import base64
import io
import ipaddress
import socket
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

from megatron_rl.parallel.devices import collective_device
from megatron_rl.rollout.base import WeightReceiver, WeightSyncError
from megatron_rl.rollout.sglang_server import find_free_port
from megatron_rl.rollout.weight_buckets import DTYPE_NAMES

__all__ = ["SGLangTensorReceiver", "SGLangDistributedReceiver", "UpdateGroup", "serialize_for_server",
           "master_address_for", "checksums_by_name", "FP32_KEPT_SUFFIXES"]

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


def _url_host_port(url: str) -> tuple:
    from urllib.parse import urlsplit

    parts = urlsplit(url if "://" in url else "http://" + url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def master_address_for(urls: List[str], configured: str | None) -> str:
    """The address servers use to reach trainer rank 0: ``configured``, else the address of this host's
    interface that routes to the servers (a UDP ``connect`` sends nothing; the kernel picks the source
    address): 127.0.0.1 for servers on loopback, never a loopback alias such as Debian's 127.0.1.1 for a
    remote server. Servers reached through different interfaces raise ``WeightSyncError`` (set
    ``rollout.weight_sync_master_address``)."""
    if configured:
        return configured
    found = {}
    for url in urls:
        host, port = _url_host_port(url)
        try:
            family, _, _, _, addr = socket.getaddrinfo(host, port, 0, socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr[:2])
                mine = s.getsockname()[0]
        except OSError as exc:
            raise WeightSyncError(f"master address: no route from this host to the SGLang server {url} ({exc}); "
                                  "set rollout.weight_sync_master_address") from exc
        remote = not ipaddress.ip_address(addr[0]).is_loopback
        if remote and ipaddress.ip_address(mine).is_loopback:
            raise WeightSyncError(f"master address: the route to {url} leaves through loopback address {mine}, "
                                  "which the server cannot reach; set rollout.weight_sync_master_address")
        found[url] = mine
    addrs = set(found.values())
    if len(addrs) != 1:
        raise WeightSyncError(f"master address: the servers are reached through different local addresses "
                              f"{found}; set rollout.weight_sync_master_address")
    return addrs.pop()


def _parallel(fns: List[Callable[[], Any]]) -> List[Any]:
    """Run ``fns`` in threads; return their results (an exception is returned in place of a result)."""
    out: List[Any] = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed back
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class UpdateGroup:
    """Rank 0's process group with the servers' TP ranks (``/init_weights_update_group``)."""

    def __init__(self, engine, master_address: str, timeout_s: float, backend: str):
        self.engine = engine
        self.store = None  # the trainer's TCPStore (master) of the group
        self.name = f"megatron_rl_weight_sync_{find_free_port()}"
        sizes = [engine.server_tp_size(u) for u in engine.urls]
        self.world = 1 + sum(sizes)
        port = find_free_port()
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]

        def init(url, offset):
            return engine._post_ok(url, "/init_weights_update_group", {
                "master_address": master_address, "master_port": port, "rank_offset": offset,
                "world_size": self.world, "group_name": self.name, "backend": backend}, timeout_s)

        def own():
            from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

            # the trainer serves this store itself: rendezvous("tcp://") would connect to the launcher's
            # agent store instead under TORCHELASTIC_USE_AGENT_STORE=True (torchrun), which nobody serves here
            store = dist.TCPStore(master_address, port, self.world, is_master=True,
                                  timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
            self.store = store
            store = PrefixStore(self.name, store)
            pg, _ = _new_process_group_helper(self.world, 0, [], Backend(backend), store, group_name=self.name,
                                              backend_options=None, timeout=timedelta(seconds=timeout_s))
            _world.pg_group_ranks[pg] = {i: i for i in range(self.world)}
            return pg

        results = _parallel([own] + [lambda u=u, o=o: init(u, o) for u, o in zip(engine.urls, offsets)])
        errors = [f"{u}: {r}" for u, r in zip(engine.urls, results[1:]) if isinstance(r, BaseException)]
        if isinstance(results[0], BaseException):
            errors.insert(0, f"trainer rank 0 ({master_address}:{port}): {results[0]}")
        if errors:
            raise WeightSyncError(f"weight-update group {self.name!r} ({backend}, world {self.world}) could not be "
                                  "set up: " + "; ".join(errors))
        self.pg = results[0]
        self.device = collective_device(self.pg)  # the one owner of "which device for this backend"

    def close(self) -> None:
        for url in self.engine.urls:
            try:
                self.engine._post_ok(url, "/destroy_weights_update_group", {"group_name": self.name}, 30)
            except Exception:  # noqa: BLE001 - best effort (the server may be gone)
                pass
        self.pg = None  # not destroyed: a broadcast to a dead server may still hold it (gloo times it out)
        self.store = None


class _SessionReceiver(WeightReceiver):
    """Shared session logic: begin on every server, commit / abort on every server."""

    def __init__(self, engine, version: str, timeout_s: float):
        self.engine = engine
        self.version = version
        self.timeout_s = timeout_s
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

    def _each(self, fn: Callable[[str], Any]) -> None:
        results = _parallel([lambda u=u: fn(u) for u in self.engine.urls])
        errors = [f"{u}: {r}" for u, r in zip(self.engine.urls, results) if isinstance(r, BaseException)]
        if errors:
            raise WeightSyncError(f"weight sync to {self.version!r}: " + "; ".join(errors))

    def commit(self) -> None:
        self._each(lambda u: self.engine._post_ok(u, "/end_weight_update", {}, self.timeout_s))
        self.opened = []
        self._each(lambda u: self.engine._post_ok(u, "/update_weight_version",
                                                  {"new_version": self.version, "abort_all_requests": False},
                                                  self.timeout_s))
        self.engine._check_versions(self.version)

    def abort(self, reason: str) -> None:
        self.engine._mark_invalid(f"weight sync to {self.version!r} failed: {reason}")
        for url in self.engine.urls:
            try:
                if url in self.opened:
                    self.engine._post_ok(url, "/end_weight_update", {}, 30)
                self.engine._post_ok(url, "/update_weight_version",
                                     {"new_version": f"sync-failed:{self.version}", "abort_all_requests": True}, 30)
            except Exception:  # noqa: BLE001 - a dead server serves nothing
                pass
        self.opened = []


class SGLangTensorReceiver(_SessionReceiver):
    """``/update_weights_from_tensor`` per bucket (servers on this host)."""

    def load(self, bucket) -> None:
        payload = serialize_for_server(bucket.tensors())

        def send(url):
            n = self.engine.server_tp_size(url)
            self.engine._post_ok(url, "/update_weights_from_tensor",
                                 {"serialized_named_tensors": [payload] * n, "flush_cache": True}, self.timeout_s)

        self._each(send)


class SGLangDistributedReceiver(_SessionReceiver):
    """``/update_weights_from_distributed`` per bucket, the bytes broadcast in the ``UpdateGroup``."""

    def __init__(self, engine, version: str, timeout_s: float, group: UpdateGroup):
        super().__init__(engine, version, timeout_s)
        self.group = group

    def load(self, bucket) -> None:
        meta = {"names": list(bucket.names), "dtypes": [DTYPE_NAMES[bucket.dtype]] * len(bucket.names),
                "shapes": [list(s) for s in bucket.shapes], "group_name": self.group.name,
                "load_format": "flattened_bucket", "flush_cache": True}
        flat = bucket.flat.to(self.group.device)
        work = dist.broadcast(flat, src=0, group=self.group.pg, async_op=True)
        results = _parallel([lambda u=u: self.engine._post_ok(u, "/update_weights_from_distributed", meta,
                                                              self.timeout_s) for u in self.engine.urls])
        errors = [f"{u}: {r}" for u, r in zip(self.engine.urls, results) if isinstance(r, BaseException)]
        if not errors:  # every server received: the broadcast is complete; else do not wait on a dead peer
            try:
                work.wait(timedelta(seconds=self.timeout_s))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"trainer broadcast: {exc}")
        if errors:
            self.engine._drop_group()  # a broken group is rebuilt by the next sync
            raise WeightSyncError(f"weight sync to {self.version!r}, bucket of {len(bucket.names)} tensor(s) "
                                  f"{bucket.names[0]} .. {bucket.names[-1]}: " + "; ".join(errors))


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

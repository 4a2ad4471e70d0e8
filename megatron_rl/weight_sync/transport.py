"""Transport: how a bucket's bytes move between processes.

* Between trainer ranks: ``send_bucket`` / ``recv_bucket`` (a later pipeline stage's leader -> global rank 0): the
  bucket's meta as an object (a ``Bucket``'s or a ``delta.DeltaBucket``'s), then its bytes, staged on the default group's device (NCCL takes CUDA tensors only).
* Trainer -> SGLang servers: ``UpdateGroup``, a process group of trainer rank 0 with every server's TP ranks
  (``/init_weights_update_group``), in which rank 0 broadcasts each bucket; ``master_address_for`` picks the
  address the servers reach rank 0 at. What the pinned SGLang needs of it: ``receivers/sglang.py``.
* ``run_parallel``: one call per server in threads (each server's HTTP request of a step at once).
"""
from __future__ import annotations

import ipaddress
import socket
import threading
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch.distributed as dist

from megatron_rl.parallel.devices import collective_device, recv_, send_
from megatron_rl.rollout.base import WeightSyncError
from megatron_rl.rollout.sglang_server import find_free_port
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.delta import DeltaBucket

__all__ = ["send_bucket", "recv_bucket", "UpdateGroup", "master_address_for", "run_parallel"]


def send_bucket(bucket: Optional[Bucket], dst: int) -> None:
    """A later stage's leader -> ``dst``: the bucket's meta, then its host bytes (staged on the default group's
    device: NCCL takes CUDA tensors only)."""
    dist.send_object_list([None if bucket is None else bucket.meta()], dst=dst)
    if bucket is not None:
        send_(bucket.flat, dst=dst)


def recv_bucket(src: int) -> Optional[Bucket]:
    box = [None]
    dist.recv_object_list(box, src=src)
    if box[0] is None:
        return None
    bucket = (DeltaBucket if box[0].get("format") == "delta" else Bucket).empty(box[0])
    recv_(bucket.flat, src=src)
    return bucket



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


def run_parallel(fns: List[Callable[[], Any]]) -> List[Any]:
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

        results = run_parallel([own] + [lambda u=u, o=o: init(u, o) for u, o in zip(engine.urls, offsets)])
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



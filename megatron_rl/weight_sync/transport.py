"""Transport: how a bucket's bytes move from a sender to an engine.

* Channels (``ChannelSpec`` -> ``SenderChannel``): rank 0's receiver hands every rank a picklable spec; each
  sender opens its own channel from it and ``send``s its buckets. The embedded engine's spec (rank 0's process)
  lives in ``in_process.py``, the SGLang specs in ``receivers/sglang.py``.
* Between trainer ranks: ``send_bucket`` / ``recv_bucket``: the bucket's meta as an object (a ``Bucket``'s or a
  ``delta.DeltaBucket``'s), then its bytes -- on the default group staged on its device (NCCL takes CUDA tensors
  only; async rollouts' owned buckets), on a gloo pair group as host bytes.
* Trainer -> SGLang servers: ``ServerSet`` (the servers as any rank reaches them), ``UpdateGroups`` (the
  distributed mode's request to an engine: each sender in its own group) and ``UpdateGroup``, a sender's
  process group with every server's TP ranks (``/init_weights_update_group``), one per sender and process
  (``update_group``), in which it broadcasts its buckets; ``master_address_for`` picks the address the servers
  reach that process at. What the pinned SGLang needs of it: ``receivers/sglang.py``.
* ``run_parallel``: one call per server in threads (each server's HTTP request of a step at once).
"""
from __future__ import annotations

import ipaddress
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron_rl.parallel.devices import collective_device, recv_, send_
from megatron_rl.weight_sync.endpoint import WeightSyncError
from megatron_rl.parallel.ports import find_free_port
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.delta import DeltaBucket

__all__ = ["send_bucket", "recv_bucket", "recv_bucket_bytes", "pair_groups", "SenderChannel", "ChannelSpec", "UpdateGroups", "ServerSet", "UpdateGroup", "update_group", "drop_update_group",
           "master_address_for", "run_parallel"]


def send_bucket(bucket: Optional[Bucket], dst: int, group=None) -> None:
    """-> global rank ``dst``: the bucket's meta (None: the end of this sender's stream), then its host bytes.
    Default group: staged on its device (NCCL takes CUDA tensors only); ``group``: a gloo group, host bytes."""
    dist.send_object_list([None if bucket is None else bucket.meta()], dst=dst, group=group)
    if bucket is not None:
        if group is None:
            send_(bucket.flat, dst=dst)
        else:
            dist.send(bucket.flat, dst=dst, group=group)


def recv_bucket(src: int, group=None, into=None) -> Optional[Bucket]:
    """The next bucket from global rank ``src`` (None: its stream ended); ``group`` as in ``send_bucket``.
    ``into``: a uint8 host buffer the caller is done with, received into when a (non-delta) bucket fits."""
    box = [None]
    dist.recv_object_list(box, src=src, group=group)
    return None if box[0] is None else recv_bucket_bytes(box[0], src, group, into)


def recv_bucket_bytes(meta: dict, src: int, group=None, into=None):
    """The bucket whose ``meta`` came from ``src``: its bytes, received (``recv_bucket``'s second half)."""
    delta = meta.get("format") == "delta"
    if not delta and group is not None and into is not None and int(meta["nbytes"]) <= into.numel():
        bucket = Bucket.empty(meta, buffer=into)
    else:
        bucket = (DeltaBucket if delta else Bucket).empty(meta)
    if group is None:
        recv_(bucket.flat, src=src)
    else:
        dist.recv(bucket.flat, src=src, group=group)
    return bucket


_PAIR_GROUPS: Dict[tuple, Any] = {}


def pair_groups(senders: List[int], timeout_s: float) -> Dict[int, Any]:
    """Collective over every trainer rank (same ``senders`` everywhere; created once per process): a gloo group
    ``[0, s]`` per sender ``s`` other than rank 0, so rank 0 receives from every sender at once, each in its own
    thread, and no sender's transfer waits behind another's; bounded by ``timeout_s``."""
    key = tuple(senders)
    if key not in _PAIR_GROUPS:
        _PAIR_GROUPS[key] = {s: dist.new_group([0, s], backend="gloo", timeout=timedelta(seconds=timeout_s))
                             for s in senders if s != 0}
    return _PAIR_GROUPS[key]


class SenderChannel:
    """One sender's end of a sync: ``send`` each of its buckets, then ``close`` (which raises what went wrong)."""

    def send(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """After the sender's last bucket."""


class ChannelSpec:
    """How senders reach an engine: made by rank 0's receiver (``WeightReceiver.channel``), handed to every
    rank (picklable) and opened there."""

    def open(self, rank: int, senders: List[int], receiver=None, transport: str = "gloo") -> Optional[SenderChannel]:
        """Every rank, collectively (same ``senders`` everywhere): this rank's channel (None when it is not a
        sender). ``receiver``: rank 0's ``WeightReceiver``, None elsewhere. ``transport``: the job's
        ``WeightSyncSettings.sender_transport`` (how senders on rank 0's host reach a receiver in rank 0's process)."""
        raise NotImplementedError


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


@dataclass(frozen=True)
class UpdateGroups:
    """Each sender reaches the engine through its own update group with every server rank (``UpdateGroup``):
    what an engine's ``begin_weight_sync`` is given for ``rollout.weight_sync: distributed``."""

    backend: str
    """The groups' backend: "nccl" (GPU) or "gloo" (CPU)."""
    master_address: Optional[str] = None
    """Where the servers reach trainer rank 0 (None: ``master_address_for`` finds the route)."""


@dataclass(frozen=True)
class ServerSet:
    """The SGLang servers of an engine as any trainer rank reaches them (picklable: rank 0 hands it to every
    sender)."""

    urls: Tuple[str, ...]
    """Base URL of each server."""
    tp_sizes: Tuple[int, ...]
    """Tensor-parallel size of each server (its ranks in an update group)."""

    def post_ok(self, url: str, path: str, payload: dict, timeout: float) -> dict:
        """POST once (no retry: an update must not be applied twice); raise WeightSyncError unless success."""
        import requests

        try:
            resp = requests.post(url + path, json=payload, timeout=timeout)
            reply = resp.json() if resp.content else {}
        except Exception as exc:  # noqa: BLE001 - connection refused / reset, timeout, not JSON
            raise WeightSyncError(f"{url}{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400 or (isinstance(reply, dict) and reply.get("success") is False):
            msg = reply.get("message") if isinstance(reply, dict) else reply
            raise WeightSyncError(f"{url}{path} refused (HTTP {resp.status_code}): {str(msg)[:400]}")
        return reply


class UpdateGroup:
    """A sender's process group with every server's TP ranks (``/init_weights_update_group``): the sender is
    rank 0 of it and broadcasts its buckets there; each sender has its own group (its own name)."""

    def __init__(self, servers: ServerSet, master_address: str, timeout_s: float, backend: str):
        self.servers = servers
        self.store = None  # the trainer's TCPStore (master) of the group
        self.name = f"megatron_rl_weight_sync_{find_free_port()}"
        sizes = list(servers.tp_sizes)
        self.world = 1 + sum(sizes)
        port = find_free_port()
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]

        def init(url, offset):
            return servers.post_ok(url, "/init_weights_update_group", {
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

        results = run_parallel([own] + [lambda u=u, o=o: init(u, o) for u, o in zip(servers.urls, offsets)])
        errors = [f"{u}: {r}" for u, r in zip(servers.urls, results[1:]) if isinstance(r, BaseException)]
        if isinstance(results[0], BaseException):
            errors.insert(0, f"trainer ({master_address}:{port}): {results[0]}")
        if errors:
            raise WeightSyncError(f"weight-update group {self.name!r} ({backend}, world {self.world}) could not be "
                                  "set up: " + "; ".join(errors))
        self.pg = results[0]
        self.device = collective_device(self.pg)  # the one owner of "which device for this backend"

    def close(self) -> None:
        for url in self.servers.urls:
            try:
                self.servers.post_ok(url, "/destroy_weights_update_group", {"group_name": self.name}, 30)
            except Exception:  # noqa: BLE001 - best effort (the server may be gone)
                pass
        self.pg = None  # not destroyed: a broadcast to a dead server may still hold it (gloo times it out)
        self.store = None


_UPDATE_GROUPS: Dict[tuple, UpdateGroup] = {}


def update_group(servers: ServerSet, master_address: Optional[str], timeout_s: float, backend: str) -> UpdateGroup:
    """This process's update group with ``servers`` (set up on first use, then kept; ``master_address``: the
    address the servers reach this process at, None: found by ``master_address_for``)."""
    key = (servers.urls, backend)
    if key not in _UPDATE_GROUPS:
        _UPDATE_GROUPS[key] = UpdateGroup(servers, master_address_for(list(servers.urls), master_address),
                                          timeout_s, backend)
    return _UPDATE_GROUPS[key]


def drop_update_group(urls) -> None:
    """Close this process's update groups with the servers ``urls`` (a broken group is rebuilt by the next sync)."""
    for key in [k for k in _UPDATE_GROUPS if k[0] == tuple(urls)]:
        _UPDATE_GROUPS.pop(key).close()

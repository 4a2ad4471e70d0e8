"""Which ranks' shared memory a reader can map: asked once, collectively, by mapping a probe of each rank.

A host name says too little: ranks in other containers or pid namespaces of the same host, or a kernel / security
policy that refuses ``/proc/<pid>/fd`` of another process, cannot map a peer's segment. The one rule: a transport
uses shared memory only between ranks whose probe the reader actually mapped and read back; the others keep gloo.
"""
from __future__ import annotations

import secrets
import socket
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_rl.weight_sync import shm

__all__ = ["unreachable", "host_id"]


def host_id() -> str:
    """This host's name and boot (two ranks with the same are on one host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _probe(spec) -> Optional[str]:
    path, key, token = spec
    try:
        seg = shm.Segment.attach(path, key, len(token))
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    if bytes(seg.tensor[:len(token)].tolist()) != token:
        return f"{path} holds other bytes than its writer's probe"
    return None


def unreachable(reader: int, group=None) -> Dict[int, str]:
    """Collective over ``group`` (None: every rank): the group ranks whose segments group rank ``reader`` cannot
    map, each with why (same-host ranks only are tried; every rank gets the same answer)."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    token, seg, spec = secrets.token_bytes(16), None, "no anonymous shared memory on this host"
    if shm.available():
        try:  # memfd_create may be refused (seccomp): this rank then keeps gloo, the collective goes on
            seg = shm.Segment.create("probe", len(token))
            seg.tensor[:len(token)].copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
            spec = (seg.path, seg.key, token)
        except OSError as exc:
            spec = f"its shared memory cannot be created ({type(exc).__name__}: {exc})"
    specs = [None] * size
    dist.all_gather_object(specs, (host_id(), spec), group=group)
    box = [None]
    if me == reader:
        host = specs[reader][0]
        why = {}
        for r, (h, spec) in enumerate(specs):
            if r == reader:
                continue
            if h != host:
                why[r] = "on another host"
            elif isinstance(spec, str):
                why[r] = spec
            elif not shm.available():
                why[r] = "no anonymous shared memory on the reader's host"
            else:
                err = _probe(spec)
                if err is not None:
                    why[r] = f"on the same host, but its shared memory cannot be mapped ({err})"
        box[0] = why
    src = reader if group is None else dist.get_global_rank(group, reader)
    dist.broadcast_object_list(box, src=src, group=group)  # the writers' probes live until the reader is done
    if seg is not None:
        seg.close()
    return box[0]

"""Where a collective's tensor lives: on the device its process group's backend needs.

The rule, owned here and nowhere else: a tensor handed to a collective is on the device type the group's
backend takes — CUDA for NCCL (an NCCL group has no CPU backend: "No backend type associated with device
type cpu"), the CPU for gloo (gloo could copy CUDA tensors itself; the project does not rely on it), the
backend's registered device for any other backend (``torch.distributed.Backend.register_backend(...,
devices=[...])``). A group made from a ``"cpu:gloo,cuda:nccl"`` spec takes both.

Callers keep their tensors where the math needs them (the actor's device, or the host for small flags
built from Python values) and issue collectives through the wrappers below: a tensor already on a device the
backend takes is used in place; any other tensor is staged on :func:`collective_device` and the result is
copied back, so the caller's tensor and its device are unchanged.

* ``collective_device(group)`` — the device a tensor for ``group`` is staged on;
* ``all_reduce_(t, op, group)``, ``broadcast_(t, src, group)``, ``send_(t, dst, group)``,
  ``recv_(t, src, group)`` — in place on ``t`` (returned), any device.

Object collectives (``broadcast_object_list``, ``all_gather_object``, ``send_object_list``) stay torch's:
torch stages their bytes on the group's device itself.
"""
from __future__ import annotations

from typing import FrozenSet, Optional

import torch
import torch.distributed as dist

__all__ = ["backend_device_types", "collective_device", "all_reduce_", "broadcast_", "send_", "recv_"]


def backend_device_types(group: Optional[dist.ProcessGroup] = None) -> FrozenSet[str]:
    """The device types whose tensors ``group``'s backend takes (the rule in the module docstring)."""
    spec = str(dist.get_backend(group))
    if ":" in spec:  # "cpu:gloo,cuda:nccl": one backend per device type
        return frozenset(pair.split(":")[0].strip() for pair in spec.split(","))
    caps = list(dist.Backend.backend_capability.get(spec.lower(), []))
    if not caps:
        raise RuntimeError(f"collective_device: process group backend {spec!r} declares no device "
                           f"(torch.distributed.Backend.backend_capability)")
    return frozenset(["cpu"] if "cpu" in caps else caps[:1])


def _current_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type, None)  # torch.cuda, or a registered accelerator's module
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(device_type, int(index))


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device a tensor for a collective over ``group`` (None: the default group) is staged on: the CPU
    when the backend takes CPU tensors, else the current device of the backend's accelerator."""
    types = backend_device_types(group)
    return _current_device("cpu" if "cpu" in types else sorted(types)[0])


def _staged(t: torch.Tensor, group, copy: bool = True) -> torch.Tensor:
    """``t`` itself when the backend of ``group`` takes it as it is, else a staging tensor on the backend's
    device (holding ``t``'s values when ``copy``)."""
    if t.device.type in backend_device_types(group) and t.is_contiguous():
        return t
    device = collective_device(group)
    return t.to(device, copy=True).contiguous() if copy else torch.empty(t.shape, dtype=t.dtype, device=device)


def _back(t: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    if buf is not t:
        t.copy_(buf)
    return t


def all_reduce_(t: torch.Tensor, op=dist.ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``dist.all_reduce`` of ``t`` over ``group``, in place on ``t`` wherever it lives."""
    buf = _staged(t, group)
    dist.all_reduce(buf, op=op, group=group)
    return _back(t, buf)


def broadcast_(t: torch.Tensor, src: int, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``dist.broadcast`` of ``t`` from global rank ``src`` over ``group``, in place on ``t``."""
    buf = _staged(t, group)
    dist.broadcast(buf, src=src, group=group)
    return _back(t, buf)


def send_(t: torch.Tensor, dst: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """``dist.send`` of ``t`` to global rank ``dst``."""
    dist.send(_staged(t, group), dst=dst, group=group)


def recv_(t: torch.Tensor, src: int, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``dist.recv`` from global rank ``src`` into ``t`` (in place, wherever ``t`` lives)."""
    buf = _staged(t, group, copy=False)
    dist.recv(buf, src=src, group=group)
    return _back(t, buf)

"""A stand-in accelerator for CPU tests: a device that is not the CPU, and an NCCL-like backend for it.

On a GPU cluster the actor's tensors are CUDA tensors and the groups are NCCL groups, which refuse CPU tensors
("No backend type associated with device type cpu"). On a CPU-only machine every tensor is a CPU tensor and
every group is gloo, so a CPU tensor handed to a collective, or a host tensor mixed with the actor's, goes
unnoticed. This module gives tests the GPU's two refusals on the CPU:

* the device ``fakegpu`` (torch's PrivateUse1 key, Python-only backend): each tensor carries a real CPU
  tensor (``.raw``) and every aten op runs on it; mixing a ``fakegpu`` tensor with a CPU tensor of dim >= 1
  raises like CUDA + CPU does (0-dim CPU scalars are allowed, as with CUDA); ``.cpu()`` / ``.to(...)`` copy;
* the process-group backend ``fakeccl`` (registered for ``fakegpu`` only): gloo underneath, but like NCCL it
  refuses any tensor that is not on ``fakegpu``, naming the collective and the device; a gloo collective on a
  ``fakegpu`` tensor raises "No backend type associated with device type fakegpu", as torch does for a
  device its backend lacks.

Usage (in a forked rank, after ``install()`` in the parent or the rank)::

    install()
    dp = dist.new_group(ranks, backend=BACKEND)        # an "NCCL" group
    make_default_group()                               # the default group becomes "NCCL" too
    lp = log_probs.to(DEVICE)                          # "the actor's outputs on the GPU"
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import List

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["DEVICE", "BACKEND", "TRAFFIC", "install", "make_default_group", "FakeCCLGroup", "FakeGPUTensor"]

DEVICE = "fakegpu"
BACKEND = "fakeccl"
_LIBS: list = []  # the torch.library registrations (kept alive); empty until install()
TRAFFIC: Counter = Counter()
"""Bytes of the tensors handed to this process's ``fakeccl`` collectives, by kind ("send", "gather", ...;
output buffers included): what a test can bound, e.g. that an export sends no padding from ranks that hold
nothing."""
# kernels registered by name, not only through the fallback: composite factories (torch's composite kernel
# resizes an out= wrapper, whose shape would not follow) and copy_ (torch.tensor(..., device=) copies with the
# Python key excluded, where torch's Python fallback asserts)
_OWN_KERNELS = ("arange", "arange.start", "arange.start_step", "copy_")
# ops that take tensors of two devices by design (copies)
_CROSS_DEVICE = {"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"}


def _is_fake(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == DEVICE


class FakeGPUTensor(torch.Tensor):
    """A ``fakegpu`` tensor: a wrapper that carries a real CPU tensor (``raw``). Its ops are intercepted at
    the Python dispatch key, before torch's composite kernels would decompose them into ``out=`` calls whose
    resizes the wrapper's shape could not follow."""

    raw: torch.Tensor

    @staticmethod
    def __new__(cls, raw: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, raw.shape, strides=raw.stride(), dtype=raw.dtype,
                                                device=torch.device(DEVICE, 0))
        t.raw = raw
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, *args, **(kwargs or {}))

    def __repr__(self) -> str:
        return f"FakeGPUTensor({self.raw!r})"

    def tolist(self):  # a device-to-host read, as on CUDA
        return self.raw.tolist()

    def numpy(self, *, force: bool = False):
        raise TypeError(f"can't convert {DEVICE}:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                        f"tensor to host memory first.")


def _written_arguments(op, args, kwargs):
    """For an op whose results are its mutated arguments (``add_``, ``cat.out``): those arguments, else None."""
    returns = op._schema.returns
    if not returns or any(r.alias_info is None or not r.alias_info.is_write for r in returns):
        return None
    out = []
    for r in returns:
        for i, a in enumerate(op._schema.arguments):
            if a.alias_info is not None and a.alias_info.before_set == r.alias_info.before_set:
                out.append(kwargs[a.name] if a.name in kwargs else args[i])
                break
    return out[0] if len(out) == 1 else tuple(out)


def _run(op, *args, **kwargs):
    """Every aten op on a ``fakegpu`` tensor or making one: run it on the carried CPU tensors, wrap the results."""
    name = op.name()
    if name.startswith("c10d::"):  # a collective of a backend without fakegpu support (gloo)
        raise RuntimeError(f"{name}: No backend type associated with device type {DEVICE}")
    device = kwargs.get("device")
    to_fake = device is not None and torch.device(device).type == DEVICE
    if to_fake:
        kwargs["device"] = torch.device("cpu")
    if name == "aten::_copy_from":  # (src, dst): copy into dst
        src, dst = args[0], args[1]
        (dst.raw if _is_fake(dst) else dst).copy_(src.raw if _is_fake(src) else src)
        return dst
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if name not in _CROSS_DEVICE:
        for a in tensors:
            if not _is_fake(a) and a.dim() > 0:
                raise RuntimeError(f"{name}: Expected all tensors to be on the same device, but found at least "
                                   f"two devices, {DEVICE}:0 and {a.device}!")
    raw_args, raw_kwargs = tree_map(lambda a: a.raw if _is_fake(a) else a, (args, kwargs))
    out = op(*raw_args, **raw_kwargs)
    written = _written_arguments(op, args, kwargs)
    if written is not None:  # in place / out=: the caller's tensors (their carried tensors were written)
        return written
    if name == "aten::_to_copy" and device is not None and not to_fake:
        return out  # .cpu() / .to("cpu")
    if to_fake or any(_is_fake(a) for a in tensors):
        return tree_map(lambda o: FakeGPUTensor(o) if isinstance(o, torch.Tensor) else o, out)
    return out


class _Done(dist.Work):
    """A finished collective (the gloo work underneath was waited on)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FakeCCLGroup(dist.ProcessGroup):
    """An NCCL-like process group for ``fakegpu`` tensors: gloo underneath, refuses any other device."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    @property
    def _device_types(self) -> List[torch.device]:  # torch stages object collectives on this device
        return [torch.device(DEVICE)]

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def _raw(self, tensors, what: str) -> List[torch.Tensor]:
        for t in tensors:
            if not _is_fake(t):
                raise RuntimeError(f"{BACKEND} {what}: a tensor on {t.device} (shape {tuple(t.shape)}, {t.dtype}); "
                                   f"this backend, like NCCL, takes {DEVICE} tensors only")
            TRAFFIC[what] += t.numel() * t.element_size()
        return [t.raw for t in tensors]

    @staticmethod
    def _done(work):
        work.wait()  # synchronous; gloo's send / recv works cannot be waited on twice
        return _Done()

    def allreduce(self, tensors, opts):
        return self._done(self._gloo.allreduce(self._raw(tensors, "all_reduce"), opts))

    def broadcast(self, tensors, opts):
        return self._done(self._gloo.broadcast(self._raw(tensors, "broadcast"), opts))

    def allgather(self, output_lists, tensors, opts):
        outs = [self._raw(lst, "all_gather") for lst in output_lists]
        return self._done(self._gloo.allgather(outs, self._raw(tensors, "all_gather"), opts))

    def all_gather_single(self, output, tensor, opts):  # all_gather_into_tensor (torch < 2.13: _allgather_base)
        out, = self._raw([output], "all_gather_single")
        return self._done(self._gloo._allgather_base(out, self._raw([tensor], "all_gather_single")[0], opts))

    _allgather_base = all_gather_single

    def gather(self, output_lists, tensors, opts):
        outs = [self._raw(lst, "gather") for lst in output_lists]
        return self._done(self._gloo.gather(outs, self._raw(tensors, "gather"), opts))

    def send(self, tensors, dst: int, tag: int):
        return self._done(self._gloo.send(self._raw(tensors, "send"), dst, tag))

    def recv(self, tensors, src: int, tag: int):
        return self._done(self._gloo.recv(self._raw(tensors, "recv"), src, tag))

    def barrier(self, opts):
        return self._done(self._gloo.barrier(opts))


def _create(store, rank, size, timeout):
    return FakeCCLGroup(store, rank, size, timeout)


def install() -> None:
    """Register the ``fakegpu`` device and the ``fakeccl`` backend in this process (idempotent)."""
    if _LIBS:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(DEVICE)
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(_run, dispatch_key="PrivateUse1")  # factories: torch.zeros(..., device="fakegpu")
    aten = torch.library.Library("aten", "IMPL")
    for name in _OWN_KERNELS:
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        aten.impl(name, functools.partial(_run, op), "PrivateUse1")
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=[DEVICE])
    _LIBS.extend([lib, aten])


def make_default_group() -> dist.ProcessGroup:
    """Collective: a ``fakeccl`` group over every rank becomes the default group (an NCCL job's default
    group takes no CPU tensor). Returns it."""
    pg = dist.new_group(list(range(dist.get_world_size())), backend=BACKEND)
    dist.distributed_c10d._update_default_pg(pg)
    return pg

"""CPU server start-up hook: lets ``--enable-return-routed-experts`` allocate its host buffer on CPU.

Python imports ``sitecustomize`` at start-up from ``sys.path``; this directory is on ``PYTHONPATH`` only for
the CPU SGLang server subprocess (and the scheduler / detokenizer processes it spawns), so this file runs
nowhere else. It changes no computation: it only registers how a host (CPU) buffer is allocated.

Why (sglang 0.5.23): ``RoutedExpertsCapturer`` keeps the captured expert ids in a ``[tokens, layers, topk]``
int32 host buffer allocated through ``ALLOC_MEMORY_FUNCS[device]`` with ``pin_memory=True``
(``srt/state_capturer/base.py``). That table (``srt/mem_cache/pool_host/common.py``) has entries for npu /
musa / xpu and defaults to ``alloc_with_host_register``, which calls ``cudaHostRegister``: on CPU-only
torch the server dies at start-up with "Torch not compiled with CUDA enabled". On CPU the buffer already
lives in host memory, so the CPU entry allocates it with the given allocator and skips the registration
(pinning page-locks memory for GPU copies; there is no GPU). The captured ids themselves are written by
sglang's own ``capture_routed_experts_if_allowed`` in its own top-k code, untouched.
"""
import importlib.abc
import sys

#: The sglang module whose ``ALLOC_MEMORY_FUNCS`` gets a ``"cpu"`` entry.
_TARGET = "sglang.srt.mem_cache.pool_host.common"


def _alloc_cpu_host(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """Host buffer on a CPU-only server: allocated like sglang's default, without ``cudaHostRegister``."""
    if allocator is None:
        import torch

        return torch.empty(dims, dtype=dtype, device=device)
    return allocator.allocate(dims, dtype=dtype, device=device)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then adds the ``"cpu"`` allocation entry."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        module.ALLOC_MEMORY_FUNCS.setdefault("cpu", _alloc_cpu_host)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``_TARGET`` only (the spec comes from the other finders)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _Finder())

"""CPU server start-up hooks: ``--enable-return-routed-experts`` allocates its host buffer on CPU, the server
forks its scheduler / detokenizer processes instead of spawning them, and ``--enable-lora`` allocates unpinned.

Python imports ``sitecustomize`` at start-up from ``sys.path``; this directory is on ``PYTHONPATH`` only for
the CPU SGLang server subprocess (and the scheduler / detokenizer processes it starts), so this file runs
nowhere else. Rule: it changes no computation -- it registers how a host (CPU) buffer is allocated and how the
server's child processes are started. Why each hook is needed (sglang 0.5.23): docs/platform.md ("The CPU SGLang
server").
"""
import importlib.abc
import multiprocessing
import sys

#: The sglang module whose ``ALLOC_MEMORY_FUNCS`` gets a ``"cpu"`` entry.
_TARGET = "sglang.srt.mem_cache.pool_host.common"
#: The sglang module whose ``_set_envs_and_config`` sets the ``spawn`` start method.
_ENGINE = "sglang.srt.entrypoints.engine"


def _alloc_cpu_host(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """Host buffer on a CPU-only server: allocated like sglang's default, without ``cudaHostRegister``."""
    if allocator is None:
        import torch

        return torch.empty(dims, dtype=dtype, device=device)
    return allocator.allocate(dims, dtype=dtype, device=device)


def _add_cpu_alloc(module):
    module.ALLOC_MEMORY_FUNCS.setdefault("cpu", _alloc_cpu_host)


def _fork_children(module):
    """After sglang's own ``_set_envs_and_config`` (which forces ``spawn``), the start method is ``fork`` -- unless
    CUDA was initialised in the server (a forked child cannot use it). An sglang without that function (another
    version) keeps its own start method: forking is a start-up saving, never a reason for the server to fail."""
    set_envs_and_config = getattr(module, "_set_envs_and_config", None)
    if set_envs_and_config is None:
        return

    def _set_envs_and_config_then_fork(*args, **kwargs):
        out = set_envs_and_config(*args, **kwargs)
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            multiprocessing.set_start_method("fork", force=True)
        return out

    module._set_envs_and_config = _set_envs_and_config_then_fork


#: The sglang package whose modules get the unpinned ``torch`` (``_unpin_lora``).
_LORA = "sglang.srt.lora."


def _pinning_missing(torch) -> bool:
    """Whether this process cannot pin memory: no accelerator."""
    accelerator = getattr(torch, "accelerator", None)
    return accelerator is not None and not accelerator.is_available()


class _UnpinnedTorch:
    """``torch`` for a module of ``sglang.srt.lora`` where pinning is missing: every attribute is torch's own,
    except that a callable's ``pin_memory=True`` is dropped (``torch.empty(..., pin_memory=True)``)."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name[:1].islower() and callable(attr) and not isinstance(attr, type):
            def unpinned(*args, __f=attr, **kwargs):
                kwargs.pop("pin_memory", None)
                return __f(*args, **kwargs)
            return unpinned
        return attr


def _unpin_tensor(self, *args, **kwargs):
    """``Tensor.pin_memory`` where pinning is missing: the tensor itself (it already lives in host memory)."""
    return self


def _unpin_lora(module):
    torch = sys.modules.get("torch")
    if torch is None or not _pinning_missing(torch):
        return
    if getattr(module, "torch", None) is torch:
        module.torch = _UnpinnedTorch(torch)
    if getattr(torch.Tensor.pin_memory, "__name__", "") != _unpin_tensor.__name__:
        torch.Tensor.pin_memory = _unpin_tensor


#: what runs after each patched module is loaded
_AFTER_LOAD = {_TARGET: _add_cpu_alloc, _ENGINE: _fork_children}


def _after_load(name):
    """The hook of module ``name`` (None: not patched)."""
    return _AFTER_LOAD.get(name) or (_unpin_lora if name.startswith(_LORA) else None)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then the module's hook (``_AFTER_LOAD``)."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _after_load(module.__name__)(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of the modules of ``_AFTER_LOAD`` only (the spec comes from the other finders)."""

    def find_spec(self, fullname, path=None, target=None):
        if _after_load(fullname) is None:
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

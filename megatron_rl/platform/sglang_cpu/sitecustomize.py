"""CPU server start-up hooks: ``--enable-return-routed-experts`` allocates its host buffer on CPU, the server
forks its scheduler / detokenizer processes instead of spawning them, and ``--enable-lora`` allocates unpinned.

Python imports ``sitecustomize`` at start-up from ``sys.path``; this directory is on ``PYTHONPATH`` only for
the CPU SGLang server subprocess (and the scheduler / detokenizer processes it starts), so this file runs
nowhere else. It changes no computation: it registers how a host (CPU) buffer is allocated and how the
server's child processes are started.

Why (sglang 0.5.23): ``RoutedExpertsCapturer`` keeps the captured expert ids in a ``[tokens, layers, topk]``
int32 host buffer allocated through ``ALLOC_MEMORY_FUNCS[device]`` with ``pin_memory=True``
(``srt/state_capturer/base.py``). That table (``srt/mem_cache/pool_host/common.py``) has entries for npu /
musa / xpu and defaults to ``alloc_with_host_register``, which calls ``cudaHostRegister``: on CPU-only
torch the server dies at start-up with "Torch not compiled with CUDA enabled". On CPU the buffer already
lives in host memory, so the CPU entry allocates it with the given allocator and skips the registration
(pinning page-locks memory for GPU copies; there is no GPU). The captured ids themselves are written by
sglang's own ``capture_routed_experts_if_allowed`` in its own top-k code, untouched.

Why fork (sglang 0.5.23): ``_set_envs_and_config`` (``srt/entrypoints/engine.py``) sets the ``spawn`` start
method, so each scheduler and the detokenizer starts a fresh interpreter that imports sglang (torch,
transformers, every layer) again: on 2 busy cores ~15-20 CPU-s per process, two thirds of a tiny model's
start-up. Spawn is needed where CUDA was initialised in the parent; a CPU server has no CUDA, so its children
are forked from the main process after it has imported sglang (the same code, the same arguments, run by the
same functions; each child seeds itself from ``--random-seed`` as before).

Why unpinned LoRA buffers (sglang 0.5.23): ``--enable-lora`` builds its layers and batch info with
``pin_memory=True`` / ``.pin_memory()`` (``srt/lora/layers.py``, ``srt/lora/backend/*.py``), which raises without
an accelerator ("no pinned memory allocator"). Only where pinning is impossible (``torch.accelerator`` reports
none), the ``sglang.srt.lora`` modules see a ``torch`` whose factories drop ``pin_memory=True`` and whose
tensors' ``pin_memory()`` returns the tensor: the same values in host memory (pinning only speeds GPU copies).
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

"""What a CPU lacks for megatron-core: CUDA API stand-ins, applied when CUDA is absent (``platform.select``
decides; what megatron's local, non-TE layers lack is ``platform.local_layers``, applied whenever TE is absent).

Without CUDA every loaded ``megatron.core.*`` module sees a *CPU view of torch* (its module-global ``torch``
replaced: ``torch.cuda.*`` on the CPU, ``device="cuda"`` allocating on CPU), and the few functions that view
cannot fix are replaced one by one (``PATCHES`` lists each, with why). The rule to keep: nothing outside megatron
is affected (tensors and classes stay torch's own), and the first call installs an import hook, so megatron
modules imported later are patched as they load. The project applies the patches in
``parallel.initialize_model_parallel``; code that sets up megatron itself calls ``apply_cpu_patches()``
(``platform.select``, both sets) before building models. What is covered and what is not: docs/platform.md.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import types
from typing import Any, List, Optional

import torch

from megatron_rl.platform.packed_attention import packed_segments  # noqa: F401  (re-exported)
from megatron_rl.platform.registry import PATCHES, original, replace

__all__ = ["apply_cpu_stand_ins", "cpu_patches_applied", "packed_segments", "PATCHES",
           "CpuStream", "CpuEvent"]

#: megatron-core modules imported eagerly by ``apply_cpu_patches`` so their ``torch`` global is
#: replaced before first use (lazily imported megatron modules are covered by a later call).
_EAGER_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.transformer.torch_norm",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.pipeline_parallel",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
)


_state = {"applied": False, "patched_modules": set()}


# ----------------------------------------------------------------------------- CPU view of torch
class CpuStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU: CPU work is synchronous, so there is one stream.

    All instances compare equal (megatron compares ``current_stream() != side_stream`` to decide
    whether to ``record_stream``; on CPU there is no side stream)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return 0

    def wait_stream(self, stream: Any) -> None:
        """No-op: CPU work is already ordered."""

    def wait_event(self, event: Any) -> None:
        """No-op: CPU work is already ordered."""

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def record_event(self, event: Optional["CpuEvent"] = None) -> "CpuEvent":
        """Return a completed event."""
        return event if event is not None else CpuEvent()


class CpuEvent:
    """Stand-in for ``torch.cuda.Event`` on CPU: always complete; ``elapsed_time`` is 0."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""

    def wait(self, stream: Any = None) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def elapsed_time(self, other: "CpuEvent") -> float:
        """No timing on CPU."""
        return 0.0


_CPU_STREAM = CpuStream()


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _CpuNvtx(types.SimpleNamespace):
    pass


_NVTX = _CpuNvtx(range_push=_noop, range_pop=_noop, mark=_noop,
                 range=lambda *a, **k: contextlib.nullcontext())


class _CpuCudaView(types.ModuleType):
    """What megatron sees as ``torch.cuda`` on CPU (anything not overridden is the real torch.cuda)."""

    def __init__(self) -> None:
        super().__init__("torch.cuda[cpu-view]")
        ns = self.__dict__
        # RoPE / buffers / p2p allocate on `torch.cuda.current_device()`; the CPU is the device.
        ns["current_device"] = lambda: torch.device("cpu")
        # CPU execution is synchronous; synchronize/empty_cache have nothing to do.
        ns["synchronize"] = _noop
        ns["empty_cache"] = _noop
        ns["set_device"] = _noop
        # Streams/events (alltoall dispatcher DtoH stream, overlap code): one synchronous CPU stream.
        ns["Stream"] = CpuStream
        ns["Event"] = CpuEvent
        ns["current_stream"] = lambda *a, **k: _CPU_STREAM
        ns["default_stream"] = lambda *a, **k: _CPU_STREAM
        ns["stream"] = lambda *a, **k: contextlib.nullcontext()
        ns["nvtx"] = _NVTX
        # The "CUDA" RNG is the CPU generator (RNG tracker add/fork; model_parallel_cuda_manual_seed).
        ns["get_rng_state"] = lambda *a, **k: torch.get_rng_state()
        ns["set_rng_state"] = lambda state, *a, **k: torch.set_rng_state(state)
        ns["manual_seed"] = lambda seed: torch.manual_seed(seed)
        ns["manual_seed_all"] = lambda seed: torch.manual_seed(seed)
        # Memory statistics: nothing to report on CPU.
        ns["memory_allocated"] = lambda *a, **k: 0
        ns["max_memory_allocated"] = lambda *a, **k: 0
        ns["memory_reserved"] = lambda *a, **k: 0
        # Legacy tensor-type names used in isinstance/type checks.
        ns["FloatTensor"] = torch.FloatTensor
        ns["HalfTensor"] = torch.HalfTensor
        ns["BFloat16Tensor"] = torch.BFloat16Tensor

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch.cuda, name)
        return value


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return False


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "eye", "rand",
              "randn", "randint", "randperm", "linspace", "zeros_like", "ones_like", "empty_like",
              "full_like", "rand_like", "randn_like")


def _cpu_factory(fn):
    def wrapper(*args: Any, **kwargs: Any):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)  # pinned memory needs CUDA; irrelevant on CPU
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    wrapper.__wrapped__ = fn
    return wrapper


class _CpuTorchView(types.ModuleType):
    """What a megatron module sees as ``torch`` on CPU: the real torch except ``torch.cuda`` (see
    ``_CpuCudaView``) and tensor factories (``device="cuda"`` -> CPU). Attribute lookups are cached."""

    def __init__(self) -> None:
        super().__init__("torch[cpu-view]")
        self.__dict__["cuda"] = _CpuCudaView()
        for name in _FACTORIES:
            self.__dict__[name] = _cpu_factory(getattr(torch, name))

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        self.__dict__[name] = value
        return value


_TORCH_VIEW: Optional[_CpuTorchView] = None


# ----------------------------------------------------------------------------- individual patches
def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """CPU replacement of ``megatron.core.tensor_parallel.random._get_cuda_rng_state``."""
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
    """CPU replacement of ``megatron.core.tensor_parallel.random._set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU replacement of ``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32``:
    same math (grads *= max_norm / (total_norm + 1e-6) when that is < 1), fp32 check by dtype."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads: List[torch.Tensor] = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        if not use_decoupled_grad and grad.dtype != torch.float32:
            raise TypeError(f"clip_grad_by_total_norm_fp32: expected fp32 grads on CPU, got {grad.dtype} "
                            f"for a parameter of shape {tuple(param.shape)}")
        grads.append(grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _cpu_maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """CPU replacement of ``megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu``:
    also converts CPU tensors to numpy when asked (gloo ``all_to_all_single`` needs list/numpy splits)."""
    if torch.is_tensor(tensor):
        tensor = tensor.detach().cpu()
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _cpu_gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    """CPU replacement of ``megatron.core.tensor_parallel.mappings._gather_along_first_dim``: gloo's
    all_gather needs equal sizes, so uneven ``output_split_sizes`` are padded to the largest and cut."""
    fallback = original("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim")
    if output_split_sizes is None or group.size() == 1 or len(set(output_split_sizes)) == 1:
        return fallback(input_, group, output_split_sizes, use_global_buffer)
    m = max(output_split_sizes)
    padded = input_.new_zeros((m,) + tuple(input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in output_split_sizes]
    torch.distributed.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)], dim=0)


def _cpu_reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    """CPU replacement of ``megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim``:
    gloo has no list reduce_scatter, so uneven ``input_split_sizes`` all-reduce the whole input and cut."""
    fallback = original("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim")
    if input_split_sizes is None or group.size() == 1:
        return fallback(input_, group, input_split_sizes, use_global_buffer)
    full = input_.contiguous().clone()
    torch.distributed.all_reduce(full, group=group)
    start = sum(input_split_sizes[: group.rank()])
    return full[start:start + input_split_sizes[group.rank()]].contiguous()


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """Within the block, ``Tensor.cuda()`` returns the (CPU) tensor itself."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _install_torch_view(names: Optional[List[str]] = None) -> None:
    """Replace the module-global ``torch`` of every loaded megatron.core module (or of the loaded modules
    ``names`` only: what the import hook just loaded) by the CPU view."""
    global _TORCH_VIEW
    if _TORCH_VIEW is None:
        _TORCH_VIEW = _CpuTorchView()
    loaded = list(sys.modules.items()) if names is None else [(n, sys.modules.get(n)) for n in names]
    for name, module in loaded:
        if not name.startswith("megatron.core") or module is None:
            continue
        if name in _state["patched_modules"]:
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = _TORCH_VIEW
        _state["patched_modules"].add(name)
    PATCHES["megatron.core.*.torch"] = ("CUDA literals: torch.cuda.current_device (~175 sites), synchronize, "
                                        "streams/events, CUDA RNG, device='cuda' factories -> CPU")


def _apply_function_patches() -> None:
    replace("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _cpu_get_rng_state,
             "the CUDA RNG tracker saves/restores CUDA generator state; on CPU it is the CPU generator")
    replace("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _cpu_set_rng_state,
             "the CUDA RNG tracker saves/restores CUDA generator state; on CPU it is the CPU generator")
    for mod in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        replace(mod, "clip_grad_by_total_norm_fp32", _cpu_clip_grad_by_total_norm_fp32,
                 "asserts grad.type() == 'torch.cuda.FloatTensor' and uses a CUDA multi-tensor kernel")
    for mod in ("megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.token_dispatcher"):
        if hasattr(importlib.import_module(mod), "maybe_move_tensor_to_cpu"):
            replace(mod, "maybe_move_tensor_to_cpu", _cpu_maybe_move_tensor_to_cpu,
                     "split sizes stay tensors on CPU; gloo all_to_all_single needs list/numpy splits")
    replace("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim", _cpu_gather_along_first_dim,
             "MoE at TP x EP gathers uneven token counts over TP; gloo's all_gather needs equal sizes")
    replace("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim",
             _cpu_reduce_scatter_along_first_dim,
             "MoE at TP x EP reduce-scatters uneven token counts over TP; gloo has no list reduce_scatter")
    lm = importlib.import_module("megatron.core.models.common.language_module.language_module")
    cls = lm.LanguageModule
    if not hasattr(cls.setup_embeddings_and_output_layer, "__wrapped__"):
        # a contextmanager is also a decorator (contextlib.ContextDecorator): each call runs in a fresh one
        cls.setup_embeddings_and_output_layer = _tensor_cuda_is_identity()(cls.setup_embeddings_and_output_layer)
    PATCHES["megatron.core.models.common.language_module.language_module.LanguageModule."
            "setup_embeddings_and_output_layer"] = "calls weight.data.cuda() for tied embeddings with PP"


# ----------------------------------------------------------------------------- CPU stand-ins: optimizers
def _cuda_type_name(name: str) -> str:
    """``"torch.BFloat16Tensor"`` -> ``"torch.cuda.BFloat16Tensor"`` (other names unchanged)."""
    if name.startswith("torch.") and not name.startswith("torch.cuda.") and name.endswith("Tensor"):
        return "torch.cuda." + name[len("torch."):]
    return name


@contextlib.contextmanager
def _tensor_type_names_cuda():
    """While active, ``Tensor.type()`` (no argument) names a CPU tensor by its CUDA type."""
    original = torch.Tensor.type

    def type_(self, *args: Any, **kwargs: Any):
        out = original(self, *args, **kwargs)
        return _cuda_type_name(out) if not args and not kwargs and isinstance(out, str) else out

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _apply_optimizer_standins() -> None:
    """CPU stand-ins for the parameter type checks of megatron's mixed-precision (bf16 params, fp32 main
    params) and distributed optimizers: while they are constructed, CPU tensors report their CUDA type names."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for cls in (Float16OptimizerWithFloat16Params, DistributedOptimizer):
        if not getattr(cls.__init__, "cpu_type_standin", False):
            cls.__init__ = _tensor_type_names_cuda()(cls.__init__)  # (a decorator too, as above)
            cls.__init__.cpu_type_standin = True  # (distrib_optimizer also wraps __init__: a marker of its own)
        PATCHES[f"{cls.__module__}.{cls.__name__}.__init__"] = (
            "accepts only param.type() in torch.cuda.{Float,Half,BFloat16}Tensor (TypeError for CPU tensors)")


class _PatchingLoader:
    """Wraps a module loader: after the module executes, its ``torch`` global becomes the CPU view."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        if module.__name__ == "megatron.core.jit":
            _run_fused_functions_eagerly(module)
        _install_torch_view([module.__name__])  # the modules it imported were patched as they loaded


def _run_fused_functions_eagerly(jit_module) -> None:
    """megatron's ``jit_fuser`` (``torch.compile``), set to a no-op before any module decorates with it."""
    jit_module.disable_jit_fuser()
    PATCHES["megatron.core.jit.jit_fuser"] = (
        "torch.compile: decorating with it imports dynamo and inductor (~3 s of CPU per process), and a call "
        "compiles C++ kernels; on CPU the decorated functions run eagerly")


class _MegatronImportHook:
    """``sys.meta_path`` finder: megatron.core modules imported after ``apply_cpu_patches`` are patched as
    they load (the spec comes from the other finders; only its loader is wrapped)."""

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith("megatron.core"):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


_HOOK = _MegatronImportHook()


def cpu_patches_applied() -> bool:
    """True once the CPU stand-ins are applied (never on a CUDA machine unless forced)."""
    return bool(_state["applied"])


def apply_cpu_stand_ins() -> None:
    """Apply the CPU stand-ins of this module (idempotent; ``platform.select`` calls it when CUDA is absent).
    Megatron modules imported later are patched as they load (import hook); a later call only re-checks what
    is loaded."""
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
    for name in _EAGER_MODULES:
        importlib.import_module(name)
    _install_torch_view()
    if not _state["applied"]:
        _apply_function_patches()
        _apply_optimizer_standins()
        _state["applied"] = True

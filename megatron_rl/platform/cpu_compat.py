"""CPU compatibility patches for megatron-core 0.16.x — the ONE place the project patches megatron.

megatron-core assumes a CUDA device in many places (``PATCHES`` below lists each one patched, with why).
On a machine without CUDA, ``apply_cpu_patches()`` makes megatron run on CPU tensors with gloo:

  * every loaded ``megatron.core.*`` module sees a *CPU view of torch* (``module.torch`` is replaced
    by ``_CpuTorchView``): ``torch.cuda.current_device()`` returns ``torch.device("cpu")``,
    ``torch.cuda.synchronize``/streams/events/nvtx are no-ops, ``torch.cuda.get_rng_state`` /
    ``manual_seed`` act on the CPU generator, and tensor factories called with ``device="cuda"``
    allocate on CPU. Tensors and classes are the real torch objects; only the module-global name
    ``torch`` inside megatron modules changes, so nothing outside megatron is affected;
  * a few functions that cannot be fixed through that view are replaced one by one (listed in
    ``PATCHES`` with the megatron-core symbol each replaces and why). Among them, megatron's local
    ``DotProductAttention`` runs packed (THD) sequences (``packed_seq_params``, context parallel 1) one causal
    segment at a time (``packed_segments``); megatron's own THD RoPE path (pure torch with
    ``apply_rope_fusion=False``) already restarts rotary positions at each segment.

Consequences worth knowing: megatron's "CUDA" RNG is the CPU default generator, so
``model_parallel_cuda_manual_seed(seed)`` reseeds ``torch``'s CPU generator with ``seed`` (megatron's
tracked streams use seed + 2718 + tp_rank etc. as on GPU); while megatron's
``LanguageModule.setup_embeddings_and_output_layer`` runs, ``torch.Tensor.cuda`` is the identity (the
only patch visible outside megatron, for the duration of that call).

Usage: the project calls it once, in ``megatron_rl.parallel.initialize_model_parallel`` (every megatron
model needs megatron's parallel state first); code that sets up megatron's parallel state by itself calls it
before building models. The first call also installs an import hook (``_MegatronImportHook``), so megatron
modules imported later — dist_checkpointing when a checkpoint is first saved, MoE modules, ... — get the CPU
view as they load; nothing has to call it again::

    from megatron_rl.platform.cpu_compat import apply_cpu_patches
    apply_cpu_patches()          # no-op when torch.cuda.is_available(); idempotent

With CUDA available nothing is patched. Not covered (do not work on CPU): bf16/fp16 params with the
Megatron optimizer and the distributed optimizer (type checks on ``torch.cuda.*Tensor``), CUDA graphs,
fused kernels (TE / apex) — use fp32 params and the local layer spec on CPU.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import types
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["apply_cpu_patches", "cpu_patches_applied", "packed_segments", "PATCHES", "CpuStream",
           "CpuEvent"]

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

#: Human-readable record of what ``apply_cpu_patches`` replaced: megatron-core symbol -> reason.
PATCHES: Dict[str, str] = {}

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
    import megatron.core.tensor_parallel.mappings as mp

    original = mp._mrl_cpu_original__gather_along_first_dim
    if output_split_sizes is None or group.size() == 1 or len(set(output_split_sizes)) == 1:
        return original(input_, group, output_split_sizes, use_global_buffer)
    m = max(output_split_sizes)
    padded = input_.new_zeros((m,) + tuple(input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in output_split_sizes]
    torch.distributed.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)], dim=0)


def _cpu_reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    """CPU replacement of ``megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim``:
    gloo has no list reduce_scatter, so uneven ``input_split_sizes`` all-reduce the whole input and cut."""
    import megatron.core.tensor_parallel.mappings as mp

    original = mp._mrl_cpu_original__reduce_scatter_along_first_dim
    if input_split_sizes is None or group.size() == 1:
        return original(input_, group, input_split_sizes, use_global_buffer)
    full = input_.contiguous().clone()
    torch.distributed.all_reduce(full, group=group)
    start = sum(input_split_sizes[: group.rank()])
    return full[start:start + input_split_sizes[group.rank()]].contiguous()


def _wrapped_torch_norm_new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                            zero_centered_gamma=False, normalization="LayerNorm"):
    """CPU replacement of ``megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__``: no
    ``sequence_parallel`` assert; norm params get ``param.sequence_parallel`` like TE's norms, so
    ``finalize_model_grads`` all-reduces their grads over TP (the norm math is per token)."""
    if config.layernorm_zero_centered_gamma or config.persist_layer_norm or \
            config.memory_efficient_layer_norm:
        raise ValueError("local torch norm (CPU) does not support layernorm_zero_centered_gamma, "
                         "persist_layer_norm or memory_efficient_layer_norm")
    norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
    if norm_cls is None:
        raise ValueError(f"config.normalization={config.normalization!r}: only LayerNorm / RMSNorm on CPU")
    module = norm_cls(normalized_shape=hidden_size, eps=eps)
    for param in module.parameters():
        setattr(param, "sequence_parallel", bool(config.sequence_parallel))
    return module


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """Within the block, ``Tensor.cuda()`` returns the (CPU) tensor itself."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _wrap_setup_embeddings(original):
    def setup_embeddings_and_output_layer(self, *args: Any, **kwargs: Any):
        with _tensor_cuda_is_identity():
            return original(self, *args, **kwargs)

    setup_embeddings_and_output_layer.__wrapped__ = original
    setup_embeddings_and_output_layer.__doc__ = original.__doc__
    return setup_embeddings_and_output_layer


def _wrap_dot_product_attention_init(original):
    """Local ``DotProductAttention.__init__`` that accepts MLA's ``k_channels`` / ``v_channels``: the forward
    already handles a key head dim different from the value head dim; the output width comes from
    ``config.kv_channels``, which the builder sets to the value head dim for MLA (checked here)."""
    def __init__(self, config, *args: Any, k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 **kwargs: Any):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"local DotProductAttention: v_channels={v_channels} must equal config.kv_channels="
                             f"{config.kv_channels} (MLA: set kv_channels to v_head_dim)")
        original(self, config, *args, **kwargs)

    __init__.__wrapped__ = original
    return __init__


def packed_segments(cu_seqlens: torch.Tensor, total: int) -> List[Tuple[int, int]]:
    """The non-empty ``[start, end)`` segments of a packed (THD) sequence of ``total`` tokens given by
    ``cu_seqlens`` (int ``[n_segments + 1]``, 0 first, ``total`` last, non-decreasing; ValueError otherwise)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"packed_segments: cu_seqlens must be non-decreasing from 0 to total={total}, got {cu}")
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


def _wrap_dot_product_attention_forward(original):
    """Local ``DotProductAttention.forward`` that runs packed (THD) sequences: megatron's attention passes
    q/k/v as ``[t, heads, dim]`` with ``packed_seq_params``; each segment of ``cu_seqlens_q_padded`` (else
    ``cu_seqlens_q``) runs as its own causal ``[len, 1, heads, dim]`` sequence through the original forward, so
    no token attends across segments and the work is the sum of the segments' squares (one masked
    ``[t, t]`` product would cost more than the padded rows it replaces). The output is TE's THD layout
    ``[t, heads * value dim]``, which megatron's attention reshapes to ``[t, 1, -1]`` (0.19's MLA first trims
    its padded value dim off it). Without ``packed_seq_params`` the original forward runs untouched."""
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias)
        from megatron.core.transformer.enums import AttnMaskType

        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"local DotProductAttention: packed_seq_params.qkv_format="
                             f"{packed_seq_params.qkv_format!r}; only 'thd' is supported on CPU")
        if self.config.context_parallel_size != 1:
            raise ValueError(f"local DotProductAttention: packed (THD) sequences need context_parallel_size=1, "
                             f"got {self.config.context_parallel_size} (context parallelism needs TE attention)")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type != AttnMaskType.causal or self.scale_mask_softmax.window_size is not None:
            raise ValueError(f"local DotProductAttention: packed (THD) sequences support full causal attention "
                             f"only, got attn_mask_type={mask_type} window_size="
                             f"{self.scale_mask_softmax.window_size}")
        cu_q = packed_seq_params.cu_seqlens_q_padded
        if cu_q is None:
            cu_q = packed_seq_params.cu_seqlens_q
        cu_kv = packed_seq_params.cu_seqlens_kv_padded
        if cu_kv is None:
            cu_kv = packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu_kv.cpu(), cu_q.cpu()):
            raise ValueError("local DotProductAttention: packed (THD) self-attention needs the same query and "
                             f"key/value segments, got cu_seqlens_q {cu_q.tolist()} vs kv {cu_kv.tolist()}")
        if query.dim() != 3 or key.size(0) != query.size(0):
            raise ValueError(f"local DotProductAttention: packed (THD) q/k/v must be [t, heads, dim] of one "
                             f"length, got query {tuple(query.shape)} key {tuple(key.shape)}")
        segments = packed_segments(cu_q, query.size(0))
        # the output width follows the value head dim: megatron-core 0.19's MLA pads THD values to the
        # query head dim (and trims the output back), so it can differ from config.kv_channels here
        width = self.num_attention_heads_per_partition * value.size(-1)
        saved = self.hidden_size_per_partition
        self.hidden_size_per_partition = width
        try:
            outs = [original(self, query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1), None,
                             attn_mask_type=AttnMaskType.causal, attention_bias=attention_bias,
                             packed_seq_params=None).reshape(b - a, width)
                    for a, b in segments]
        finally:
            self.hidden_size_per_partition = saved
        return torch.cat(outs, dim=0)  # TE's THD layout [t, heads * dim]

    forward.__wrapped__ = original
    return forward


def _replace(module_name: str, attr: str, new: Any, reason: str) -> None:
    module = importlib.import_module(module_name)
    if not hasattr(module, "_mrl_cpu_original_" + attr):
        setattr(module, "_mrl_cpu_original_" + attr, getattr(module, attr, None))
    setattr(module, attr, new)
    PATCHES[f"{module_name}.{attr}"] = reason


def _install_torch_view() -> None:
    """Replace the module-global ``torch`` of every loaded megatron.core module by the CPU view."""
    global _TORCH_VIEW
    if _TORCH_VIEW is None:
        _TORCH_VIEW = _CpuTorchView()
    for name, module in list(sys.modules.items()):
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
    _replace("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _cpu_get_rng_state,
             "the CUDA RNG tracker saves/restores CUDA generator state; on CPU it is the CPU generator")
    _replace("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _cpu_set_rng_state,
             "the CUDA RNG tracker saves/restores CUDA generator state; on CPU it is the CPU generator")
    for mod in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        _replace(mod, "clip_grad_by_total_norm_fp32", _cpu_clip_grad_by_total_norm_fp32,
                 "asserts grad.type() == 'torch.cuda.FloatTensor' and uses a CUDA multi-tensor kernel")
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        _replace("megatron.core.transformer.moe.moe_utils", "te_general_gemm", None,
                 "the router GEMM references te_general_gemm, undefined without TE (NameError)")
    for mod in ("megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.token_dispatcher"):
        if hasattr(importlib.import_module(mod), "maybe_move_tensor_to_cpu"):
            _replace(mod, "maybe_move_tensor_to_cpu", _cpu_maybe_move_tensor_to_cpu,
                     "split sizes stay tensors on CPU; gloo all_to_all_single needs list/numpy splits")
    _replace("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim", _cpu_gather_along_first_dim,
             "MoE at TP x EP gathers uneven token counts over TP; gloo's all_gather needs equal sizes")
    _replace("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim",
             _cpu_reduce_scatter_along_first_dim,
             "MoE at TP x EP reduce-scatters uneven token counts over TP; gloo has no list reduce_scatter")
    _replace("megatron.core.transformer.multi_latent_attention", "HAVE_TE", False,
             "TE placeholders import without Transformer Engine, so MLA's isinstance(linear_proj, TELinear) fails")
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    if getattr(mla, "Linear", None) is None:
        from megatron.core.post_training.modelopt.layers import Linear

        _replace("megatron.core.transformer.multi_latent_attention", "Linear", Linear,
                 "0.19 binds the replicated MLA down-projection (modelopt Linear) only with TE, so the local spec's "
                 "replicated q/kv down-projection is refused ('Unsupported linear_q_down_proj')")
    dpa = importlib.import_module("megatron.core.transformer.dot_product_attention").DotProductAttention
    if not hasattr(dpa.__init__, "__wrapped__"):
        dpa.__init__ = _wrap_dot_product_attention_init(dpa.__init__)
    PATCHES["megatron.core.transformer.dot_product_attention.DotProductAttention.__init__"] = (
        "multi-latent attention passes k_channels / v_channels, which only TE's attention accepts (TypeError)")
    if not hasattr(dpa.forward, "__wrapped__"):
        dpa.forward = _wrap_dot_product_attention_forward(dpa.forward)
    PATCHES["megatron.core.transformer.dot_product_attention.DotProductAttention.forward"] = (
        "asserts packed_seq_params is None: packed (THD) sequences run only in TE's attention; here they run "
        "one segment at a time as causal sequences")
    torch_norm = importlib.import_module("megatron.core.transformer.torch_norm")
    torch_norm.WrappedTorchNorm.__new__ = _wrapped_torch_norm_new
    PATCHES["megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__"] = (
        "asserts sequence_parallel is off (MoE + TP requires SP) and does not tag params for SP grad all-reduce")
    lm = importlib.import_module("megatron.core.models.common.language_module.language_module")
    cls = lm.LanguageModule
    if not hasattr(cls.setup_embeddings_and_output_layer, "__wrapped__"):
        cls.setup_embeddings_and_output_layer = _wrap_setup_embeddings(cls.setup_embeddings_and_output_layer)
    PATCHES["megatron.core.models.common.language_module.language_module.LanguageModule."
            "setup_embeddings_and_output_layer"] = "calls weight.data.cuda() for tied embeddings with PP"


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
        _install_torch_view()


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
    """True once ``apply_cpu_patches`` has patched megatron (never on a CUDA machine)."""
    return bool(_state["applied"])


def apply_cpu_patches(force: bool = False) -> bool:
    """Patch megatron-core for CPU execution if CUDA is unavailable (or ``force``). Idempotent.

    Returns True when patches are active. Megatron modules imported after the first call are patched as
    they load (import hook); a later call only re-checks what is loaded."""
    if torch.cuda.is_available() and not force:
        return False
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
    for name in _EAGER_MODULES:
        importlib.import_module(name)
    _install_torch_view()
    if not _state["applied"]:
        _apply_function_patches()
        _state["applied"] = True
    return True

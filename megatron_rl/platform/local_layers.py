"""What megatron-core's local (non-Transformer-Engine) layer spec lacks, patched in: applied whenever Transformer
Engine is absent, on CPU and on CUDA alike (``platform.select`` decides; ``PATCHES`` records each symbol).

* Packed (THD) sequences in the local ``DotProductAttention`` (megatron asserts ``packed_seq_params is None``):
  they run through :mod:`megatron_rl.platform.packed_attention` (by default varlen flash attention on CUDA
  bf16, SDPA per segment elsewhere; or FlexAttention with a document-causal mask;
  ``set_packed_attention_kernel``), causal within each segment of
  ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``); megatron's THD RoPE path (pure torch with
  ``apply_rope_fusion=False``) already restarts rotary positions at each segment. The output is TE's THD layout
  ``[t, heads * value dim]``.
* Multi-latent attention's ``k_channels`` / ``v_channels`` arguments (megatron-core 0.19 passes them to the core
  attention; only TE's accepts them).
* Sequence parallelism in megatron's torch norm (``WrappedTorchNorm`` asserts it is off; MoE with TP needs it).
* MLA's ``isinstance(linear_proj, TELinear)`` with TE's import placeholders, 0.19's MLA ``Linear`` binding, and the
  MoE router's ``te_general_gemm`` name, all defined only when TE imports.
"""
from __future__ import annotations

import importlib
from typing import Any, Optional

import torch

from megatron_rl.platform.packed_attention import (DEFAULT_KERNEL, PACKED_ATTENTION_KERNELS,
                                                   packed_causal_attention)
from megatron_rl.platform.registry import PATCHES, replace

__all__ = ["apply_local_layer_patches", "set_packed_attention_kernel", "packed_attention_kernel"]

_state = {"applied": False, "kernel": DEFAULT_KERNEL}


def set_packed_attention_kernel(name: str) -> None:
    """Choose the kernel packed sequences run through in the local attention (``"auto"``, ``"varlen"``, ``"sdpa"``
    or ``"flex"``)."""
    if name not in PACKED_ATTENTION_KERNELS:
        raise ValueError(f"packed attention kernel {name!r} is not one of {', '.join(PACKED_ATTENTION_KERNELS)}")
    _state["kernel"] = name


def packed_attention_kernel() -> str:
    """The kernel packed sequences run through (``set_packed_attention_kernel``)."""
    return _state["kernel"]


def _wrapped_torch_norm_new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                            zero_centered_gamma=False, normalization="LayerNorm"):
    """Replacement of ``megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__``: no
    ``sequence_parallel`` assert; norm params get ``param.sequence_parallel`` like TE's norms, so
    ``finalize_model_grads`` all-reduces their grads over TP (the norm math is per token)."""
    if config.layernorm_zero_centered_gamma or config.persist_layer_norm or \
            config.memory_efficient_layer_norm:
        raise ValueError("local torch norm does not support layernorm_zero_centered_gamma, "
                         "persist_layer_norm or memory_efficient_layer_norm")
    norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
    if norm_cls is None:
        raise ValueError(f"config.normalization={config.normalization!r}: the local torch norm supports "
                         f"LayerNorm / RMSNorm")
    module = norm_cls(normalized_shape=hidden_size, eps=eps)
    for param in module.parameters():
        setattr(param, "sequence_parallel", bool(config.sequence_parallel))
    return module


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


def _packed_refusal(self, packed_seq_params, attn_mask_type, attention_bias) -> Optional[str]:
    """Why the local attention cannot run these packed inputs (None: it can)."""
    from megatron.core.transformer.enums import AttnMaskType

    if packed_seq_params.qkv_format != "thd":
        return f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}; only 'thd' is supported"
    if self.config.context_parallel_size != 1:
        return (f"packed (THD) sequences need context_parallel_size=1, got {self.config.context_parallel_size} "
                f"(context parallelism needs TE attention)")
    mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
    if mask_type != AttnMaskType.causal or self.scale_mask_softmax.window_size is not None:
        return (f"packed (THD) sequences support full causal attention only, got attn_mask_type={mask_type} "
                f"window_size={self.scale_mask_softmax.window_size}")
    if attention_bias is not None or getattr(self, "softmax_offset", None) is not None:
        return "packed (THD) sequences support no attention bias and the vanilla softmax only"
    if self.training and self.attention_dropout.p > 0:
        return f"packed (THD) sequences support attention_dropout 0 only, got {self.attention_dropout.p}"
    return None


def _wrap_dot_product_attention_forward(original):
    """Local ``DotProductAttention.forward`` that runs packed (THD) sequences: megatron's attention passes
    q / k / v as ``[t, heads, dim]`` with ``packed_seq_params``; the chosen kernel attends causally within each
    segment of ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``) with megatron's softmax scale. The output is
    TE's THD layout ``[t, heads * value dim]``, which megatron's attention reshapes to ``[t, 1, -1]``
    (0.19's MLA first trims its padded value dim off it). Without ``packed_seq_params`` the original forward
    runs untouched."""
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias)
        problem = _packed_refusal(self, packed_seq_params, attn_mask_type, attention_bias)
        if problem is not None:
            raise ValueError(f"local DotProductAttention: {problem}")
        cu_q = packed_seq_params.cu_seqlens_q_padded
        if cu_q is None:
            cu_q = packed_seq_params.cu_seqlens_q
        cu_kv = packed_seq_params.cu_seqlens_kv_padded
        if cu_kv is None:
            cu_kv = packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu_kv.cpu(), cu_q.cpu()):
            raise ValueError("local DotProductAttention: packed (THD) self-attention needs the same query and "
                             f"key/value segments, got cu_seqlens_q {cu_q.tolist()} vs kv {cu_kv.tolist()}")
        # megatron scales the scores by softmax_scale in the matmul and by `coeff` (query-key layer scaling,
        # softmax_scale was divided by it) in the softmax: the product is the scale of the scores
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        out = packed_causal_attention(query, key, value, cu_q, scale, kernel=_state["kernel"])
        return out.reshape(out.size(0), -1)  # TE's THD layout [t, heads * dim]

    forward.__wrapped__ = original
    return forward


def apply_local_layer_patches() -> None:
    """Apply the patches above (idempotent)."""
    if _state["applied"]:
        return
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        replace("megatron.core.transformer.moe.moe_utils", "te_general_gemm", None,
                "the router GEMM references te_general_gemm, undefined without TE (NameError)")
    replace("megatron.core.transformer.multi_latent_attention", "HAVE_TE", False,
            "TE placeholders import without Transformer Engine, so MLA's isinstance(linear_proj, TELinear) fails")
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    if getattr(mla, "Linear", None) is None:
        from megatron.core.post_training.modelopt.layers import Linear

        replace("megatron.core.transformer.multi_latent_attention", "Linear", Linear,
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
        "through varlen flash attention / SDPA per segment (platform.packed_attention)")
    torch_norm = importlib.import_module("megatron.core.transformer.torch_norm")
    torch_norm.WrappedTorchNorm.__new__ = _wrapped_torch_norm_new
    PATCHES["megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__"] = (
        "asserts sequence_parallel is off (MoE + TP requires SP) and does not tag params for SP grad all-reduce")
    _state["applied"] = True

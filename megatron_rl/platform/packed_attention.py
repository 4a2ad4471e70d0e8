"""Causal attention over packed (THD) sequences without Transformer Engine: pure functions of tensors.

A packed sequence holds several rows back to back (``cu_seqlens`` marks where each starts); every token attends
causally to the earlier tokens of its own segment only. Kernels (``PACKED_ATTENTION_KERNELS``), same result:
``"sdpa"`` per segment, ``"flex"`` (forward only on CPU), ``"varlen"`` (CUDA sm80+, bf16 / fp16), and ``"auto"``
(what the local layers use): ``"varlen"`` where it can run, else ``"sdpa"``, chosen per call from the tensors.
Each kernel's conditions: docs/platform.md.

    out = packed_causal_attention(q, k, v, cu_seqlens, scale, kernel="sdpa")   # [t, heads, v_dim]; GQA
"""
from __future__ import annotations

import inspect
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["packed_segments", "packed_causal_attention", "sdpa_per_segment", "flex_document_causal",
           "varlen_causal", "varlen_supported", "varlen_eligible", "PACKED_ATTENTION_KERNELS", "DEFAULT_KERNEL"]

DEFAULT_KERNEL = "auto"


def packed_segments(cu_seqlens: torch.Tensor, total: int) -> List[Tuple[int, int]]:
    """The non-empty ``[start, end)`` segments of a packed (THD) sequence of ``total`` tokens given by
    ``cu_seqlens`` (int ``[n_segments + 1]``, 0 first, ``total`` last, non-decreasing; ValueError otherwise)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"packed_segments: cu_seqlens must be non-decreasing from 0 to total={total}, got {cu}")
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Heads per key / value group; ValueError naming the shapes when q / k / v do not fit together."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or not q.size(0) == k.size(0) == v.size(0) \
            or k.size(1) != v.size(1) or q.size(-1) != k.size(-1) or q.size(1) % k.size(1):
        raise ValueError(f"packed attention: q [t, heads, d], k [t, groups, d], v [t, groups, dv] with heads a "
                         f"multiple of groups expected, got q {tuple(q.shape)} k {tuple(k.shape)} "
                         f"v {tuple(v.shape)}")
    return q.size(1) // k.size(1)


def sdpa_per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention of each segment alone through ``scaled_dot_product_attention``: ``[t, heads, dv]``."""
    rep = _check_shapes(q, k, v)
    if rep > 1:  # grouped-query attention: each key / value head serves `rep` consecutive query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    outs = []
    for a, b in packed_segments(cu_seqlens, q.size(0)):
        # [len, heads, d] -> [1, heads, len, d]
        qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


_COMPILED: Dict[str, Callable] = {}


def _flex_fn(device: torch.device) -> Callable:
    """flex_attention itself on CPU (eager), compiled once per process on CUDA (eager flex is a reference
    implementation that materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED["cuda"]


def flex_document_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """One FlexAttention call with a document-causal mask (same segment and not in the future):
    ``[t, heads, dv]``."""
    from torch.nn.attention.flex_attention import create_block_mask

    rep = _check_shapes(q, k, v)
    t = q.size(0)
    segments = packed_segments(cu_seqlens, t)
    lengths = torch.tensor([b - a for a, b in segments], device=q.device)
    doc = torch.repeat_interleave(torch.arange(len(segments), device=q.device), lengths)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    mask = create_block_mask(document_causal, None, None, t, t, device=q.device)
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    with warnings.catch_warnings():  # eager on CPU on purpose (compiling costs minutes there)
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = _flex_fn(q.device)(qs, ks, vs, block_mask=mask, scale=scale, enable_gqa=rep > 1)
    return out[0].transpose(0, 1)


def _varlen_attn() -> Optional[Callable]:
    """torch's varlen flash attention, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


#: flash attention's limits: head dims up to 256 in multiples of 8, GPUs from sm80 (Ampere) on
VARLEN_MAX_HEAD_DIM = 256
VARLEN_MIN_CAPABILITY = (8, 0)


def varlen_eligible(device_type: str, dtype: torch.dtype, qk_dim: int, v_dim: int,
                    capability: Optional[Tuple[int, int]], available: bool) -> bool:
    """Whether varlen flash attention runs here: CUDA, bf16 / fp16, value head dim = query head dim (MLA's
    differ), a head dim flash attention takes, a GPU of compute capability >= ``VARLEN_MIN_CAPABILITY`` and a
    torch with ``torch.nn.attention.varlen`` (``available``). Anything else gets SDPA per segment from "auto"."""
    return (device_type == "cuda" and dtype in (torch.bfloat16, torch.float16) and qk_dim == v_dim
            and qk_dim % 8 == 0 and qk_dim <= VARLEN_MAX_HEAD_DIM
            and capability is not None and tuple(capability) >= VARLEN_MIN_CAPABILITY and available)


def varlen_supported(q: torch.Tensor, v: torch.Tensor) -> bool:
    """``varlen_eligible`` for these tensors on their device."""
    cap = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    return varlen_eligible(q.device.type, q.dtype, q.size(-1), v.size(-1), cap, _varlen_attn() is not None)


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Causal attention within each segment in one varlen flash-attention call: ``[t, heads, dv]``."""
    rep = _check_shapes(q, k, v)
    fn = _varlen_attn()
    if fn is None or not varlen_supported(q, v):
        raise ValueError(f"packed attention kernel 'varlen' needs CUDA bf16/fp16 tensors with equal query and value "
                         f"head dims (a multiple of 8, <= {VARLEN_MAX_HEAD_DIM}) on a GPU of compute capability >= "
                         f"{VARLEN_MIN_CAPABILITY[0]}.{VARLEN_MIN_CAPABILITY[1]} and torch.nn.attention.varlen; got "
                         f"{q.device} {q.dtype}, head dims {q.size(-1)}/{v.size(-1)} (kernel 'auto' falls back to "
                         f"'sdpa')")
    segments = packed_segments(cu_seqlens, q.size(0))
    max_len = max(b - a for a, b in segments)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    params = inspect.signature(fn).parameters
    kwargs = {"scale": scale}
    if "is_causal" in params:          # torch 2.9/2.10 spelling
        kwargs["is_causal"] = True
    else:                              # later: a (left, right) window, (-1, 0) = causal
        kwargs["window_size"] = (-1, 0)
    if rep > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return fn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, **kwargs)


def auto_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                scale: float) -> torch.Tensor:
    """``varlen_causal`` where it can run (``varlen_supported``), else ``sdpa_per_segment``."""
    if varlen_supported(q, v):
        return varlen_causal(q, k, v, cu_seqlens, scale)
    return sdpa_per_segment(q, k, v, cu_seqlens, scale)


#: kernel name -> implementation (same signature, same result)
PACKED_ATTENTION_KERNELS: Dict[str, Callable] = {"auto": auto_kernel, "sdpa": sdpa_per_segment,
                                                 "flex": flex_document_causal, "varlen": varlen_causal}


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            scale: float, kernel: str = DEFAULT_KERNEL) -> torch.Tensor:
    """Causal attention within each segment of a packed sequence (module docstring): ``[t, heads, dv]``."""
    fn = PACKED_ATTENTION_KERNELS.get(kernel)
    if fn is None:
        raise ValueError(f"packed attention kernel {kernel!r} is not one of {', '.join(PACKED_ATTENTION_KERNELS)}")
    return fn(q, k, v, cu_seqlens, scale)

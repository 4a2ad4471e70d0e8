"""Merged LoRA weights: W + (alpha/rank) * B @ A of one shard, in fp32, for the weight sync and the export.

Rule: the merge is shard-local (a column-parallel shard holds B's rows of its W rows and the full A; a
row-parallel shard the full B and A's columns of its W columns), so no rank communicates; B·A is summed over the
rank in a fixed order, element by element (not a BLAS matmul, whose rounding depends on the matrix shape), so
a merged shard is bit for bit the same rows / columns of the single-process merge at any TP / EP; the fp32 sum
is cast ONCE, by whoever casts the tensor next (the weight sync to the engine's dtype, an export to the model's).
"""
from __future__ import annotations

from typing import Dict, Iterator, Mapping, Optional, Tuple

import torch

Tensor = torch.Tensor

__all__ = ["LORA_A", "LORA_B", "lora_scale", "low_rank_product", "merged_weight", "adapted_modules", "merged_items",
           "adapter_items"]

#: Suffixes of an adapted module ``P``'s parameters (``P.lora_A.weight [r, in]``, ``P.lora_B.weight [out, r]``).
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def lora_scale(rank: int, alpha: float) -> float:
    """PEFT's scaling of the low-rank product: ``alpha / rank``."""
    if rank <= 0:
        raise ValueError(f"actor.lora.rank must be > 0 to merge adapters (got {rank})")
    return float(alpha) / float(rank)


def low_rank_product(a: Tensor, b: Tensor) -> Tensor:
    """``b @ a`` in fp32, summed over the rank k = 0, 1, ... in that order for every element (the same bits for
    any slice of rows of ``b`` / columns of ``a``, on any device)."""
    a, b = a.detach().float(), b.detach().float()
    out = b[:, :1] * a[:1, :]
    for k in range(1, a.shape[0]):
        out = out + b[:, k:k + 1] * a[k:k + 1, :]
    return out


def merged_weight(w: Tensor, a: Tensor, b: Tensor, scale: float, name: str = "weight") -> Tensor:
    """``w + scale * (b @ a)`` in fp32 (``w [out, in]``, ``a [r, in]``, ``b [out, r]``: one shard's;
    ``low_rank_product``); shapes are checked, naming ``name``."""
    if w.dim() != 2 or a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] \
            or (b.shape[0], a.shape[1]) != tuple(w.shape):
        raise ValueError(f"LoRA merge of {name}: weight {tuple(w.shape)}, lora_A {tuple(a.shape)} and lora_B "
                         f"{tuple(b.shape)} do not fit (need [out, in], [r, in], [out, r])")
    return w.detach().float() + scale * low_rank_product(a, b)


def adapted_modules(names) -> Dict[str, Tuple[str, str]]:
    """``{module path: (lora_A name, lora_B name)}`` of the adapters among ``names``; an A without its B (or
    the reverse) raises, naming it."""
    out: Dict[str, Tuple[str, str]] = {}
    names = set(names)
    for n in names:
        for suffix, other in ((LORA_A, LORA_B), (LORA_B, LORA_A)):
            if n.endswith(suffix):
                path = n[: -len(suffix)]
                if path + other not in names:
                    raise ValueError(f"LoRA adapter {n!r} has no {path + other!r}")
                out[path] = (path + LORA_A, path + LORA_B)
    return out


def merged_items(sd: Mapping[str, Tensor], scale: float, dtype: Optional[torch.dtype] = None
                 ) -> Iterator[Tuple[str, Tensor]]:
    """The tensors of a model shard's state dict ``sd`` with every adapter merged into its module's
    ``.weight`` (one at a time: fp32, or cast once to ``dtype``) and the ``lora_A`` / ``lora_B`` entries left
    out; other tensors unchanged. An adapter whose module has no ``.weight`` in ``sd`` raises."""
    mods = adapted_modules(sd)
    adapter_names = {n for pair in mods.values() for n in pair}
    for path in mods:
        if path + ".weight" not in sd:
            raise ValueError(f"LoRA adapter of {path!r}: the model has no {path + '.weight'!r} to merge it into")
    for name, t in sd.items():
        if name in adapter_names:
            continue
        path = name[: -len(".weight")] if name.endswith(".weight") else None
        if path in mods:
            a, b = mods[path]
            t = merged_weight(t, sd[a], sd[b], scale, name)
            if dtype is not None:
                t = t.to(dtype)
        yield name, t


def adapter_items(sd: Mapping[str, Tensor]) -> Iterator[Tuple[str, Tensor]]:
    """Only the ``lora_A`` / ``lora_B`` tensors of ``sd`` (what adapter-only sync and the PEFT export move)."""
    for name, t in sd.items():
        if name.endswith((LORA_A, LORA_B)):
            yield name, t

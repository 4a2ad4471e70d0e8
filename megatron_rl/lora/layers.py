"""Adapter layers: megatron-core's Column/RowParallelLinear with ``lora_A`` / ``lora_B`` added (``LoraLinear``).

Rule: the base keeps its parameters under the same names and the delta is added inside the base's own matmul
(``_forward_impl``), so a row-parallel delta goes through the base's single reduction (all-reduce, reduce-scatter,
or the expert dispatcher's) and is never counted TP times. Column: A full ``[r, in]`` (replicated over TP; its
gradient made whole by one all-reduce of the r-wide activation, or of dA under SP), B split by output rows like
the base. Row: A split by input columns like the base, B full ``[out, r]`` (dB all-reduced over TP). Sharding
and the reasons: docs/lora.md.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.nn.functional as F

__all__ = ["LoraLinear", "lora_class", "init_full_A", "COLUMN", "ROW"]

COLUMN, ROW = "column", "row"
_CLASSES: Dict[type, type] = {}


def init_full_A(rank: int, in_features: int, init: str, generator: torch.Generator) -> torch.Tensor:
    """The unsharded A ``[rank, in_features]`` in fp32 on the CPU, as PEFT initialises it: "kaiming" =
    nn.Linear's kaiming-uniform(a=sqrt(5)), "gaussian" = normal(0, 1/rank)."""
    a = torch.empty(rank, in_features, dtype=torch.float32)
    if init == "kaiming":
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    elif init == "gaussian":
        torch.nn.init.normal_(a, std=1.0 / rank, generator=generator)
    else:
        raise ValueError(f"actor.lora.init: unknown {init!r}")
    return a


def _tp_size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


class LoraLinear:
    """Mixin put in front of a megatron-core parallel linear class (``lora_class``); ``attach`` turns a built
    layer into an adapted one in place."""

    lora_kind: str = COLUMN
    """``column`` or ``row``: which side of the base weight is split over TP."""

    def attach(self, rank: int, scaling: float, dropout: float, full_A: torch.Tensor, tp_rank: int,
               glu: bool = False) -> None:
        """Add ``lora_A`` / ``lora_B`` (the base weight's dtype and device; B zeros, A this rank's slice of
        ``full_A``) and mark their TP sharding as megatron does for its own parameters. ``glu``: the base is a gated
        fc1 (each TP shard holds [gate block; up block]), and so is B's checkpoint layout."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        w = self.weight
        out_local, in_local = w.shape
        if self.lora_kind == COLUMN:
            a = full_A
        else:
            a = full_A[:, tp_rank * in_local:(tp_rank + 1) * in_local]
        if a.shape != (rank, in_local):
            raise ValueError(f"LoRA A of shape {tuple(a.shape)} does not fit base weight {tuple(w.shape)}")
        self.lora_A = torch.nn.Linear(in_local, rank, bias=False, device=w.device, dtype=w.dtype)
        self.lora_B = torch.nn.Linear(rank, out_local, bias=False, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()
        split = self.lora_B.weight if self.lora_kind == COLUMN else self.lora_A.weight
        set_tensor_model_parallel_attributes(split, True, 0 if self.lora_kind == COLUMN else 1, 1)
        for p in (self.lora_A.weight, self.lora_B.weight):
            if hasattr(w, "allreduce"):  # expert weights: reduced over the expert-data-parallel group
                p.allreduce = w.allreduce
        self.lora_scaling = float(scaling)
        self.lora_dropout = float(dropout)
        self.lora_enabled = True
        self.lora_glu = bool(glu)

    def _forward_impl(self, input, weight, *args, **kwargs):
        out = super()._forward_impl(input, weight, *args, **kwargs)
        if not self.lora_enabled:
            return out
        return out + self._lora_delta(input, kwargs)

    def _lora_delta(self, x: torch.Tensor, kwargs) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region)

        if self.lora_dropout and self.training:
            x = F.dropout(x, p=self.lora_dropout, training=True)
        a, b = self.lora_A.weight, self.lora_B.weight
        group = self.tp_group
        tp = _tp_size(group)
        if self.lora_kind == ROW:
            # x: this rank's input columns; the partial delta joins the base's partial output before its reduction
            if tp > 1:
                b = copy_to_tensor_model_parallel_region(b, group=group)  # dB summed over the TP ranks
            return F.linear(F.linear(x, a), b) * self.lora_scaling
        if kwargs.get("sequence_parallel"):
            # x: this rank's sequence chunk; gather the r-wide activation, not x
            a = copy_to_tensor_model_parallel_region(a, group=group)  # dA summed over the sequence chunks
            h = gather_from_sequence_parallel_region(F.linear(x, a), group=group)
        elif tp > 1:
            if not kwargs.get("allreduce_dgrad"):
                raise RuntimeError(f"LoRA on {type(self).__name__}: a TP{tp} column-parallel layer whose input "
                                   f"gradient is reduced outside it (expert tensor parallelism?) is not supported")
            # x: the whole input on every TP rank; dh summed over the ranks (each holds some of B's rows)
            h = copy_to_tensor_model_parallel_region(F.linear(x, a), group=group)
        else:
            h = F.linear(x, a)
        return F.linear(h, b) * self.lora_scaling

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None):
        """The base's entries plus ``lora_A.weight`` / ``lora_B.weight``, sharded over TP like the base weight's
        side they follow (column: B by rows; row: A by columns), the other one replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        lora = {"lora_A.weight": self.lora_A.weight, "lora_B.weight": self.lora_B.weight}
        axis = {"lora_B.weight": 0} if self.lora_kind == COLUMN else {"lora_A.weight": 1}
        kw = {"tp_group": self.tp_group}
        if metadata is not None and "dp_cp_group" in metadata:
            kw["dp_cp_group"] = metadata["dp_cp_group"]
        lora_sd = make_sharded_tensors_for_checkpoint(lora, prefix, axis, sharded_offsets, **kw)
        if self.lora_glu:  # B's rows are [gate; up] per shard, as the base weight's: saved as two halves
            key = f"{prefix}lora_B.weight"
            lora_sd[key] = _swiglu_factory(lora_sd[key], sharded_offsets, metadata, self.tp_group)
        sd.update(lora_sd)
        return sd


def _swiglu_factory(sh_ten, sharded_offsets, metadata, tp_group):
    """megatron-core's ``apply_swiglu_sharded_factory`` (its keyword arguments differ between versions)."""
    import inspect

    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    metadata = metadata or {}
    params = inspect.signature(apply_swiglu_sharded_factory).parameters
    kw = {"singleton_local_shards": metadata.get("singleton_local_shards", False)}
    if "tp_group" in params:
        kw["tp_group"] = tp_group
    if "dp_group" in params and "dp_cp_group" in metadata:
        kw["dp_group"] = metadata["dp_cp_group"]
    return apply_swiglu_sharded_factory(sh_ten, sharded_offsets, **kw)


def lora_class(base_cls: type, kind: str) -> type:
    """The adapted subclass of megatron-core linear class ``base_cls`` (one per class, cached)."""
    key = (base_cls, kind)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Lora{base_cls.__name__}", (LoraLinear, base_cls), {"lora_kind": kind})
    return _CLASSES[key]

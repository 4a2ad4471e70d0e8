"""Layout-free adapters <-> this rank's shards: the unsharded A / B of a module, keyed by its canonical name
(global layer and expert index), cut for this rank's TP shard with the converter's own split rules.

Rule: an adapter side follows the base weight side it multiplies -- column: B by the base's rows (``param_kind`` of
the base weight: qkv groups, fc1's per-shard [gate; up]), A whole; row: A by the base's columns, B whole.
"""
from __future__ import annotations

from typing import Dict, Mapping, Sequence, Tuple

import torch

from megatron_rl.convert.partition import merge_tensors, param_kind, split_tensor
from megatron_rl.lora.layers import COLUMN
from megatron_rl.lora.names import LoraTarget

__all__ = ["adapter_kinds", "tp_coords", "set_full_adapters", "adapter_key", "merge_adapter_shards"]


def adapter_key(target: LoraTarget, which: str) -> str:
    """``<canonical>.lora_A.weight`` / ``.lora_B.weight``: the layout-free name of one side."""
    return f"{target.canonical}.lora_{which}.weight"


def _local_base_name(canonical: str) -> str:
    parts = canonical.split(".", 3)  # decoder.layers.<i>.<rest>
    return parts[3] + ".weight"


def adapter_kinds(target: LoraTarget) -> Tuple[str, str]:
    """(split kind of A, split kind of B) in ``convert.partition``'s terms."""
    base = param_kind(_local_base_name(target.canonical))
    return ("replicated", base) if target.kind == COLUMN else (base, "replicated")


def tp_coords(target: LoraTarget) -> Tuple[int, int]:
    """(rank, size) of the module's tensor-parallel group (the expert TP group for experts)."""
    g = target.module.tp_group
    if g is None:
        return 0, 1
    return torch.distributed.get_rank(g), torch.distributed.get_world_size(g)


def set_full_adapters(targets: Sequence[LoraTarget], full: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's shard of every unsharded adapter in ``full`` (``adapter_key`` names) into the modules; a
    target without both sides in ``full`` is a KeyError naming it."""
    for t in targets:
        rank, size = tp_coords(t)
        for which, kind in zip("AB", adapter_kinds(t)):
            key = adapter_key(t, which)
            if key not in full:
                raise KeyError(f"adapter {key} missing")
            param = getattr(t.module, f"lora_{which}").weight
            with torch.no_grad():
                param.copy_(split_tensor(full[key], kind, rank, size, key))


def merge_adapter_shards(parts: Dict[str, Dict[int, torch.Tensor]], kinds: Mapping[str, str]) -> Dict[str, torch.Tensor]:
    """{key: {tp_rank: shard}} -> {key: unsharded tensor} (``kinds``: the split kind of each key)."""
    return {k: merge_tensors([p[r] for r in sorted(p)], kinds[k], k) for k, p in parts.items()}

"""Target names -> the modules of built megatron-core model chunks that get adapters (``find_targets``).

Rule: a module is named by its path in its chunk (what its parameters are called) and, for seeding and
layout-free keys, by its canonical name -- the GLOBAL layer index and GLOBAL expert index, so the same logical
adapter has the same name at every TP / EP / PP.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Sequence

import torch

from megatron_rl.lora.config import ALL_LINEAR, LoraConfig
from megatron_rl.lora.layers import COLUMN, ROW

__all__ = ["LoraTarget", "LoraTargetError", "find_targets", "KIND_OF"]

#: megatron-core module name -> which side of its weight is split over TP
KIND_OF = {"linear_qkv": COLUMN, "linear_fc1": COLUMN, "linear_q_proj": COLUMN, "linear_q_up_proj": COLUMN,
           "linear_kv_up_proj": COLUMN, "linear_proj": ROW, "linear_fc2": ROW,
           "linear_q_down_proj": None, "linear_kv_down_proj": None}


class LoraTargetError(ValueError):
    """A ``actor.lora.target_modules`` entry that matches nothing, or a module the adapters cannot wrap."""


@dataclass(frozen=True)
class LoraTarget:
    """One module that gets an adapter."""

    chunk: int
    """Index of the model chunk (VPP) holding it."""
    path: str
    """Its path in the chunk, e.g. ``decoder.layers.0.self_attention.linear_qkv``."""
    canonical: str
    """The path with the global layer and expert indices (the same at every layout)."""
    module: torch.nn.Module
    """The megatron-core linear layer."""
    kind: str
    """``column`` or ``row``."""


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _canonical(chunk: torch.nn.Module, path: str) -> str:
    m = _LAYER.match(path)
    if m is None:
        return path
    layer = chunk.decoder.layers[int(m.group(1))]
    out = f"decoder.layers.{layer.layer_number - 1}." + path[m.end():]
    e = _EXPERT.search(out)
    if e is not None:
        from megatron.core import parallel_state

        experts = layer.mlp.experts
        first = parallel_state.get_expert_model_parallel_rank() * experts.num_local_experts
        out = out[:e.start()] + f".local_experts.{first + int(e.group(1))}." + out[e.end():]
    return out


def _wrappable(module: torch.nn.Module) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return isinstance(module, (ColumnParallelLinear, RowParallelLinear))


def find_targets(chunks: Sequence[torch.nn.Module], cfg: LoraConfig) -> List[LoraTarget]:
    """Every module of ``chunks`` (bare megatron-core ``GPTModel`` chunks) the config targets (``apply_lora`` names
    an entry that matches none; ``LoraTargetError`` for a matched module the adapter layer cannot wrap)."""
    wanted = {name for _, name in cfg.mcore_targets()}
    out: List[LoraTarget] = []
    for ci, chunk in enumerate(chunks):
        for path, module in chunk.named_modules():
            name = path.rsplit(".", 1)[-1]
            if name not in wanted or not path.startswith("decoder."):
                continue
            kind = KIND_OF[name]
            if kind is None or not _wrappable(module):
                raise LoraTargetError(
                    f"actor.lora.target_modules: {name} ({path}) is a {type(module).__name__}; adapters are built "
                    f"for megatron-core's ColumnParallelLinear / RowParallelLinear only (megatron's local spec; "
                    f"MLA's replicated down-projections are not supported yet) -- leave {name} out of the list")
            out.append(LoraTarget(ci, path, _canonical(chunk, path), module, kind))
    return out


def matched_entries(cfg: LoraConfig, targets: Sequence[LoraTarget]) -> List[str]:
    """The written entries of ``cfg.target_modules`` that some target matched (``all-linear`` if any did)."""
    have = {t.path.rsplit(".", 1)[-1] for t in targets}
    return sorted({entry for entry, name in cfg.mcore_targets() if name in have or (entry == ALL_LINEAR and have)})

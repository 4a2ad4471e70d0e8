"""How a full Megatron GPT state dict is partitioned over TP / PP / VPP / EP / ETP ranks, and merged back.

"Full" state dict = the ``state_dict()`` of the same GPTModel built at TP1/PP1/EP1 with the local spec (global
layer and expert indices); a "shard" = one model chunk's state dict on one rank, at its ``RankCoords``. The
single implementation of these layout rules (``cut_state_dict`` / ``merge_state_dicts``): the shard files and
the live loader / gatherer all use it. Pure tensor functions: no process group, no megatron import. The rule
easiest to get wrong: a gated MLP's ``linear_fc1`` [gate; up] is cut per half (rank r holds [gate block r; up
block r]), not as one contiguous block. Every tensor's convention: docs/convert.md.

    coords = RankCoords.from_groups(groups, vp_stage=0)         # this rank's chunk 0 (parallel.ActorGroups)
    local = cut_state_dict(full, coords, num_layers=L, tied=True, padded_vocab_size=V)
    full2 = merge_state_dicts({coords: local, ...}, num_layers=L, tied=True, tp_size=2, etp_size=2)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Tuple

import torch

from megatron_rl.convert.model_state import canonical_name

if TYPE_CHECKING:  # only the type: this module stays free of process groups
    from megatron_rl.parallel.groups import ActorGroups

__all__ = ["RankCoords", "CutEntry", "param_kind", "cut_plan", "cut_state_dict", "split_selection", "take_positions",
           "merge_state_dicts", "split_tensor", "merge_tensors", "piece_views", "layer_range", "chunk_layer_range", "split_layer_name",
           "expert_index"]

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_SEQ_EXPERT_RE = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT_RE = re.compile(r"^(mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
_COLUMN_ATTENTION = tuple(f"self_attention.{x}." for x in (
    "linear_qkv", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj"))
_REPLICATED_ATTENTION = ("self_attention.linear_q_down_proj.", "self_attention.linear_kv_down_proj.")
#: A LoRA adapter of module ``P``: ``P.lora_A.weight`` / ``P.lora_B.weight`` (docs/lora.md)
_LORA_RE = re.compile(r"^(.*)\.lora_(A|B)\.weight(\d*)$")


@dataclass(frozen=True)
class RankCoords:
    """Position of one model chunk in the parallel layout (sizes and ranks per dimension)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    vp_stage: int = 0
    """Virtual pipeline chunk index on this rank (0 without VPP)."""
    vpp_size: int = 1
    """Chunks per pipeline rank (1 without VPP)."""
    first_stage_layers: Optional[int] = None
    """Layers of the first pipeline stage when it is uneven (megatron num_layers_in_first_pipeline_stage)."""
    last_stage_layers: Optional[int] = None
    """Layers of the last pipeline stage when it is uneven (megatron num_layers_in_last_pipeline_stage)."""

    @classmethod
    def from_groups(cls, groups: "ActorGroups", vp_stage: int = 0, first_stage_layers: Optional[int] = None,
                    last_stage_layers: Optional[int] = None) -> "RankCoords":
        """Coordinates of this rank's chunk ``vp_stage``: ranks from its ``ActorGroups``, sizes from their
        ``ParallelDims`` (and the uneven-stage sizes of the layout, e.g. from the model's TransformerConfig)."""
        d = groups.dims
        return cls(tp_rank=groups.tp_rank, tp_size=d.tp, pp_rank=groups.pp_rank, pp_size=d.pp,
                   ep_rank=groups.ep_rank, ep_size=d.ep, etp_rank=groups.etp_rank, etp_size=d.etp,
                   vp_stage=vp_stage, vpp_size=d.vpp, first_stage_layers=first_stage_layers,
                   last_stage_layers=last_stage_layers)

    @property
    def chunk_index(self) -> int:
        """Global pipeline chunk index (vp_stage * PP + pp_rank)."""
        return self.vp_stage * self.pp_size + self.pp_rank

    @property
    def num_chunks(self) -> int:
        """Total pipeline chunks (PP * VPP)."""
        return self.pp_size * self.vpp_size

    @property
    def is_first_chunk(self) -> bool:
        """Holds the embedding."""
        return self.chunk_index == 0

    @property
    def is_last_chunk(self) -> bool:
        """Holds the final norm and the output layer."""
        return self.chunk_index == self.num_chunks - 1


def param_kind(local_name: str) -> str:
    """How a (layer-local) parameter is split: 'vocab', 'column', 'glu_column', 'row', 'replicated',
    'expert_glu_column', 'expert_row'. Raises KeyError for names this module does not know. A LoRA adapter
    follows its base weight: a column-parallel base splits B like itself (A whole), a row-parallel one A."""
    name = local_name
    lora = _LORA_RE.match(name)
    if lora is not None:
        base = param_kind(lora.group(1) + ".weight" + lora.group(3))
        split = lora.group(2) == ("B" if base in ("column", "glu_column", "expert_glu_column") else "A")
        return base if split and base != "vocab" else "replicated"
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if name.startswith("decoder.final_layernorm.") or name.endswith("layernorm.weight") \
            or name.endswith("layernorm.bias") or ".layer_norm_" in name or name.endswith("_extra_state"):
        return "replicated"
    if name.startswith("mlp.router.") or name == "mlp.shared_experts.gate_weight" \
            or name.startswith(_REPLICATED_ATTENTION):
        return "replicated"
    expert = name.startswith("mlp.experts.")
    if name.startswith(_COLUMN_ATTENTION):
        return "column"
    if name.startswith("self_attention.linear_proj."):
        return "row" if name.endswith("weight") else "replicated"
    if ".linear_fc1." in name or re.search(r"linear_fc1\.(weight|bias)\d*$", name):
        return "expert_glu_column" if expert else "glu_column"
    if ".linear_fc2." in name or re.search(r"linear_fc2\.(weight|bias)\d*$", name):
        if re.search(r"linear_fc2\.bias\d*$", name):
            return "replicated"
        return "expert_row" if expert else "row"
    raise KeyError(f"sharding: unknown megatron parameter {local_name!r} (no TP/EP layout rule)")


def split_selection(kind: str, shape: Tuple[int, ...], rank: int, size: int, name: str,
                    padded_rows: Optional[int] = None) -> Tuple[Optional[int], Optional[torch.Tensor]]:
    """Which positions of a full tensor of ``shape`` rank ``rank``'s piece (of ``size``) holds when split as
    ``kind`` (see ``param_kind``): ``(dim, index)``, ``index`` the source positions along ``dim`` in order
    (-1: a zero padding row), or ``(None, None)`` for the whole tensor. The one implementation of the split
    rules: ``split_tensor`` applies it to a tensor, a sliced loader reads just these positions.

    ``padded_rows`` (vocab kind only): zero-pad to that many rows before the split (Megatron's padded
    vocab; None = no padding). Raises ValueError naming ``name`` when a dim does not divide."""
    if kind == "vocab" and padded_rows is not None and padded_rows != shape[0]:
        if padded_rows < shape[0] or padded_rows % size:
            raise ValueError(f"{name}: padded vocab {padded_rows} must be >= {shape[0]} rows and divisible "
                             f"by parallel size {size}")
        rows = padded_rows // size
        idx = torch.arange(rank * rows, (rank + 1) * rows)
        return 0, torch.where(idx < shape[0], idx, torch.full_like(idx, -1))
    if size == 1 or kind == "replicated":
        return None, None
    if kind in ("vocab", "column"):
        dim = 0
    elif kind in ("row", "expert_row"):
        dim = 1
    elif kind in ("glu_column", "expert_glu_column"):
        if shape[0] % (2 * size):
            raise ValueError(f"{name}: gated fc1 rows {shape[0]} not divisible by 2 x {size}")
        half, n = shape[0] // 2, shape[0] // (2 * size)
        block = torch.arange(rank * n, (rank + 1) * n)
        return 0, torch.cat([block, block + half])
    else:  # pragma: no cover - param_kind returns only the kinds above
        raise AssertionError(kind)
    if shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of shape {tuple(shape)} is not divisible by parallel size {size}")
    n = shape[dim] // size
    return dim, torch.arange(rank * n, (rank + 1) * n)


def take_positions(t: torch.Tensor, dim: Optional[int], index: Optional[torch.Tensor]) -> torch.Tensor:
    """A new tensor of the positions ``index`` of ``t`` along ``dim`` (-1: zeros); ``dim`` None: a copy."""
    if dim is None:
        return t.clone()
    valid = index >= 0  # on the host: ``t`` may be a meta (shape-only) or a device tensor
    if bool(valid.all()):
        return t.index_select(dim, index.to(t.device))
    out = t.new_zeros(t.shape[:dim] + (index.numel(),) + t.shape[dim + 1:])
    out.index_copy_(dim, valid.nonzero().flatten().to(t.device), t.index_select(dim, index[valid].to(t.device)))
    return out


def split_tensor(t: torch.Tensor, kind: str, rank: int, size: int, name: str,
                 padded_rows: Optional[int] = None) -> torch.Tensor:
    """Rank ``rank``'s piece (of ``size``) of full tensor ``t`` split as ``kind`` (``split_selection``);
    always new memory."""
    return take_positions(t, *split_selection(kind, tuple(t.shape), rank, size, name, padded_rows))


def merge_tensors(parts: List[torch.Tensor], kind: str, name: str,
                  vocab_rows: Optional[int] = None) -> torch.Tensor:
    """Inverse of ``split_tensor``: the full tensor from the pieces of ranks 0..n-1 (in order).

    Replicated pieces must be equal (else ValueError naming ``name`` and the shard). ``vocab_rows``
    (vocab kind only): keep only the first that many rows (drop vocab padding; None = keep all)."""
    if kind == "replicated" or len(parts) == 1 and kind != "vocab":
        first = parts[0]
        for i, p in enumerate(parts[1:], 1):
            if p.shape != first.shape or not torch.equal(p, first):
                raise ValueError(f"replicated tensor {name!r} differs between shard 0 and shard {i}")
        return first.clone()
    if kind == "vocab":
        full = torch.cat(parts, 0)
        return full if vocab_rows is None else full[:vocab_rows].clone()
    if kind == "column":
        return torch.cat(parts, 0)
    if kind in ("row", "expert_row"):
        return torch.cat(parts, 1)
    halves = [p.chunk(2, 0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)


def piece_views(full: torch.Tensor, kind: str, size: int) -> List[Tuple[torch.Tensor, ...]]:
    """Per rank (of ``size``), the views of ``full`` its piece fills when split as ``kind`` (not replicated), in the
    piece's order: one view, or two for the GLU kinds (the piece's halves): ``merge_tensors`` written in place."""
    if kind in ("row", "expert_row"):
        return [(v,) for v in full.chunk(size, 1)]
    if kind in ("vocab", "column"):
        return [(v,) for v in full.chunk(size, 0)]
    if kind in ("glu_column", "expert_glu_column"):
        first, second = (h.chunk(size, 0) for h in full.chunk(2, 0))
        return list(zip(first, second))
    raise ValueError(f"piece_views: kind {kind!r} is not split")


def chunk_layer_range(num_layers: int, pp_rank: int, pp_size: int, vp_stage: int = 0, vpp_size: int = 1,
                      first_stage_layers: Optional[int] = None,
                      last_stage_layers: Optional[int] = None) -> Tuple[int, int]:
    """[first, last + 1) global layers of chunk (pp_rank, vp_stage), megatron-core's placement (even split, or
    uneven first / last stages). Raises ValueError naming the sizes when the layers do not split."""
    if first_stage_layers is None and last_stage_layers is None or pp_size == 1:
        chunks = pp_size * vpp_size
        if num_layers % chunks:
            raise ValueError(f"num_layers={num_layers} not divisible by PP x VPP = {chunks}")
        n = num_layers // chunks
        c = vp_stage * pp_size + pp_rank
        return c * n, (c + 1) * n
    middle_stages = pp_size - (first_stage_layers is not None) - (last_stage_layers is not None)
    middle = num_layers - (first_stage_layers or 0) - (last_stage_layers or 0)
    counts = [middle // middle_stages if middle_stages else 0] * pp_size
    if first_stage_layers is not None:
        counts[0] = first_stage_layers
    if last_stage_layers is not None:
        counts[-1] = last_stage_layers
    if middle < 0 or sum(counts) != num_layers or any(n % vpp_size or n < vpp_size for n in counts):
        raise ValueError(f"num_layers={num_layers} does not split into pipeline stages of {counts} layers "
                         f"(num_layers_in_first_pipeline_stage={first_stage_layers}, "
                         f"num_layers_in_last_pipeline_stage={last_stage_layers}, PP={pp_size}, VPP={vpp_size})")
    per_chunk = [n // vpp_size for n in counts]
    lo = vp_stage * sum(per_chunk) + sum(per_chunk[:pp_rank])
    return lo, lo + per_chunk[pp_rank]


def layer_range(num_layers: int, c: RankCoords) -> Tuple[int, int]:
    """[first, last + 1) global layers of the chunk at ``c``."""
    return chunk_layer_range(num_layers, c.pp_rank, c.pp_size, c.vp_stage, c.vpp_size, c.first_stage_layers,
                             c.last_stage_layers)


def split_layer_name(name: str) -> Optional[Tuple[int, str]]:
    """(layer index, name inside the layer) of a ``decoder.layers.{L}.`` name, else None."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def expert_index(rest: str) -> Optional[Tuple[int, str]]:
    """(expert index, format string with {} for the index) for an expert parameter name, else None."""
    m = _SEQ_EXPERT_RE.match(rest)
    if m:
        return int(m.group(2)), m.group(1) + "{}" + m.group(3)
    m = _GROUPED_EXPERT_RE.match(rest)
    if m:
        return int(m.group(2)), m.group(1) + "{}"
    return None


@dataclass(frozen=True)
class CutEntry:
    """One tensor of a chunk's shard: where it comes from in the full state dict and how it is split."""

    local_name: str
    """Name in the chunk's state dict (stage-local layer, EP-local expert)."""
    full_name: str
    """Key of the full state dict it is cut from."""
    kind: str
    """Split kind (``param_kind``)."""
    rank: int
    """Rank of the split (TP or ETP rank)."""
    size: int
    """Size of the split (TP or ETP size)."""
    padded_rows: Optional[int] = None
    """Vocab rows after zero padding (vocab kind only)."""

    def selection(self, shape: Tuple[int, ...]) -> Tuple[Optional[int], Optional[torch.Tensor]]:
        """``split_selection`` of a full tensor of ``shape``."""
        return split_selection(self.kind, shape, self.rank, self.size, canonical_name(self.full_name),
                               self.padded_rows)


def cut_plan(names, coords: RankCoords, num_layers: int, tied: bool, num_moe_experts: int = 0,
             padded_vocab_size: Optional[int] = None, dense: bool = True, experts: bool = True) -> List[CutEntry]:
    """The tensors of the model chunk at ``coords`` among the full-state-dict ``names``, each with its split.

    The one implementation of the layout rules (layer ranges, first / last chunk tensors, the tied
    output-layer copy, expert ranges, TP / ETP splits). ``tied``: embeddings shared with the output
    layer; ``padded_vocab_size``: zero-pad the embedding / output layer to this many rows first (None:
    no padding); ``dense`` / ``experts``: include the non-expert / routed-expert tensors."""
    lo, hi = layer_range(num_layers, coords)
    if num_moe_experts and num_moe_experts % coords.ep_size:
        raise ValueError(f"num_moe_experts={num_moe_experts} not divisible by "
                         f"expert_model_parallel_size={coords.ep_size}")
    per_ep = num_moe_experts // coords.ep_size if num_moe_experts else 0
    tp_rank, tp_size = coords.tp_rank, coords.tp_size
    out: List[CutEntry] = []
    for key in names:
        if key.endswith("_extra_state"):
            continue
        name = canonical_name(key)
        in_layer = split_layer_name(name)
        if in_layer:
            layer, rest = in_layer
            if not lo <= layer < hi:
                continue
            ex = expert_index(rest)
            local_layer = f"decoder.layers.{layer - lo}."
            if ex is not None:
                e, fmt = ex
                if not experts or e // per_ep != coords.ep_rank:
                    continue
                out.append(CutEntry(local_layer + fmt.format(e % per_ep), key, param_kind(rest), coords.etp_rank,
                                    coords.etp_size))
            elif dense:
                out.append(CutEntry(local_layer + rest, key, param_kind(rest), tp_rank, tp_size))
            continue
        if name.startswith("embedding."):
            if dense and coords.is_first_chunk:
                out.append(CutEntry(name, key, param_kind(name), tp_rank, tp_size, padded_vocab_size))
            if dense and tied and coords.is_last_chunk and coords.num_chunks > 1 \
                    and name == "embedding.word_embeddings.weight":
                out.append(CutEntry("output_layer.weight", key, "vocab", tp_rank, tp_size, padded_vocab_size))
            continue
        if name.startswith("decoder.final_layernorm.") or name == "output_layer.weight":
            if dense and coords.is_last_chunk:
                out.append(CutEntry(name, key, param_kind(name), tp_rank, tp_size, padded_vocab_size))
            continue
        raise KeyError(f"cut_state_dict: unknown top-level parameter {name!r}")
    return out


def cut_state_dict(full: Mapping[str, torch.Tensor], coords: RankCoords, num_layers: int, tied: bool,
                   num_moe_experts: int = 0, padded_vocab_size: Optional[int] = None, dense: bool = True,
                   experts: bool = True) -> Dict[str, torch.Tensor]:
    """The tensors of the model chunk at ``coords`` cut from the full (TP1/PP1/EP1) state dict
    (``cut_plan`` applied to ``full``; every tensor new memory)."""
    plan = cut_plan(list(full), coords, num_layers, tied, num_moe_experts, padded_vocab_size, dense, experts)
    return {e.local_name: take_positions(full[e.full_name], *e.selection(tuple(full[e.full_name].shape)))
            for e in plan}


def merge_state_dicts(shards: Mapping[RankCoords, Mapping[str, torch.Tensor]], num_layers: int, tied: bool,
                      tp_size: int, etp_size: int, num_moe_experts: int = 0,
                      vocab_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Inverse of ``cut_state_dict``: merge per-chunk tensors (keyed by their coords; every (tp, pp,
    vp, ep, etp) position needed must be present) into the full TP1/PP1/EP1 state dict. The tied
    output-layer copy is dropped; ``vocab_size``: keep only that many embedding / output rows (drop
    padding; None keeps all). Replicated tensors must agree across shards (else ValueError naming it)."""
    pieces: Dict[str, Dict[Tuple[str, int], torch.Tensor]] = {}
    kinds: Dict[str, str] = {}
    for coords, sd in shards.items():
        lo, _ = layer_range(num_layers, coords)
        per_ep = (num_moe_experts or 0) // coords.ep_size
        for name, t in sd.items():
            if t is None or name.endswith("_extra_state"):
                continue
            name = canonical_name(name)
            in_layer = split_layer_name(name)
            if in_layer:
                layer, rest = in_layer[0] + lo, in_layer[1]
                ex = expert_index(rest)
                kind = param_kind(rest)
                if ex is not None:
                    e, fmt = ex
                    gname = f"decoder.layers.{layer}." + fmt.format(coords.ep_rank * per_ep + e)
                    key = ("etp", coords.etp_rank)
                else:
                    gname = f"decoder.layers.{layer}.{rest}"
                    key = ("tp", coords.tp_rank)
            else:
                if name == "output_layer.weight" and tied:
                    continue  # copy of the embedding on the last stage
                gname, kind, key = name, param_kind(name), ("tp", coords.tp_rank)
            pieces.setdefault(gname, {})
            kinds[gname] = kind
            prev = pieces[gname].get(key)
            if prev is not None and not torch.equal(prev, t):
                raise ValueError(f"{gname}: copies at {key[0]} rank {key[1]} differ between data/expert replicas")
            pieces[gname][key] = t
    full: Dict[str, torch.Tensor] = {}
    for gname, parts in pieces.items():
        kind = kinds[gname]
        if kind == "replicated":
            full[gname] = merge_tensors(list(parts.values()), kind, gname)
            continue
        size = etp_size if kind.startswith("expert") else tp_size
        axis = "etp" if kind.startswith("expert") else "tp"
        missing = [r for r in range(size) if (axis, r) not in parts]
        if missing:
            raise ValueError(f"{gname}: missing {axis} shard(s) {missing}")
        full[gname] = merge_tensors([parts[(axis, r)] for r in range(size)], kind, gname, vocab_size)
    return full

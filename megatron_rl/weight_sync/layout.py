"""How an engine holds the trainer's HF tensors: fused, padded and sharded over its TP ranks, so weight-sync
verification can compare EVERY parameter class by checksum (``verify.WeightVerifier``).

An ``EngineTensor`` is one tensor as the engine reports it (its own name) and how rank ``r`` of a TP-``n``
server builds it from HF tensors: each ``Piece`` (one HF tensor) is cut by its ``Shard`` rule, the pieces are
concatenated along dim 0 and, for fused MoE experts, the per-expert concatenations are stacked. Layouts:

* ``sglang_layout`` (SGLang 0.5.23's loaders; what ``/weights_checker`` reports per TP rank): q/k/v ->
  ``qkv_proj`` (q split by heads, k/v by KV heads, replicated when there are fewer KV heads than ranks),
  gate/up -> ``gate_up_proj`` (each split over ranks), o_proj / down_proj split on the input dim, experts
  -> ``experts.w13_weight [E, 2I, H]`` / ``experts.w2_weight [E, H, I]`` (split over ranks on I),
  embed_tokens / lm_head padded with zero rows to a multiple of 64 (x TP when needed) and split over ranks,
  norms, router, fp32 ``e_score_correction_bias`` replicated; any other tensor (e.g. DeepSeek MLA projections)
  is left out (unverified), never assumed whole.
* ``transformers_layout`` (the embedded engine's transformers model): HF names as they are, except the
  fused experts of transformers 5 (``mlp.experts.gate_up_proj [E, 2F, H]``, ``mlp.experts.down_proj [E, H, F]``).

HF tensors that a layout does not map (e.g. DeepSeek MLA projections on SGLang) are not verified; the
verifier reports the fraction of parameters it did verify (``weight_sync/verified_param_frac``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["Shard", "Replicated", "Split", "HeadSplit", "VocabSplit", "Piece", "EngineTensor", "sglang_layout",
           "transformers_layout", "SGLANG_VOCAB_PADDING"]

#: SGLang's ``DEFAULT_VOCAB_PADDING_SIZE``: embedding / lm_head rows are padded to a multiple of it.
SGLANG_VOCAB_PADDING = 64


class Shard:
    """How TP rank ``rank`` of ``tp`` holds (its part of) one HF tensor."""

    def take(self, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        raise NotImplementedError


class Replicated(Shard):
    """Every rank holds the whole tensor."""

    def take(self, t, rank, tp):
        return t


@dataclass(frozen=True)
class Split(Shard):
    """Rank r holds the r-th of ``tp`` equal slices along ``dim``."""

    dim: int

    def take(self, t, rank, tp):
        n = t.shape[self.dim]
        if n % tp:
            raise ValueError(f"dimension {self.dim} of size {n} does not split over {tp} TP ranks")
        return t.narrow(self.dim, rank * (n // tp), n // tp)


@dataclass(frozen=True)
class HeadSplit(Shard):
    """K/V rows of ``heads`` heads: split by heads, or (fewer heads than ranks) rank r holds head
    ``r // (tp // heads)`` (SGLang's ``QKVParallelLinear`` replication)."""

    heads: int

    def take(self, t, rank, tp):
        if self.heads >= tp:
            return Split(0).take(t, rank, tp)
        if tp % self.heads:
            raise ValueError(f"{self.heads} KV heads cannot be replicated over {tp} TP ranks")
        per = t.shape[0] // self.heads
        return t.narrow(0, (rank // (tp // self.heads)) * per, per)


@dataclass(frozen=True)
class VocabSplit(Shard):
    """Vocabulary rows padded with zeros to a multiple of ``pad`` (``pad * tp`` when that does not split over
    the ranks: SGLang's ``VocabParallelEmbedding``), then split over ranks."""

    pad: int

    def take(self, t, rank, tp):
        pad = self.pad
        rows = -(-t.shape[0] // pad) * pad
        if rows % tp:
            pad *= tp
            rows = -(-t.shape[0] // pad) * pad
        full = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype)
        full[:t.shape[0]] = t
        return Split(0).take(full, rank, tp)


@dataclass(frozen=True)
class Piece:
    """One HF tensor inside an engine tensor."""

    hf_name: str
    shard: Shard


@dataclass(frozen=True)
class EngineTensor:
    """One engine tensor: ``pieces`` concatenated on dim 0 (per expert, then stacked when ``experts`` > 0)."""

    name: str
    pieces: Tuple[Piece, ...]
    experts: int = 0

    @property
    def sources(self) -> Tuple[str, ...]:
        return tuple(p.hf_name for p in self.pieces)

    def shard(self, tensors: Mapping[str, torch.Tensor], rank: int, tp: int) -> torch.Tensor:
        """Rank ``rank``'s copy (of ``tp``) built from the HF ``tensors`` (every source present)."""
        parts = [p.shard.take(tensors[p.hf_name], rank, tp) for p in self.pieces]
        if not self.experts:
            return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        per = len(parts) // self.experts
        return torch.stack([torch.cat(parts[e * per:(e + 1) * per], 0) for e in range(self.experts)])


_LAYER = r"^(.*\.layers\.\d+\.)"
_QKV = re.compile(_LAYER + r"self_attn\.(q|k|v)_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(.*\.)(gate|up)_proj\.weight$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")
#: Tensors every SGLang TP rank holds whole. Any other tensor the rules above do not map (e.g. DeepSeek's MLA
#: projections, which SGLang splits its own way) is left out of the layout: unverified, never assumed whole.
_REPLICATED = re.compile(r"(norm\.weight|norm\.bias|\.mlp\.gate\.weight|e_score_correction_bias|"
                         r"shared_expert_gate\.weight)$")


def _grouped(names: Iterable[str], pattern: re.Pattern, key: Callable) -> Dict[tuple, Dict[str, str]]:
    out: Dict[tuple, Dict[str, str]] = {}
    for n in names:
        m = pattern.match(n)
        if m is not None:
            k, part = key(m)
            out.setdefault(k, {})[part] = n
    return out


def _experts(names: Sequence[str], stack: Callable[[str, str], str], split: Callable[[str], Shard],
             ) -> Tuple[List[EngineTensor], set]:
    """Fused expert tensors: ``stack(prefix, "gate_up"|"down")`` names them; ``split(kind)`` shards a piece."""
    groups: Dict[str, Dict[int, Dict[str, str]]] = {}
    for n in names:
        m = _EXPERT.match(n)
        if m is not None:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = n
    out, used = [], set()
    for pre, by_e in groups.items():
        ids = sorted(by_e)
        if ids != list(range(len(ids))):
            continue  # not a full expert set: left unverified
        if all({"gate", "up"} <= set(by_e[e]) for e in ids):
            pieces = tuple(Piece(by_e[e][k], split("gate_up")) for e in ids for k in ("gate", "up"))
            out.append(EngineTensor(stack(pre, "gate_up"), pieces, experts=len(ids)))
            used.update(p.hf_name for p in pieces)
        if all("down" in by_e[e] for e in ids):
            pieces = tuple(Piece(by_e[e]["down"], split("down")) for e in ids)
            out.append(EngineTensor(stack(pre, "down"), pieces, experts=len(ids)))
            used.update(p.hf_name for p in pieces)
    return out, used


def sglang_layout(hf_names: Sequence[str], num_kv_heads: int) -> List[EngineTensor]:
    """SGLang's tensors built from ``hf_names`` (see the module doc); unmapped HF tensors are left out only
    when they are part of a group SGLang fuses and a member is missing."""
    out, used = _experts(hf_names, lambda pre, k: pre + ("w13_weight" if k == "gate_up" else "w2_weight"),
                         lambda k: Split(0) if k == "gate_up" else Split(1))
    names = [n for n in hf_names if n not in used]
    for (pre, kind), parts in _grouped(names, _QKV, lambda m: ((m.group(1), m.group(3)), m.group(2))).items():
        if set(parts) == {"q", "k", "v"}:
            out.append(EngineTensor(f"{pre}self_attn.qkv_proj.{kind}",
                                    (Piece(parts["q"], Split(0)), Piece(parts["k"], HeadSplit(num_kv_heads)),
                                     Piece(parts["v"], HeadSplit(num_kv_heads)))))
            used.update(parts.values())
    for (pre,), parts in _grouped(names, _GATE_UP, lambda m: ((m.group(1),), m.group(2))).items():
        if set(parts) == {"gate", "up"}:
            out.append(EngineTensor(f"{pre}gate_up_proj.weight",
                                    (Piece(parts["gate"], Split(0)), Piece(parts["up"], Split(0)))))
            used.update(parts.values())
    for n in names:
        if n in used:
            continue
        if n.endswith(_VOCAB):
            shard: Shard = VocabSplit(SGLANG_VOCAB_PADDING)
        elif _ROW.search(n):
            shard = Split(1)
        elif _REPLICATED.search(n):
            shard = Replicated()
        else:
            continue
        out.append(EngineTensor(n, (Piece(n, shard),)))
    return out


def transformers_layout(hf_names: Sequence[str], own_names: Optional[set] = None) -> List[EngineTensor]:
    """The embedded engine's (transformers) tensors built from ``hf_names``: fused experts when the model has
    ``mlp.experts.gate_up_proj`` (transformers 5), every other tensor under its HF name; names not in
    ``own_names`` (when given) are left out."""
    out, used = [], set()
    if own_names is None or any(n.endswith("experts.gate_up_proj") for n in own_names):
        out, used = _experts(hf_names, lambda pre, k: pre + ("gate_up_proj" if k == "gate_up" else "down_proj"),
                             lambda k: Replicated())
    out += [EngineTensor(n, (Piece(n, Replicated()),)) for n in hf_names if n not in used]
    return [t for t in out if own_names is None or t.name in own_names]

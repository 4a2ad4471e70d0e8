"""Cut a full Megatron state dict into per-rank shards for a TP/PP/EP/ETP layout, and glue them back.

Pure tensor slicing — no process group, no megatron import. Conventions (megatron-core 0.16.1):
  * tensor parallel (TP): ColumnParallelLinear tensors split on dim 0, RowParallelLinear weights on
    dim 1, SwiGLU ``linear_fc1`` as ``[gate_r; up_r]`` per rank, embedding / output layer on the
    vocab dim after padding the vocab to a multiple of ``make_vocab_size_divisible_by * TP`` (default 1; padded
    rows are zeros on import and dropped on export). Norms, router, q/k norms replicated.
  * pipeline parallel (PP): even split, stage ``s`` holds global layers ``[s*L/PP, (s+1)*L/PP)``
    renumbered from 0; the embedding lives on the first stage, final norm and output layer on the
    last. With tied embeddings and PP > 1 the last stage also holds ``output_layer.weight`` (a copy
    of the embedding shard, as megatron keeps it).
  * expert parallel (EP): EP rank ``k`` holds global experts ``[k*E/EP, (k+1)*E/EP)`` renumbered from 0;
    routed-expert tensors are split over the expert-tensor-parallel size ETP (default: TP, megatron's
    default); shared experts follow TP.
A rank's model state dict is ``dense_shard(tp, pp) | expert_shard(ep, etp, pp)``.

Usage::

    layout = ShardLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    sd = rank_state_dict(full_sd, geom, layout, tp_rank=1, pp_rank=0)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.mapping import (COLUMN, GATED_COLUMN, REPLICATED, ROW, VOCAB, CheckpointMismatchError,
                                         ParamRule, param_rules)

Tensor = torch.Tensor


class LayoutError(ValueError):
    """The parallel layout does not fit the model geometry."""


@dataclass(frozen=True)
class ShardLayout:
    """Parallel layout the shards are cut for (Megatron's parameter names)."""

    tensor_model_parallel_size: int = 1
    """TP size."""
    pipeline_model_parallel_size: int = 1
    """PP size (even layer split)."""
    expert_model_parallel_size: int = 1
    """EP size (routed experts per EP rank = num_moe_experts / EP)."""
    expert_tensor_parallel_size: Optional[int] = None
    """Tensor-parallel size inside each routed expert; None means = TP (megatron's default)."""
    make_vocab_size_divisible_by: int = 1
    """Pad the vocab to a multiple of this times TP (Megatron-LM uses 128; default 1 pads only when the
    vocab is not divisible by TP). Padded logit columns must be masked by log-prob code."""
    padded_vocab_size: Optional[int] = None
    """Explicit padded vocab (rows of the full embedding / output layer); None: computed from the above."""

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        """Effective expert tensor-parallel size."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def padded_vocab(self, vocab_size: int) -> int:
        """Rows of the padded vocab: ``padded_vocab_size`` if set, else Megatron's padding (smallest
        multiple of make_vocab_size_divisible_by * TP that is >= vocab_size)."""
        if self.padded_vocab_size is not None:
            return self.padded_vocab_size
        m = self.make_vocab_size_divisible_by * self.tp
        return -(-vocab_size // m) * m

    def stage_layers(self, g: HFGeometry, pp_rank: int) -> range:
        """Global layer indices held by pipeline stage ``pp_rank``."""
        n = g.num_layers // self.pp
        return range(pp_rank * n, (pp_rank + 1) * n)

    def to_dict(self) -> dict:
        """JSON-serialisable form."""
        return dataclasses.asdict(self)

    def validate(self, g: HFGeometry) -> None:
        """Raise LayoutError naming the sizes involved if the layout cannot hold this model."""
        errs = []
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                     "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                errs.append(f"{name}={getattr(self, name)} must be >= 1")
        if self.expert_tensor_parallel_size is not None and self.expert_tensor_parallel_size < 1:
            errs.append(f"expert_tensor_parallel_size={self.expert_tensor_parallel_size} must be >= 1")
        if errs:
            raise LayoutError("; ".join(errs))
        tp = self.tp
        pv = self.padded_vocab_size
        if pv is not None and (pv < g.vocab_size or pv % tp):
            errs.append(f"padded_vocab_size={pv} must be >= vocab_size={g.vocab_size} and divisible by "
                        f"tensor_model_parallel_size={tp}")
        checks = [
            (g.num_attention_heads, "num_attention_heads", tp, "tensor_model_parallel_size"),
            (g.num_query_groups, "num_key_value_heads (num_query_groups)", tp, "tensor_model_parallel_size"),
            (g.ffn_hidden_size, "intermediate_size (ffn_hidden_size)", tp, "tensor_model_parallel_size"),
            (g.num_layers, "num_hidden_layers", self.pp, "pipeline_model_parallel_size"),
        ]
        if g.is_moe:
            checks += [
                (g.num_moe_experts, "num_experts", self.ep, "expert_model_parallel_size"),
                (g.moe_ffn_hidden_size, "moe_intermediate_size", self.etp, "expert_tensor_parallel_size"),
            ]
            if g.moe_shared_expert_intermediate_size:
                checks.append((g.moe_shared_expert_intermediate_size, "shared_expert_intermediate_size", tp,
                               "tensor_model_parallel_size"))
        elif self.ep != 1:
            errs.append(f"expert_model_parallel_size={self.ep} but {g.architecture} is a dense model (no experts)")
        for value, vname, size, sname in checks:
            if value % size:
                errs.append(f"{vname}={value} is not divisible by {sname}={size}")
        if errs:
            raise LayoutError(f"layout {self.to_dict()} does not fit {g.architecture}: " + "; ".join(errs))


def _split(t: Tensor, kind: str, n: int, r: int, padded_rows: int) -> Tensor:
    if kind == REPLICATED or n == 1 and kind != VOCAB:
        return t.clone()
    if kind == COLUMN:
        return t.chunk(n, dim=0)[r].clone()
    if kind == ROW:
        return t.chunk(n, dim=1)[r].clone()
    if kind == GATED_COLUMN:
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(n, dim=0)[r], up.chunk(n, dim=0)[r]], dim=0)
    if kind == VOCAB:
        rows = padded_rows // n
        out = t.new_zeros((rows,) + tuple(t.shape[1:]))
        lo, hi = r * rows, min((r + 1) * rows, t.shape[0])
        if hi > lo:
            out[: hi - lo] = t[lo:hi]
        return out
    raise ValueError(f"unknown shard kind {kind!r}")


def _merge(parts: List[Tensor], kind: str, full_rows: int, name: str = "") -> Tensor:
    if kind == REPLICATED:
        for i, p in enumerate(parts[1:], 1):
            if not torch.equal(p, parts[0]):
                raise CheckpointMismatchError(f"replicated tensor {name!r} differs between shard 0 and shard {i}")
        return parts[0].clone()
    if len(parts) == 1 and kind != VOCAB:
        return parts[0].clone()
    if kind == COLUMN:
        return torch.cat(parts, dim=0)
    if kind == ROW:
        return torch.cat(parts, dim=1)
    if kind == GATED_COLUMN:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if kind == VOCAB:
        return torch.cat(parts, dim=0)[:full_rows].clone()
    raise ValueError(f"unknown shard kind {kind!r}")


def _local_shape(r: ParamRule, n: int, padded_vocab: int) -> Tuple[int, ...]:
    s = list(r.mcore_shape)
    if r.shard in (COLUMN, GATED_COLUMN):
        s[0] //= n
    elif r.shard == ROW:
        s[1] //= n
    elif r.shard == VOCAB:
        s[0] = padded_vocab // n
    return tuple(s)


def _stage_rules(g: HFGeometry, layout: ShardLayout, pp_rank: int, experts: bool):
    """(rule, local name) pairs held by one pipeline stage, expert or non-expert tensors."""
    layers = layout.stage_layers(g, pp_rank)
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    n_local = (g.num_moe_experts // layout.ep) if g.is_moe else 0
    out = []
    for r in param_rules(g):
        if r.is_expert != experts:
            continue
        if r.layer is None:
            if r.mcore_template.startswith("embedding.") and not first:
                continue
            if not r.mcore_template.startswith("embedding.") and not last:
                continue
            out.append((r, r.mcore_template))
        elif r.layer in layers:
            e_local = None if r.expert is None else r.expert % n_local
            out.append((r, r.name_with(r.layer - layers.start, e_local)))
    return out


def _tied_output_rule(g: HFGeometry, layout: ShardLayout, pp_rank: int) -> Optional[ParamRule]:
    """Megatron's last stage keeps its own output_layer.weight when embeddings are tied and PP > 1."""
    if g.tie_word_embeddings and layout.pp > 1 and pp_rank == layout.pp - 1:
        return param_rules(g)[0]  # the embedding rule
    return None


def dense_shard(full: Mapping[str, Tensor], g: HFGeometry, layout: ShardLayout, tp_rank: int,
                pp_rank: int) -> Dict[str, Tensor]:
    """Non-expert tensors of (tp_rank, pp_rank), with stage-local layer numbers."""
    pv = layout.padded_vocab(g.vocab_size)
    out = {name: _split(full[r.mcore_name], r.shard, layout.tp, tp_rank, pv)
           for r, name in _stage_rules(g, layout, pp_rank, experts=False)}
    tied = _tied_output_rule(g, layout, pp_rank)
    if tied is not None:
        out["output_layer.weight"] = _split(full[tied.mcore_name], VOCAB, layout.tp, tp_rank, pv)
    return out


def expert_shard(full: Mapping[str, Tensor], g: HFGeometry, layout: ShardLayout, ep_rank: int, etp_rank: int,
                 pp_rank: int) -> Dict[str, Tensor]:
    """Routed-expert tensors of (ep_rank, etp_rank, pp_rank), with local layer and expert numbers."""
    if not g.is_moe:
        return {}
    n_local = g.num_moe_experts // layout.ep
    mine = range(ep_rank * n_local, (ep_rank + 1) * n_local)
    return {name: _split(full[r.mcore_name], r.shard, layout.etp, etp_rank, 0)
            for r, name in _stage_rules(g, layout, pp_rank, experts=True) if r.expert in mine}


def rank_state_dict(full: Mapping[str, Tensor], g: HFGeometry, layout: ShardLayout, tp_rank: int = 0,
                    pp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0) -> Dict[str, Tensor]:
    """The state dict a Megatron model (local spec) has on the rank with these coordinates."""
    layout.validate(g)
    out = dense_shard(full, g, layout, tp_rank, pp_rank)
    out.update(expert_shard(full, g, layout, ep_rank, etp_rank, pp_rank))
    return out


def dense_keys(layout: ShardLayout) -> Iterable[Tuple[int, int]]:
    """(tp_rank, pp_rank) of every non-expert shard."""
    return [(t, p) for p in range(layout.pp) for t in range(layout.tp)]


def expert_keys(g: HFGeometry, layout: ShardLayout) -> Iterable[Tuple[int, int, int]]:
    """(ep_rank, etp_rank, pp_rank) of every expert shard (none for dense models)."""
    if not g.is_moe:
        return []
    return [(e, t, p) for p in range(layout.pp) for e in range(layout.ep) for t in range(layout.etp)]


def _take(shard: Mapping[str, Tensor], name: str, shape: Tuple[int, ...], where: str) -> Tensor:
    if name not in shard:
        raise CheckpointMismatchError(f"{where}: missing tensor {name!r}")
    t = shard[name]
    if tuple(t.shape) != shape:
        raise CheckpointMismatchError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


def unshard(dense: Mapping[Tuple[int, int], Mapping[str, Tensor]],
            experts: Mapping[Tuple[int, int, int], Mapping[str, Tensor]], g: HFGeometry,
            layout: ShardLayout) -> Dict[str, Tensor]:
    """Inverse of cutting: per-rank shards -> full Megatron state dict (padding rows dropped).

    ``dense`` is keyed by (tp_rank, pp_rank), ``experts`` by (ep_rank, etp_rank, pp_rank). Every shard
    must contain exactly its expected tensors with their expected shapes; anything else raises
    CheckpointMismatchError naming the shard and tensor. With tied embeddings and PP > 1 the last
    stage's output_layer.weight must equal the embedding (megatron keeps them identical).
    """
    layout.validate(g)
    pv = layout.padded_vocab(g.vocab_size)
    missing = [k for k in dense_keys(layout) if k not in dense] + \
              [k for k in expert_keys(g, layout) if k not in experts]
    if missing:
        raise CheckpointMismatchError(f"missing shards for layout {layout.to_dict()}: {missing}")
    full: Dict[str, Tensor] = {}
    n_local = (g.num_moe_experts // layout.ep) if g.is_moe else 0
    for pp in range(layout.pp):
        used = {(t, pp): set() for t in range(layout.tp)}
        for r, name in _stage_rules(g, layout, pp, experts=False):
            shape = _local_shape(r, layout.tp, pv)
            parts = []
            for t in range(layout.tp):
                parts.append(_take(dense[(t, pp)], name, shape, f"shard tp={t} pp={pp}"))
                used[(t, pp)].add(name)
            full[r.mcore_name] = _merge(parts, r.shard, r.mcore_shape[0], name)
        tied = _tied_output_rule(g, layout, pp)
        if tied is not None:
            shape = _local_shape(tied, layout.tp, pv)
            out = _merge([_take(dense[(t, pp)], "output_layer.weight", shape, f"shard tp={t} pp={pp}")
                          for t in range(layout.tp)], VOCAB, g.vocab_size)
            for t in range(layout.tp):
                used[(t, pp)].add("output_layer.weight")
            emb = full.get(tied.mcore_name)
            if emb is not None and not torch.equal(emb, out):
                raise CheckpointMismatchError(
                    "tied embeddings: last stage output_layer.weight differs from embedding.word_embeddings.weight")
        for (t, p), names in used.items():
            extra = sorted(set(dense[(t, p)]) - names)
            if extra:
                raise CheckpointMismatchError(f"shard tp={t} pp={p}: unexpected tensor(s) {extra}")
        if not g.is_moe:
            continue
        used_e = {(e, t, pp): set() for e in range(layout.ep) for t in range(layout.etp)}
        for r, name in _stage_rules(g, layout, pp, experts=True):
            e = r.expert // n_local
            shape = _local_shape(r, layout.etp, 0)
            parts = []
            for t in range(layout.etp):
                parts.append(_take(experts[(e, t, pp)], name, shape, f"expert shard ep={e} etp={t} pp={pp}"))
                used_e[(e, t, pp)].add(name)
            full[r.mcore_name] = _merge(parts, r.shard, r.mcore_shape[0], name)
        for (e, t, p), names in used_e.items():
            extra = sorted(set(experts[(e, t, p)]) - names)
            if extra:
                raise CheckpointMismatchError(f"expert shard ep={e} etp={t} pp={p}: unexpected tensor(s) {extra}")
    return full

"""The converter's shard files: a ``ShardLayout`` (TP/PP/EP/ETP + padded vocab) checked against a model,
the non-expert / routed-expert shard of each file cut from a full state dict, and the files glued back.

A thin adapter over :mod:`megatron_rl.convert.partition`, the single implementation of the layout rules
(TP column / row / gated ``[gate_r; up_r]`` / vocab / replicated splits, PP layer ranges and first /
last-stage tensors incl. the tied output layer, EP expert ranges, ETP). This module adds what the
converter's files need: the layout (``ShardLayout``) validated against a HF geometry with errors in HF
config names, the vocab padded to a multiple of ``make_vocab_size_divisible_by * TP`` (padded rows
are zeros on import and dropped on export), shards stored as non-expert ``(tp, pp)`` and routed-expert
``(ep, etp, pp)`` files, and strict checks of every shard's tensor names and shapes on the way back.
No process group, no megatron import. A rank's model state dict is
``dense_shard(tp, pp) | expert_shard(ep, etp, pp)``.

Usage::

    layout = ShardLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    sd = rank_state_dict(full_sd, geom, layout, tp_rank=1, pp_rank=0)
    full = unshard({(tp, pp): sd, ...}, {(ep, etp, pp): sd, ...}, geom, layout)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterable, Mapping, Optional, Tuple

import torch

from megatron_rl.convert.checks import CheckpointMismatchError, LayoutError, check_state_dict
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.mapping import param_rules
from megatron_rl.convert.partition import (RankCoords, chunk_layer_range, cut_state_dict, merge_state_dicts,
                                           merge_tensors)

Tensor = torch.Tensor


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
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Uneven pipeline: layers of the first stage (None: even split), megatron's name."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven pipeline: layers of the last stage (None: even split), megatron's name."""

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
        return range(*chunk_layer_range(g.num_layers, pp_rank, self.pp, 0, 1, self.num_layers_in_first_pipeline_stage,
                                        self.num_layers_in_last_pipeline_stage))

    def coords(self, tp_rank: int = 0, pp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0) -> RankCoords:
        """``RankCoords`` of the rank with these coordinates in this layout."""
        return RankCoords(tp_rank, self.tp, pp_rank, self.pp, ep_rank, self.ep, etp_rank, self.etp,
                          first_stage_layers=self.num_layers_in_first_pipeline_stage,
                          last_stage_layers=self.num_layers_in_last_pipeline_stage)

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
        ]
        if self.num_layers_in_first_pipeline_stage is None and self.num_layers_in_last_pipeline_stage is None:
            checks.append((g.num_layers, "num_hidden_layers", self.pp, "pipeline_model_parallel_size"))
        else:
            try:
                for r in range(self.pp):
                    chunk_layer_range(g.num_layers, r, self.pp, 0, 1, self.num_layers_in_first_pipeline_stage,
                                      self.num_layers_in_last_pipeline_stage)
            except ValueError as err:
                errs.append(f"num_hidden_layers: {err}")
        if g.multi_latent_attention:
            checks = [c for c in checks if c[1] != "num_key_value_heads (num_query_groups)"]

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


def _coords(layout: ShardLayout, tp_rank: int = 0, pp_rank: int = 0, ep_rank: int = 0,
            etp_rank: int = 0) -> RankCoords:
    return layout.coords(tp_rank, pp_rank, ep_rank, etp_rank)


def _model_args(g: HFGeometry) -> dict:
    return dict(num_layers=g.num_layers, tied=g.tie_word_embeddings, num_moe_experts=g.num_moe_experts or 0)


def dense_shard(full: Mapping[str, Tensor], g: HFGeometry, layout: ShardLayout, tp_rank: int,
                pp_rank: int) -> Dict[str, Tensor]:
    """Non-expert tensors of (tp_rank, pp_rank), with stage-local layer numbers."""
    return cut_state_dict(full, _coords(layout, tp_rank, pp_rank), **_model_args(g),
                          padded_vocab_size=layout.padded_vocab(g.vocab_size), experts=False)


def expert_shard(full: Mapping[str, Tensor], g: HFGeometry, layout: ShardLayout, ep_rank: int, etp_rank: int,
                 pp_rank: int) -> Dict[str, Tensor]:
    """Routed-expert tensors of (ep_rank, etp_rank, pp_rank), with local layer and expert numbers."""
    if not g.is_moe:
        return {}
    return cut_state_dict(full, _coords(layout, pp_rank=pp_rank, ep_rank=ep_rank, etp_rank=etp_rank),
                          **_model_args(g), dense=False)


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


def _shapes(shard: Mapping[str, Tensor]) -> Dict[str, Tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in shard.items()}


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
    missing = [k for k in dense_keys(layout) if k not in dense] + \
              [k for k in expert_keys(g, layout) if k not in experts]
    if missing:
        raise CheckpointMismatchError(f"missing shards for layout {layout.to_dict()}: {missing}")
    # expected names and shapes: the same cut applied to shape-only (meta) tensors
    meta = {r.mcore_name: torch.empty(r.mcore_shape, device="meta") for r in param_rules(g)}
    shards: Dict[RankCoords, Dict[str, Tensor]] = {}
    for t, p in dense_keys(layout):
        check_state_dict(dense[(t, p)], _shapes(dense_shard(meta, g, layout, t, p)), f"shard tp={t} pp={p}")
        shards.setdefault(_coords(layout, t, p), {}).update(dense[(t, p)])
    for e, t, p in expert_keys(g, layout):
        check_state_dict(experts[(e, t, p)], _shapes(expert_shard(meta, g, layout, e, t, p)),
                         f"expert shard ep={e} etp={t} pp={p}")
        shards.setdefault(_coords(layout, pp_rank=p, ep_rank=e, etp_rank=t), {}).update(experts[(e, t, p)])
    try:
        full = merge_state_dicts(shards, tp_size=layout.tp, etp_size=layout.etp, vocab_size=g.vocab_size,
                                 **_model_args(g))
    except ValueError as err:  # replicated copies that differ between ranks
        raise CheckpointMismatchError(str(err)) from err
    if g.tie_word_embeddings and layout.pp > 1:
        out = merge_tensors([dense[(t, layout.pp - 1)]["output_layer.weight"] for t in range(layout.tp)],
                            "vocab", "output_layer.weight", g.vocab_size)
        if not torch.equal(full["embedding.word_embeddings.weight"], out):
            raise CheckpointMismatchError(
                "tied embeddings: last stage output_layer.weight differs from embedding.word_embeddings.weight")
    return full

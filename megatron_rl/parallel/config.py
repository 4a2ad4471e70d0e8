"""Typed parallel layout (Megatron's names) and its validation before any process group exists.

Layouts follow megatron-core ``parallel_state.initialize_model_parallel`` (order ``tp-cp-ep-dp-pp``):

* dense / attention part:  world = TP x CP x DP x PP           (DP is derived)
* expert (MoE) part:       world = ETP x EP x expert-DP x PP   (expert-DP is derived)

Usage::

    cfg = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    validate_parallel_config(cfg, world_size=8, model=model_cfg)  # raises ParallelConfigError

``validate_parallel_config`` collects every violation (each naming the config keys and numbers
involved) into one ``ParallelConfigError`` so a user fixes a YAML in one round trip.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional

__all__ = ["ParallelConfig", "ParallelConfigError", "validate_parallel_config", "parallel_config_from_dict"]


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work; ``violations`` lists every problem found."""

    def __init__(self, violations: List[str]):
        self.violations = list(violations)
        super().__init__("invalid parallel configuration:\n  - " + "\n  - ".join(self.violations))


@dataclass
class ParallelConfig:
    """How the model is split over ranks (the YAML ``parallel:`` section; Megatron's names)."""

    tensor_model_parallel_size: int = 1
    """TP: ranks that split each weight matrix (attention heads, MLP columns, vocab)."""
    pipeline_model_parallel_size: int = 1
    """PP: ranks that each hold a contiguous slice of the layers (stages)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """VPP: model chunks per pipeline rank for the interleaved schedule (None = no interleaving)."""
    context_parallel_size: int = 1
    """CP: ranks that split each sequence along the sequence dimension."""
    expert_model_parallel_size: int = 1
    """EP: ranks that split the set of MoE experts (each holds num_moe_experts / EP experts)."""
    expert_tensor_parallel_size: Optional[int] = None
    """ETP: ranks that split each expert's weights (None = same as tensor_model_parallel_size)."""
    sequence_parallel: bool = False
    """SP: split activations outside attention/MLP along the sequence over the TP group (needs TP > 1;
    required for MoE with TP > 1)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Uneven pipeline: layers of the first stage (None = even split); the other stages share the rest
    evenly (megatron's TransformerConfig field / Megatron-LM --decoder-first-pipeline-num-layers)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven pipeline: layers of the last stage (None = even split; Megatron-LM
    --decoder-last-pipeline-num-layers). E.g. 61 layers at PP 8: first 7, last 6, 8 on each middle stage."""

    @property
    def uneven_pipeline(self) -> bool:
        """True when the first or last pipeline stage has its own layer count."""
        return self.num_layers_in_first_pipeline_stage is not None or \
            self.num_layers_in_last_pipeline_stage is not None

    def stage_layer_counts(self, num_layers: int) -> List[int]:
        """Layers per pipeline stage (over all of its virtual chunks), megatron's split; call after
        validation."""
        pp = self.pipeline_model_parallel_size
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        if pp == 1:
            return [num_layers]
        if first is None and last is None:
            return [num_layers // pp] * pp
        middle_stages = pp - (first is not None) - (last is not None)
        middle = num_layers - (first or 0) - (last or 0)
        per = middle // middle_stages if middle_stages else 0
        counts = [per] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    @property
    def etp(self) -> int:
        """Effective expert tensor parallel size (megatron's default: ETP = TP)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world / (TP x PP x CP); call after validation."""
        return world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                              * self.context_parallel_size)

    def expert_data_parallel_size(self, world_size: int) -> int:
        """expert-DP = world / (ETP x EP x PP); call after validation."""
        return world_size // (self.etp * self.expert_model_parallel_size * self.pipeline_model_parallel_size)

    def to_dict(self) -> dict:
        """Plain dict with Megatron's key names."""
        return dataclasses.asdict(self)


def parallel_config_from_dict(d: dict) -> ParallelConfig:
    """Build a ``ParallelConfig`` from a mapping, rejecting unknown keys by name."""
    names = {f.name for f in dataclasses.fields(ParallelConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ParallelConfigError([f"unknown parallel key(s) {unknown}; valid keys: {sorted(names)}"])
    return ParallelConfig(**d)


def _get(model: Any, name: str, default: Any = None) -> Any:
    if model is None:
        return default
    if isinstance(model, dict):
        return model.get(name, default)
    return getattr(model, name, default)


def _uneven_stage_violations(cfg: ParallelConfig, layers: int) -> List[str]:
    """Megatron's rules for uneven first / last stages (TransformerConfig.__post_init__), named by key."""
    pp, vpp = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size or 1
    first, last = cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage
    middle_stages = pp - (first is not None) - (last is not None)
    middle = layers - (first or 0) - (last or 0)
    keys = " + ".join(f"parallel.{k}" for k, n in (("num_layers_in_first_pipeline_stage", first),
                                                   ("num_layers_in_last_pipeline_stage", last)) if n is not None)
    if middle < 0 or (middle_stages == 0 and middle != 0):
        return [f"{keys} = {(first or 0) + (last or 0)} layers does not fit model.num_layers={layers} with "
                f"parallel.pipeline_model_parallel_size={pp} ({middle} layers left for {middle_stages} middle stages)"]
    if middle_stages and (middle < middle_stages * vpp or middle % (middle_stages * vpp)):
        return [f"model.num_layers={layers} minus {keys} leaves {middle} layers, not a positive multiple of the "
                f"{middle_stages} other pipeline stage(s) x virtual_pipeline_model_parallel_size={vpp}"]
    return []


def validate_parallel_config(cfg: ParallelConfig, world_size: int, model: Any = None) -> None:
    """Check ``cfg`` against ``world_size`` and (optionally) the model shape; raise one
    ``ParallelConfigError`` listing every violation. ``model`` is a ``ModelConfig`` or dict with
    num_layers, num_attention_heads, num_query_groups, hidden_size, ffn_hidden_size, vocab_size,
    num_moe_experts, moe_ffn_hidden_size."""
    v: List[str] = []
    tp, pp, cp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size
    ep, vpp = cfg.expert_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    sizes = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
             "context_parallel_size": cp, "expert_model_parallel_size": ep}
    if cfg.expert_tensor_parallel_size is not None:
        sizes["expert_tensor_parallel_size"] = cfg.expert_tensor_parallel_size
    if vpp is not None:
        sizes["virtual_pipeline_model_parallel_size"] = vpp
    bad = [k for k, s in sizes.items() if not isinstance(s, int) or isinstance(s, bool) or s < 1]
    for k in bad:
        v.append(f"{k}={sizes[k]!r} must be an integer >= 1")
    if not isinstance(world_size, int) or world_size < 1:
        v.append(f"world_size={world_size!r} must be an integer >= 1")
    if bad or v:
        raise ParallelConfigError(v)
    etp = cfg.etp

    if world_size % (tp * pp * cp):
        v.append(f"world_size={world_size} is not divisible by tensor_model_parallel_size x "
                 f"pipeline_model_parallel_size x context_parallel_size = {tp}x{pp}x{cp} = {tp * pp * cp} "
                 f"(data parallel size would not be an integer)")
    if world_size % (etp * ep * pp):
        v.append(f"world_size={world_size} is not divisible by expert_tensor_parallel_size x "
                 f"expert_model_parallel_size x pipeline_model_parallel_size = {etp}x{ep}x{pp} = "
                 f"{etp * ep * pp} (megatron's expert layout: world = ETP x EP x PP x expert-DP)")
    if vpp is not None and vpp > 1 and pp < 3:
        # PP=2: prev and next stage are the same peer; megatron-core 0.16's interleaved schedule then
        # pairs activations with grads in the wrong order (observed on gloo: wrong grads, hangs).
        v.append(f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 2 "
                 f"(got {pp}; interleaving with 2 stages mis-pairs p2p messages in megatron-core 0.16)")
    if cfg.sequence_parallel and tp < 2:
        v.append(f"sequence_parallel=True needs tensor_model_parallel_size > 1 (got {tp})")
    first, last = cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage
    uneven_bad = False
    for key, n in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if n is None:
            continue
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            v.append(f"parallel.{key}={n!r} must be an integer >= 1 (or null for an even split)")
            uneven_bad = True
        elif pp < 2:
            v.append(f"parallel.{key}={n} needs parallel.pipeline_model_parallel_size > 1 (got {pp})")
            uneven_bad = True
        elif n % (vpp or 1):
            v.append(f"parallel.{key}={n} is not divisible by parallel.virtual_pipeline_model_parallel_size="
                     f"{vpp} (each virtual chunk of the stage gets the same number of layers)")
            uneven_bad = True

    if model is not None:
        layers = _get(model, "num_layers")
        heads = _get(model, "num_attention_heads")
        groups = _get(model, "num_query_groups") or heads
        hidden = _get(model, "hidden_size")
        ffn = _get(model, "ffn_hidden_size")
        vocab = _get(model, "vocab_size")
        experts = _get(model, "num_moe_experts")
        moe_ffn = _get(model, "moe_ffn_hidden_size") or ffn
        chunks = pp * (vpp or 1)
        if cfg.uneven_pipeline:
            if layers is not None and not uneven_bad:
                v += _uneven_stage_violations(cfg, layers)
        elif layers is not None and layers % chunks:
            v.append(f"num_layers={layers} is not divisible by pipeline_model_parallel_size x "
                     f"virtual_pipeline_model_parallel_size = {pp}x{vpp or 1} = {chunks}")
        if layers is not None and layers < chunks and not cfg.uneven_pipeline:
            v.append(f"num_layers={layers} < pipeline stages x virtual chunks = {chunks}")
        if heads is not None and heads % tp:
            v.append(f"num_attention_heads={heads} is not divisible by tensor_model_parallel_size={tp}")
        if groups is not None and groups % tp and not _get(model, "multi_latent_attention"):
            v.append(f"num_query_groups={groups} (KV heads) is not divisible by tensor_model_parallel_size={tp}")
        if heads is not None and groups and heads % groups:
            v.append(f"num_attention_heads={heads} is not divisible by num_query_groups={groups}")
        if ffn is not None and ffn % tp:
            v.append(f"ffn_hidden_size={ffn} is not divisible by tensor_model_parallel_size={tp}")
        if vocab is not None and vocab % tp:
            v.append(f"vocab_size={vocab} is not divisible by tensor_model_parallel_size={tp} "
                     f"(pad the vocabulary to a multiple of {tp})")
        if hidden is not None and heads and _get(model, "kv_channels") is None and hidden % heads:
            v.append(f"hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                     f"(set kv_channels explicitly)")
        if _get(model, "multi_latent_attention") and tp > 1 and not cfg.sequence_parallel:
            v.append(f"multi_latent_attention with tensor_model_parallel_size={tp} requires sequence_parallel=True "
                     f"(megatron-core 0.16's MLA reduces the RoPE-key gradient over TP only in that path)")
        if experts:
            if experts % ep:
                v.append(f"num_moe_experts={experts} is not divisible by expert_model_parallel_size={ep}")
            if moe_ffn is not None and moe_ffn % etp:
                v.append(f"moe_ffn_hidden_size={moe_ffn} is not divisible by expert_tensor_parallel_size={etp}")
            if tp > 1 and not cfg.sequence_parallel:
                v.append(f"MoE (num_moe_experts={experts}) with tensor_model_parallel_size={tp} requires "
                         f"sequence_parallel=True")
            shared = _get(model, "moe_shared_expert_intermediate_size")
            if shared and shared % tp:
                v.append(f"moe_shared_expert_intermediate_size={shared} is not divisible by "
                         f"tensor_model_parallel_size={tp}")
        elif ep > 1:
            v.append(f"expert_model_parallel_size={ep} needs an MoE model (num_moe_experts is not set)")
    if v:
        raise ParallelConfigError(v)

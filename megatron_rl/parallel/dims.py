"""``ParallelDims``: the one owner of the parallel layout's sizes, and its one validation.

Built once per job from the YAML ``parallel:`` section (``ParallelConfig``) and the world size; the
constructor IS the validation: it raises ``ParallelConfigError`` listing every violation (each naming the
config keys and numbers involved) so a user fixes a YAML in one round trip. Everything else (the job
check, megatron's process groups, ``ActorGroups``, the converter's coordinates) reads the sizes from here
instead of re-deriving them. Layouts follow megatron-core ``parallel_state.initialize_model_parallel``
(order ``tp-cp-ep-dp-pp``):

* dense / attention part:  world = TP x CP x DP x PP           (DP is derived)
* expert (MoE) part:       world = ETP x EP x expert-DP x PP   (expert-DP is derived)

Usage::

    dims = ParallelDims.build(pcfg, world_size=8, model=model_cfg)   # raises ParallelConfigError
    dims.dp, dims.edp, dims.seq_multiple, dims.interleaved
    dims = ParallelDims.from_parallel_state(sequence_parallel=True)  # the layout megatron built, same rules
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from megatron_rl.parallel.config import ParallelConfig, ParallelConfigError

__all__ = ["ParallelDims", "validate_parallel_config", "data_parallel_size", "expert_data_parallel_size"]


def data_parallel_size(cfg: ParallelConfig, world_size: int) -> Optional[int]:
    """DP at ``world_size`` ranks (``ParallelConfig.data_parallel_size``; None when it is not an integer)."""
    return cfg.data_parallel_size(world_size)


def expert_data_parallel_size(cfg: ParallelConfig, world_size: int) -> Optional[int]:
    """expert-DP at ``world_size`` ranks (``ParallelConfig.expert_data_parallel_size``; None when it is not an
    integer)."""
    return cfg.expert_data_parallel_size(world_size)


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of every parallel dimension of a validated layout (megatron's meaning of each)."""

    tp: int
    """Tensor-parallel size (tensor_model_parallel_size)."""
    pp: int
    """Pipeline-parallel size (pipeline_model_parallel_size)."""
    vpp: int
    """Virtual pipeline chunks per pipeline rank (1 without interleaving)."""
    cp: int
    """Context-parallel size (context_parallel_size)."""
    ep: int
    """Expert-model-parallel size (expert_model_parallel_size)."""
    etp: int
    """Expert-tensor-parallel size (expert_tensor_parallel_size, megatron's default = TP resolved)."""
    dp: int
    """Data-parallel size WITHOUT CP: world / (TP x PP x CP); the rollout batch is sharded over this many ranks."""
    edp: int
    """Expert-data-parallel size: world / (ETP x EP x PP); each routed expert is replicated over this many ranks."""
    world_size: int
    """Ranks in the job."""
    sequence_parallel: bool
    """Sequence parallel is on (activations outside attention / MLP split over TP along the sequence)."""

    @classmethod
    def build(cls, cfg: ParallelConfig, world_size: int, model: Any = None) -> "ParallelDims":
        """The sizes of ``cfg`` at ``world_size`` ranks, checked against megatron's layout rules and (when given)
        the model shape; raises one ``ParallelConfigError`` listing every violation. ``model`` is a
        ``ModelConfig`` or dict with num_layers, num_attention_heads, num_query_groups, hidden_size,
        ffn_hidden_size, vocab_size, num_moe_experts, moe_ffn_hidden_size."""
        violations = _violations(cfg, world_size, model)
        if violations:
            raise ParallelConfigError(violations)
        return cls(tp=cfg.tensor_model_parallel_size, pp=cfg.pipeline_model_parallel_size,
                   vpp=cfg.vpp, cp=cfg.context_parallel_size,
                   ep=cfg.expert_model_parallel_size, etp=cfg.etp, dp=data_parallel_size(cfg, world_size),
                   edp=expert_data_parallel_size(cfg, world_size), world_size=world_size,
                   sequence_parallel=bool(cfg.sequence_parallel))

    @classmethod
    def from_parallel_state(cls, sequence_parallel: bool = False) -> "ParallelDims":
        """The layout of megatron's initialised ``parallel_state`` (after ``initialize_model_parallel``), through
        :meth:`build`. ``sequence_parallel`` counts only with TP > 1 (as in megatron)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("ParallelDims: megatron parallel state is not initialised "
                               "(call megatron_rl.parallel.initialize_model_parallel first)")
        tp = ps.get_tensor_model_parallel_world_size()
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        cfg = ParallelConfig(tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                             virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
                             context_parallel_size=ps.get_context_parallel_world_size(),
                             expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                             expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
                             sequence_parallel=bool(sequence_parallel and tp > 1))
        return cls.build(cfg, dist.get_world_size())

    @property
    def num_chunks(self) -> int:
        """Model chunks of the whole pipeline (PP x VPP)."""
        return self.pp * self.vpp

    @property
    def interleaved(self) -> bool:
        """megatron's interleaved pipeline schedule runs (VPP > 1: several model chunks per pipeline rank). It
        needs >= PP micro-batches per pass and, in megatron-core 0.16, micro-batches of one shape."""
        return self.vpp > 1

    @property
    def cp_row_multiple(self) -> int:
        """A sequence (or a packed row's segment) split over CP is a multiple of this: 2 x CP with context
        parallel (megatron's zigzag split cuts it into 2 x CP equal chunks), else 1."""
        return 2 * self.cp if self.cp > 1 else 1

    @property
    def seq_multiple(self) -> int:
        """Micro-batch sequence lengths are padded to a multiple of this: TP with sequence parallel
        (activations split over TP along time), times ``cp_row_multiple`` (2 x CP with context parallel)."""
        return (self.tp if self.sequence_parallel and self.tp > 1 else 1) * self.cp_row_multiple

    def describe(self) -> str:
        """The sizes as one line, e.g. ``TP=2 PP=2 VPP=2 CP=1 DP=2 EP=2 ETP=1`` (VPP / EP / ETP only when used)."""
        s = f"TP={self.tp} PP={self.pp}"
        if self.interleaved:
            s += f" VPP={self.vpp}"
        s += f" CP={self.cp} DP={self.dp}"
        if self.ep > 1 or self.etp > 1:
            s += f" EP={self.ep} ETP={self.etp}"
        return s


def validate_parallel_config(cfg: ParallelConfig, world_size: int, model: Any = None) -> None:
    """Check only: :meth:`ParallelDims.build` without keeping the sizes (raises ``ParallelConfigError``)."""
    ParallelDims.build(cfg, world_size, model)


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


def _violations(cfg: ParallelConfig, world_size: int, model: Any) -> List[str]:
    """Every way ``cfg`` at ``world_size`` ranks (and ``model``'s shape) breaks megatron's layout rules."""
    v: List[str] = []
    tp, pp, cp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size
    ep, vpp = cfg.expert_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    sizes = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
             "context_parallel_size": cp, "expert_model_parallel_size": ep}
    if cfg.expert_tensor_parallel_size is not None:
        sizes["expert_tensor_parallel_size"] = cfg.expert_tensor_parallel_size
    if vpp is not None:
        sizes["virtual_pipeline_model_parallel_size"] = vpp
    for k, s in sizes.items():
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            v.append(f"{k}={s!r} must be an integer >= 1")
    if not isinstance(world_size, int) or world_size < 1:
        v.append(f"world_size={world_size!r} must be an integer >= 1")
    if v:
        return v
    etp = cfg.etp

    if data_parallel_size(cfg, world_size) is None:
        v.append(f"world_size={world_size} is not divisible by tensor_model_parallel_size x "
                 f"pipeline_model_parallel_size x context_parallel_size = {tp}x{pp}x{cp} = {tp * pp * cp} "
                 f"(data parallel size would not be an integer)")
    if expert_data_parallel_size(cfg, world_size) is None:
        v.append(f"world_size={world_size} is not divisible by expert_tensor_parallel_size x "
                 f"expert_model_parallel_size x pipeline_model_parallel_size = {etp}x{ep}x{pp} = "
                 f"{etp * ep * pp} (megatron's expert layout: world = ETP x EP x PP x expert-DP)")
    if cfg.interleaved and pp < 3:
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
        v += _model_violations(cfg, model, uneven_bad)
    return v


def _model_violations(cfg: ParallelConfig, model: Any, uneven_bad: bool) -> List[str]:
    """The model-shape rules of the layout: layers over pipeline chunks, heads / groups / widths / vocab over TP,
    experts over EP and ETP, and the megatron-core paths that need sequence parallel."""
    v: List[str] = []
    tp, pp, ep = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.expert_model_parallel_size
    vpp, etp = cfg.virtual_pipeline_model_parallel_size, cfg.etp
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
    return v

"""The YAML ``parallel:`` section as a typed dataclass (Megatron's names), and the error a bad layout raises.

The sizes it implies and their validation live in :mod:`megatron_rl.parallel.dims` (``ParallelDims.build``)::

    cfg = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    dims = ParallelDims.build(cfg, world_size=8, model=model_cfg)  # raises ParallelConfigError
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

__all__ = ["ParallelConfig", "ParallelConfigError", "parallel_config_from_dict"]


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
    def vpp(self) -> int:
        """Model chunks per pipeline rank (``virtual_pipeline_model_parallel_size``; 1 without interleaving)."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def interleaved(self) -> bool:
        """megatron's interleaved pipeline schedule runs: more than one model chunk per pipeline rank (the rule of
        ``ParallelDims.interleaved``, for code holding the YAML section before the layout is built)."""
        return self.vpp > 1

    @property
    def etp(self) -> int:
        """Effective expert tensor parallel size (megatron's default: ETP = TP)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def data_parallel_size(self, world_size: int) -> Optional[int]:
        """DP = world / (TP x PP x CP): ranks holding different rows of the batch; None when TP x PP x CP does not
        divide the world."""
        span = self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        return world_size // span if span >= 1 and world_size % span == 0 else None

    def expert_data_parallel_size(self, world_size: int) -> Optional[int]:
        """expert-DP = world / (ETP x EP x PP): replicas of each routed expert; None when ETP x EP x PP does not
        divide the world."""
        span = self.etp * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        return world_size // span if span >= 1 and world_size % span == 0 else None

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

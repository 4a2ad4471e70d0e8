"""``ActorGroups``: this rank's process groups and coordinates, passed explicitly to every piece of math.

Read once from megatron's ``parallel_state`` (after ``megatron_rl.parallel.initialize_model_parallel``);
everything downstream (log-prob pass, loss, metrics, checkpoints, the converter's live loading and
gathering) takes the groups from here, so no math function reads global state. The sizes are not held
here: they are the layout's ``ParallelDims`` (``groups.dims``), read through.

    groups = ActorGroups.from_parallel_state(sequence_parallel=pcfg.sequence_parallel)
    groups.dp_cp_group   # ranks holding distinct tokens: correction / metric reductions
    groups.dp_group      # data-parallel ranks WITHOUT context parallel: loss denominators
    groups.dims.dp       # the sizes (tp, pp, vpp, cp, ep, etp, dp, edp, world_size, sequence_parallel)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl.parallel.dims import ParallelDims

__all__ = ["ActorGroups"]


@dataclass(frozen=True)
class ActorGroups:
    """Process groups and ranks of this rank in megatron's layout, with the layout's sizes (``dims``)."""

    dims: ParallelDims
    """Sizes of every parallel dimension (the one owner of them)."""
    tp_group: Any
    """Tensor-parallel group (vocab-parallel log-probs)."""
    pp_group: Any
    """Pipeline-parallel group (its last rank is the last stage)."""
    cp_group: Any
    """Context-parallel group (sequences split along time over it)."""
    dp_group: Any
    """Data-parallel group without CP: ranks holding different rows of the batch."""
    dp_cp_group: Any
    """Data-parallel group with CP: ranks holding different tokens (rows x sequence chunks)."""
    ep_group: Any
    """Expert-model-parallel group (routed experts are divided over it)."""
    etp_group: Any
    """Expert-tensor-parallel group (each routed expert's weights are split over it)."""
    tp_rank: int
    """Rank in the tensor-parallel group."""
    pp_rank: int
    """Pipeline stage of this rank."""
    cp_rank: int
    """Rank in the context-parallel group."""
    dp_rank: int
    """Rank in the data-parallel group without CP (which rows of the batch)."""
    edp_rank: int
    """Expert-data-parallel rank (expert weights are replicated over this group)."""
    ep_rank: int
    """Rank in the expert-model-parallel group (which routed experts)."""
    etp_rank: int
    """Rank in the expert-tensor-parallel group."""

    # sizes: read through to ``dims``
    @property
    def tp_size(self) -> int:
        """Tensor-parallel size."""
        return self.dims.tp

    @property
    def pp_size(self) -> int:
        """Pipeline-parallel size."""
        return self.dims.pp

    @property
    def vpp_size(self) -> int:
        """Virtual pipeline chunks per rank (1 without VPP)."""
        return self.dims.vpp

    @property
    def cp_size(self) -> int:
        """Context-parallel size."""
        return self.dims.cp

    @property
    def dp_size(self) -> int:
        """Data-parallel size without CP (the rollout batch is sharded over this many ranks)."""
        return self.dims.dp

    @property
    def ep_size(self) -> int:
        """Expert-model-parallel size."""
        return self.dims.ep

    @property
    def etp_size(self) -> int:
        """Expert-tensor-parallel size."""
        return self.dims.etp

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallel is on (micro-batch lengths must be a multiple of TP)."""
        return self.dims.sequence_parallel

    @property
    def seq_multiple(self) -> int:
        """Micro-batch sequence lengths are padded to a multiple of this (``ParallelDims.seq_multiple``)."""
        return self.dims.seq_multiple

    @property
    def is_last_stage(self) -> bool:
        """This rank runs the output layer (log-probs and the loss live here)."""
        return self.pp_rank == self.dims.pp - 1

    @property
    def is_first_stage(self) -> bool:
        """This rank runs the embedding."""
        return self.pp_rank == 0

    @classmethod
    def from_parallel_state(cls, sequence_parallel: bool = False) -> "ActorGroups":
        """Groups and ranks of this rank from megatron's initialised ``parallel_state``; the sizes are
        ``ParallelDims.from_parallel_state(sequence_parallel)``."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("ActorGroups: megatron parallel state is not initialised "
                               "(call megatron_rl.parallel.initialize_model_parallel first)")
        return cls(
            dims=ParallelDims.from_parallel_state(sequence_parallel),
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            cp_group=ps.get_context_parallel_group(),
            dp_group=ps.get_data_parallel_group(with_context_parallel=False),
            dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
            ep_group=ps.get_expert_model_parallel_group(), etp_group=ps.get_expert_tensor_parallel_group(),
            tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(), dp_rank=ps.get_data_parallel_rank(with_context_parallel=False),
            edp_rank=ps.get_expert_data_parallel_rank(), ep_rank=ps.get_expert_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
        )

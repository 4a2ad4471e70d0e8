"""``ActorGroups``: the process groups and coordinates the actor passes explicitly to its math.

Read once from megatron's ``parallel_state`` (after ``megatron_rl.parallel.initialize_model_parallel``);
everything downstream (log-prob pass, loss, metrics, checkpoints) takes the groups from here, so no
math function reads global state.

    groups = ActorGroups.from_parallel_state(sequence_parallel=pcfg.sequence_parallel)
    groups.dp_cp_group   # ranks holding distinct tokens: correction / metric reductions
    groups.dp_group      # data-parallel ranks WITHOUT context parallel: loss denominators
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ActorGroups"]


@dataclass(frozen=True)
class ActorGroups:
    """Process groups, sizes and ranks of this rank in megatron's layout."""

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
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    cp_size: int
    cp_rank: int
    dp_size: int
    """Data-parallel size without CP (the rollout batch is sharded over this many ranks)."""
    dp_rank: int
    edp_rank: int
    """Expert-data-parallel rank (expert weights are replicated over this group)."""
    sequence_parallel: bool
    """Sequence parallel is on (micro-batch lengths must be a multiple of TP)."""
    ep_group: Any = None
    """Expert-model-parallel group (routed experts are divided over it)."""
    etp_group: Any = None
    """Expert-tensor-parallel group (each routed expert's weights are split over it)."""
    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0
    vpp_size: int = 1
    """Virtual pipeline chunks per rank (1 without VPP)."""

    @property
    def is_last_stage(self) -> bool:
        """This rank runs the output layer (log-probs and the loss live here)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def is_first_stage(self) -> bool:
        """This rank runs the embedding."""
        return self.pp_rank == 0

    @property
    def seq_multiple(self) -> int:
        """Micro-batch sequence lengths are padded to a multiple of this: TP with sequence parallel
        (activations split over TP along time), times 2 x CP with context parallel (zigzag halves)."""
        m = self.tp_size if self.sequence_parallel and self.tp_size > 1 else 1
        if self.cp_size > 1:
            m *= 2 * self.cp_size
        return m

    @classmethod
    def from_parallel_state(cls, sequence_parallel: bool = False) -> "ActorGroups":
        """Groups of this rank from megatron's initialised ``parallel_state``."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("ActorGroups: megatron parallel state is not initialised "
                               "(call megatron_rl.parallel.initialize_model_parallel first)")
        tp = ps.get_tensor_model_parallel_world_size()
        return cls(
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            cp_group=ps.get_context_parallel_group(),
            dp_group=ps.get_data_parallel_group(with_context_parallel=False),
            dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
            tp_size=tp, tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(with_context_parallel=False),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=False),
            edp_rank=ps.get_expert_data_parallel_rank(),
            sequence_parallel=bool(sequence_parallel and tp > 1),
            ep_group=ps.get_expert_model_parallel_group(), etp_group=ps.get_expert_tensor_parallel_group(),
            ep_size=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
            vpp_size=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        )

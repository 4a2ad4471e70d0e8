"""``PlanParts``: the job plan's sizing objects, each None where it did not build -- what ``megatron-rl check``
plans memory and the weight sync from when other keys of the job are wrong (``plan.job.plan_parts``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_rl.actor.batcher import MicroBatcher
from megatron_rl.actor.precision import Precision
from megatron_rl.actor.replay_modes import ReplayMode
from megatron_rl.models.attention import AttentionBackend
from megatron_rl.models.recompute import Recompute
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.rollout.budget import ResponseBudget
from megatron_rl.weight_sync.settings import WeightSyncSettings

__all__ = ["PlanParts"]


@dataclass(frozen=True)
class PlanParts:
    """The objects of a job's plan that size it (built by the plan's own builders)."""

    dims: Optional[ParallelDims]
    """The layout (None: the layout or the model shape is refused)."""
    budget: Optional[ResponseBudget]
    """The response budget (None: ``rollout.max_new_tokens`` / ``multi_turn.*`` refused)."""
    batcher: Optional[MicroBatcher]
    """The micro-batcher (None: the layout or the micro-batching keys are refused)."""
    precision: Precision
    """The precision to plan with (``plan.job.planning_precision``: the actor's, or the nearest one when refused)."""
    weight_sync: Optional[WeightSyncSettings]
    """The weight-sync settings (None: ``rollout.weight_sync*`` refused)."""
    recompute: Optional[Recompute]
    """The activation recomputation the job asks for, even when its combination is refused (None: unreadable)."""
    replay: Optional[ReplayMode]
    """The routing-replay mode (None: ``actor.routing_replay`` refused)."""
    attention: AttentionBackend
    """The core-attention backend, planned with ``precision`` (``local`` on any device but CUDA)."""

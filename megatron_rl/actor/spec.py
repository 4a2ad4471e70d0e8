"""What an actor is built from: ``ActorSpec``, every choice of the actor already made (by the job plan).

The actor reads no job config: its sections (model, parallel, actor) and the objects built from them once --
precision, micro-batcher, routing-replay mode, objective, learning-rate schedule -- come in one spec. Rule: the
spec's objects are shared by every actor of a job (the policy and the frozen KL reference), so none of them holds
per-actor state (R2's recorded routing lives in the actor's ``RoutingReplay``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron_rl.actor.batcher import MicroBatcher
from megatron_rl.actor.lr_schedule import LRSchedule
from megatron_rl.actor.precision import Precision
from megatron_rl.actor.replay_modes import ReplayMode
from megatron_rl.lora.apply import LoraSpec

__all__ = ["ActorSpec", "Objective"]


@dataclass(frozen=True)
class Objective:
    """The policy objective of a job as the actor applies it."""

    loss: Any
    """The ``PolicyLoss`` (``losses.build_policy_loss``): the objective's row (its name is the loss type),
    ``actor.policy_loss`` with the ``seq-mean-token-sum-norm`` divisor set from the job's response budget, and
    the mode."""
    bypass_correction: Optional[Any] = None
    """Bypass mode: the ``RolloutCorrectionConfig`` the loss applies in every micro-batch from its current
    log-probs (verl's bypass loss), else None."""


@dataclass(frozen=True)
class ActorSpec:
    """Everything ``MegatronActor`` is built from."""

    model: Any
    """The ``model:`` section (``ModelConfig``)."""
    parallel: Any
    """The ``parallel:`` section (``ParallelConfig``); megatron's parallel state must match it."""
    actor: Any
    """The ``actor:`` section (``ActorConfig``): optimizer keys, PPO sizes, ``load_hf``, recompute."""
    precision: Precision
    """Parameter dtype and output-layer precision (the one reader of ``actor.bf16``)."""
    batcher: MicroBatcher
    """How a DP shard's rows become micro-batches (its ``dims`` are the layout megatron builds)."""
    replay: ReplayMode
    """The MoE routing-replay mode (``actor.routing_replay``)."""
    objective: Objective
    """The policy objective."""
    lr_schedule: LRSchedule
    """Warm-up / decay of ``actor.lr`` in optimizer steps."""
    lora: Optional[LoraSpec] = None
    """LoRA adapters (``actor.lora`` with ``trainer.seed``), or None: every weight trained."""

"""The job plan's objects handed to the sizing tools of ``ops/``: ``memory_job`` (the memory plan's input) and
``job_sync_plan`` (the weight-sync plan). Rule: ``ops/`` never reads the job config; what it needs is built here,
from the plan's own builders (``plan.job.plan_parts``), once per call."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_rl.ops.memory import MemoryJob, total_parameters
from megatron_rl.ops.weight_sync_plan import SyncPlan, weight_sync_plan
from megatron_rl.plan.job import PlanError, plan_parts
from megatron_rl.plan.parts import PlanParts

if TYPE_CHECKING:
    from megatron_rl.config.job import JobConfig

__all__ = ["memory_job", "job_sync_plan"]


def memory_job(cfg: "JobConfig", world_size: int, parts: Optional[PlanParts] = None) -> MemoryJob:
    """What ``ops.memory.memory_plan`` reads of ``cfg`` at ``world_size`` ranks (``parts``: the plan's, when the
    caller built them); ``PlanError`` naming what did not build."""
    parts = parts or plan_parts(cfg, world_size)
    needed = (("parallel: the layout", parts.dims),
              ("rollout.max_new_tokens / multi_turn.*: the response budget", parts.budget),
              ("actor.micro_batch_size: the micro-batcher", parts.batcher))
    missing = [k for k, v in needed if v is None]
    if missing:
        raise PlanError([f"{m} did not build (the memory plan needs it)" for m in missing])
    ac, a = cfg.actor, cfg.algorithm
    kl = ac.policy_loss.kl_loss_coef > 0 or a.use_kl_in_reward  # a LoRA actor's reference is its base: no 2nd copy
    return MemoryJob(model=cfg.model, parallel=cfg.parallel, dims=parts.dims, batcher=parts.batcher,
                     budget=parts.budget, rows_per_step=cfg.data.prompts_per_step * cfg.rollout.n_samples_per_prompt,
                     ppo_mini_batches=ac.ppo_mini_batches, lora=ac.lora,
                     reference_model=bool(kl) and not ac.lora.enabled,
                     critic_model=cfg.critic.enabled(a.advantage_estimator))


def job_sync_plan(cfg: "JobConfig", total_params: Optional[int] = None, world_size: Optional[int] = None,
                  parts: Optional[PlanParts] = None) -> Optional[SyncPlan]:
    """The weight-sync plan of ``cfg`` (``total_params``: default the model's; ``world_size``: default
    ``cluster.world_size``, which with ``cluster.gpus_per_node`` places the shared-memory segments on hosts); None
    when ``rollout.weight_sync*`` did not build (its problems are ``JobPlan.collect``'s to name)."""
    world = world_size or cfg.cluster.world_size
    parts = parts or plan_parts(cfg, world)
    if parts.weight_sync is None:
        return None
    n = total_parameters(cfg.model) if total_params is None else total_params
    return weight_sync_plan(parts.weight_sync, cfg.rollout, cfg.model, cfg.parallel, parts.precision, n,
                            device=cfg.cluster.device, world_size=world,
                            ranks_per_node=min(cfg.cluster.gpus_per_node, world))

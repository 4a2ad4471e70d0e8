"""The critic's part of the job plan: ``critic_plan(cfg, ...)`` builds the ``CriticSpec`` once, or None (no critic).

Rule: the combinations the critic was not built for are refused here, each naming its key, before any process
starts: bypass mode, async rollouts, context / expert parallelism (MoE), interleaved pipelines, routing replay.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from megatron_rl.actor.critic import CriticSpec
from megatron_rl.actor.lr_schedule import LRSchedule, lr_schedule_errors
from megatron_rl.plan.checks import Unbuilt

__all__ = ["critic_plan", "critic_errors", "critic_optim_config", "OPTIMIZER_KEYS"]

#: The critic's own optimizer / schedule keys (``critic.*``): each replaces the actor key of the same name.
OPTIMIZER_KEYS = ("lr", "lr_warmup_steps", "lr_warmup_fraction", "lr_warmup_init", "lr_decay_style",
                  "lr_decay_steps", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "clip_grad",
                  "ppo_mini_batches", "ppo_epochs")


def critic_optim_config(cfg):
    """The actor section with the critic's optimizer keys (``config.critic.OPTIMIZER_KEYS``)."""
    return dataclasses.replace(cfg.actor, fp32_output_layer=False, routing_replay="none",
                               **{k: getattr(cfg.critic, k) for k in OPTIMIZER_KEYS})


def critic_errors(cfg) -> List[str]:
    """The critic section's problems and the combinations it refuses (none when no critic is trained)."""
    c, a = cfg.critic, cfg.algorithm
    errs = c.errors()
    if errs or not c.enabled(a.advantage_estimator):
        if a.advantage_estimator == "gae" and c.enable is False:
            errs.append("critic.enable: false, but algorithm.advantage_estimator: gae needs the critic's values")
        return errs
    if a.advantage_estimator != "gae":
        errs.append(f"critic.enable: true trains a critic that algorithm.advantage_estimator: "
                    f"{a.advantage_estimator!r} never reads; use gae (or critic.enable: false)")
    p = cfg.parallel
    if a.rollout_correction is not None and a.rollout_correction.bypass_mode:
        errs.append("critic.enable: not built with algorithm.rollout_correction.bypass_mode: true (the critic's "
                    "values and the bypass loss were never proven together); use bypass_mode: false")
    if cfg.rollout.mode != "sync":
        errs.append(f"critic.enable: not built with rollout.mode: {cfg.rollout.mode!r}; use sync")
    for key, v in (("context_parallel_size", p.context_parallel_size),
                   ("expert_model_parallel_size", p.expert_model_parallel_size)):
        if v > 1:
            errs.append(f"critic.enable: not built with parallel.{key}: {v} (the critic runs at DP / TP / PP)")
    if p.interleaved:
        errs.append("critic.enable: not built with parallel.virtual_pipeline_model_parallel_size (interleaved "
                    "pipeline); leave it unset")
    if cfg.model is not None and cfg.model.is_moe:
        errs.append("critic.enable: not built for an MoE model (model.num_moe_experts)")
    if cfg.actor.routing_replay != "none":
        errs.append(f"critic.enable: not built with actor.routing_replay: {cfg.actor.routing_replay!r}")
    errs += [e.replace("actor.", "critic.", 1) for e in lr_schedule_errors(critic_optim_config(cfg),
                                                                           cfg.trainer.steps)]
    return errs


def critic_plan(cfg, precision, batcher, budget) -> Optional[CriticSpec]:
    """The critic's spec (None when the job trains no critic); ``Unbuilt`` with its problems."""
    errs = critic_errors(cfg)
    if errs:
        raise Unbuilt(errs)
    c = cfg.critic
    if not c.enabled(cfg.algorithm.advantage_estimator):
        return None
    if precision is None or batcher is None or budget is None:
        raise Unbuilt([])  # the actor's keys name it
    optim = critic_optim_config(cfg)
    norm = float(budget.tokens) if c.loss_agg_mode == "seq-mean-token-sum-norm" else None
    return CriticSpec(model=cfg.model, parallel=cfg.parallel, optim=optim, precision=precision, batcher=batcher,
                      lr_schedule=LRSchedule.from_actor(optim, cfg.trainer.steps), cliprange_value=float(c.cliprange_value),
                      loss_agg_mode=c.loss_agg_mode, loss_scale_factor=norm, seed=int(cfg.trainer.seed))

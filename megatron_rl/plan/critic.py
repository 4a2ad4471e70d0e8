"""The critic's part of the job plan: ``critic_plan(cfg, ...)`` builds the ``CriticSpec`` once, or None (no critic).

Rule: the combinations the critic was not built for are refused here, each naming its key, before any process
starts: bypass mode, async rollouts, context / expert parallelism (MoE), interleaved pipelines, routing replay.
"""
from __future__ import annotations

import dataclasses
import os
from typing import List, Optional

from megatron_rl.actor.critic import CriticSpec
from megatron_rl.actor.critic_hf import ValueSource, value_source
from megatron_rl.actor.lr_schedule import LRSchedule, lr_schedule_errors
from megatron_rl.plan.checks import Unbuilt, dp_errors

__all__ = ["critic_plan", "critic_errors", "critic_dp_errors", "critic_optim_config", "critic_value", "critic_weights",
           "OPTIMIZER_KEYS", "ACTOR_DEFAULTS"]

#: The critic's own optimizer / schedule keys (``critic.*``): each replaces the actor key of the same name.
OPTIMIZER_KEYS = ("lr", "lr_warmup_steps", "lr_warmup_fraction", "lr_warmup_init", "lr_decay_style",
                  "lr_decay_steps", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "clip_grad",
                  "ppo_mini_batches", "ppo_epochs")


#: critic keys whose null means the actor's value, as verl's interpolations (critic key -> actor's value)
ACTOR_DEFAULTS = {"ppo_mini_batches": lambda a: a.ppo_mini_batches, "ppo_epochs": lambda a: a.ppo_epochs,
                  "loss_agg_mode": lambda a: a.policy_loss.loss_agg_mode}


def critic_value(cfg, key: str):
    """``critic.<key>``, or for a null one of ``ACTOR_DEFAULTS`` the actor's value (verl's default)."""
    v = getattr(cfg.critic, key)
    return ACTOR_DEFAULTS[key](cfg.actor) if v is None and key in ACTOR_DEFAULTS else v


def critic_optim_config(cfg):
    """The actor section with the critic's optimizer keys (``config.critic.OPTIMIZER_KEYS``)."""
    return dataclasses.replace(cfg.actor, fp32_output_layer=False, routing_replay="none",
                               **{k: critic_value(cfg, k) for k in OPTIMIZER_KEYS})


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


def critic_dp_errors(cfg, world_size: int) -> List[str]:
    """``critic.ppo_mini_batches`` must divide the prompts of each DP rank, as ``actor.ppo_mini_batches``."""
    c = cfg.critic
    if c.errors() or not c.enabled(cfg.algorithm.advantage_estimator) or c.ppo_mini_batches is None:
        return []  # null: the actor's, which actor.ppo_mini_batches' check names
    return [e.replace("actor.ppo_mini_batches", "critic.ppo_mini_batches", 1)
            for e in dp_errors(cfg.parallel, cfg.data.prompts_per_step, critic_value(cfg, "ppo_mini_batches"),
                               world_size)
            if e.startswith("actor.ppo_mini_batches")]


def critic_weights(cfg) -> Optional[ValueSource]:
    """The checked source of the critic's weights (``critic.load_hf``, null: ``actor.load_hf``), None: random;
    ``Unbuilt`` naming the key when its config.json cannot give the actor's model with a value head."""
    key = "critic.load_hf" if cfg.critic.load_hf else "actor.load_hf"
    path = cfg.critic.load_hf or cfg.actor.load_hf
    if not path or (key == "actor.load_hf" and not os.path.isdir(path)):
        return None  # (a missing actor.load_hf is the actor's problem, named there)
    try:
        return value_source(key, path, cfg.model)
    except (ValueError, OSError) as exc:
        raise Unbuilt([str(exc)]) from None


def critic_plan(cfg, precision, batcher, budget, recompute) -> Optional[CriticSpec]:
    """The critic's spec (None when the job trains no critic); ``Unbuilt`` with its problems. ``precision``,
    ``batcher``, ``recompute``: the actor's (the plan's objects)."""
    errs = critic_errors(cfg)
    if errs:
        raise Unbuilt(errs)
    c = cfg.critic
    if not c.enabled(cfg.algorithm.advantage_estimator):
        return None
    if precision is None or batcher is None or budget is None or recompute is None:
        raise Unbuilt([])  # the actor's keys name it
    weights = critic_weights(cfg)
    optim = critic_optim_config(cfg)
    # verl: critic.loss_scale_factor defaults to the actor's; null: the width of the response mask (the budget)
    factor = cfg.actor.policy_loss.loss_scale_factor
    mode = critic_value(cfg, "loss_agg_mode")
    norm = float(factor if factor is not None else budget.tokens) if mode == "seq-mean-token-sum-norm" else None
    return CriticSpec(model=cfg.model, parallel=cfg.parallel, optim=optim, precision=precision, batcher=batcher,
                      lr_schedule=LRSchedule.from_actor(optim, cfg.trainer.steps), cliprange_value=float(c.cliprange_value),
                      recompute=recompute,
                      loss_agg_mode=mode, loss_scale_factor=norm, seed=int(cfg.trainer.seed),
                      weights=weights)

"""``JobPlan``: every choice of a job built once from its config, before any process group exists.

    plan = JobPlan.build(cfg, world_size)        # PlanError listing every problem, each naming its dotted key
    plan, problems = JobPlan.collect(cfg, world_size)    # for tools that report and go on (check, load)
    actor = MegatronActor(plan.actor)            # the actor, the engines and the step read these objects

Rule: validation is what failed to build -- each builder raises ``Unbuilt`` with its problems (the keys' own
messages), ``collect`` gathers them in one list, and the plan exists only when that list is empty. ``describe``
is what ``megatron-rl check`` and the trainer's start print.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple, TypeVar

import torch.distributed as dist

from megatron_rl.actor.batcher import MicroBatcher
from megatron_rl.actor.lr_schedule import LRSchedule, lr_schedule_errors
from megatron_rl.actor.optimizer import offload_errors
from megatron_rl.actor.precision import Precision
from megatron_rl.actor.replay_modes import ReplayMode, replay_mode
from megatron_rl.actor.spec import ActorSpec, Objective
from megatron_rl.losses import build_policy_loss
from megatron_rl.models.attention import AttentionBackend, attention_backend, attention_errors, expected_te
from megatron_rl.models.recompute import Recompute
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.algo.estimator import Estimator
from megatron_rl.plan.advantage import build_estimator, describe_advantages
from megatron_rl.plan.lora import lora_spec
from megatron_rl.plan.parts import PlanParts
from megatron_rl.actor.critic import CriticSpec
from megatron_rl.plan.critic import critic_dp_errors, critic_plan
from megatron_rl.plan.checks import (DEVICES, ENGINES, Unbuilt, actor_size_errors, build_dims, cluster_errors,
                                     data_errors, dp_errors, lora_adapter_expert_errors, lora_target_errors,
                                     model_extra_errors, multi_turn_errors_of_job, rollout_errors,
                                     rollout_mode_errors, staleness_errors, trainer_errors, validation_errors_of_job)
from megatron_rl.plan.kl_reward import build_kl_in_reward, describe_kl_in_reward
from megatron_rl.plan.reward_checks import reward_errors_of_job
from megatron_rl.rollout.budget import ResponseBudget
from megatron_rl.rollout.factory import ENGINE_KINDS, build_engine, engine_class

if TYPE_CHECKING:  # the config package validates through this module: only its type is named here
    from megatron_rl.config.job import JobConfig

from megatron_rl.weight_sync.settings import WeightSyncSettings

__all__ = ["JobPlan", "PlanError", "actor_spec", "critic_spec", "replay_of", "budget_of", "job_engine",
           "world_errors", "plan_parts", "planning_precision", "weight_sync_of"]

T = TypeVar("T")


class PlanError(ValueError):
    """A job whose plan could not be built: ``problems``, each naming its dotted key."""

    def __init__(self, problems: List[str]):
        super().__init__("invalid config:\n  - " + "\n  - ".join(problems))
        self.problems = list(problems)


class _Problems:
    """The problems found so far; ``build`` runs one builder and keeps what failed."""

    def __init__(self) -> None:
        self.found: List[str] = []
        self.unbuilt = False

    def add(self, problems: List[str]) -> None:
        self.found += problems

    def build(self, builder: Callable[..., T], *args) -> Optional[T]:
        try:
            return builder(*args)
        except Unbuilt as exc:
            self.add(exc.problems)
        except ValueError as exc:
            self.add([str(exc)])
        self.unbuilt = True
        return None


@dataclass(frozen=True)
class JobPlan:
    """Every choice of a job, built once (module docstring)."""

    world_size: int
    """The ranks the plan was built for."""
    dims: ParallelDims
    """The parallel layout."""
    engine: type
    """The rollout engine class (``rollout.engine``)."""
    weight_sync: WeightSyncSettings
    """The weight-sync settings: the mode (``rollout.weight_sync``, ``auto`` resolved for the engine and
    ``rollout.mode``), buckets, bounds, verification."""
    budget: ResponseBudget
    """The most response-side tokens a row holds."""
    dynamic_sampling: Optional[object]
    """``algorithm.filter_groups`` when enabled (DAPO's dynamic sampling), else None."""
    precision: Precision
    """The actor's parameter dtype and output-layer precision."""
    batcher: MicroBatcher
    """How a DP shard's rows become micro-batches."""
    replay: ReplayMode
    """The MoE routing-replay mode, shared by the actor, the reference and the step generator."""
    objective: Objective
    """The policy objective."""
    lr_schedule: LRSchedule
    """Warm-up / decay of ``actor.lr``."""
    recompute: Recompute
    """megatron-core's activation recomputation (``actor.recompute_*``)."""
    attention: Optional[AttentionBackend]
    """The core-attention backend the job gets (None: ``cluster.device`` unknown)."""
    cfg: "JobConfig" = dataclasses.field(repr=False, compare=False, default=None)
    """The config the plan was built from (its sections travel into the specs)."""
    estimator: Optional[Estimator] = None
    """The advantage estimator (``algorithm.adv_estimator`` and its parameters; ``plan/advantage.py``)."""
    kl_in_reward: Optional[object] = dataclasses.field(repr=False, compare=False, default=None)
    """``algo.kl_reward.KLInReward`` (its controller holds beta) with ``algorithm.use_kl_in_reward``, else None."""
    lora: Optional[object] = None
    """``LoraSpec`` of ``actor.lora`` (adapters, base frozen), or None."""
    critic: Optional[CriticSpec] = None
    """PPO's value model (``critic:``; ``plan.critic``), or None: the job trains no critic."""

    @property
    def actor(self) -> ActorSpec:
        """What the actor (and the frozen KL reference) is built from."""
        c = self.cfg
        return ActorSpec(model=c.model, parallel=c.parallel, actor=c.actor, precision=self.precision,
                         batcher=self.batcher, replay=self.replay, objective=self.objective,
                         lr_schedule=self.lr_schedule, recompute=self.recompute, lora=self.lora)

    def build_engine(self):
        """Rank 0: the rollout engine and the SGLang server it launched, or None (``rollout.factory``)."""
        c = self.cfg
        return build_engine(c.rollout, c.actor.load_hf, c.trainer.seed, c.trainer.run_dir,
                            capture_routing=self.replay.needs_rollout_routing, lora=c.actor.lora)

    def describe(self) -> List[str]:
        """The plan in a few lines (``megatron-rl check``; the trainer's start, rank 0)."""
        r, ac = self.cfg.rollout, self.cfg.actor
        b = self.batcher
        rows = (f"token budget {b.max_tokens}" if b.max_tokens is not None else f"{b.micro_batch_size} row(s)")
        fg = self.dynamic_sampling
        lines = [f"layout: world size {self.world_size}, {self.dims.describe()}; rollout engine "
                 f"{self.engine.describe(r)}, {r.mode} rollouts; weight sync {self.weight_sync.mode.name}"
                 + (f" (LoRA {self.weight_sync.lora.mode})" if self.weight_sync.lora is not None else ""),
                 f"actor: {self.precision.describe()}; "
                 f"micro-batches of {rows}, {'packed' if b.packed else 'padded'}; routing replay {self.replay.name}; "
                 f"{ac.ppo_epochs} epoch(s) x {ac.ppo_mini_batches} mini-batch(es) per step",
                 f"response budget: {self.budget.tokens} tokens ({self.budget.key}); dynamic sampling: "
                 + (f"{fg.metric}, up to {fg.max_num_gen_batches} round(s), on_exhausted {fg.on_exhausted}"
                    if fg is not None else "off"),
                 self.objective_line()]
        if self.estimator is not None:
            lines.append(describe_advantages(self.estimator, self.cfg.algorithm.rollout_correction))
        if self.kl_in_reward is not None:
            lines.append(describe_kl_in_reward(self.kl_in_reward))
        if self.lora is not None:
            lc = self.lora.config
            lines.append(f"LoRA: rank {lc.rank}, alpha {lc.alpha:g}, on {', '.join(lc.target_modules)}; base frozen, "
                         f"KL reference = base (adapters off)")
        if self.critic is not None:
            cc, co = self.cfg.critic, self.critic.optim  # co: the critic's resolved optimizer keys
            lines.append(f"critic: value head on the actor's layout; lr {cc.lr}, {co.ppo_epochs} epoch(s) x "
                         f"{co.ppo_mini_batches} mini-batch(es), cliprange_value {cc.cliprange_value}, "
                         f"{self.critic.loss_agg_mode}, critic_warmup {cc.critic_warmup}: the first "
                         f"{max(cc.critic_warmup - 1, 0)} step(s) train the critic alone (verl's comparison)")
            if self.critic.weights is not None:
                lines.append(self.critic.weights.line())
        return lines

    def objective_line(self) -> str:
        """The objective, its mode and the parameters it reads (``PolicyLoss.summary``)."""
        return self.objective.loss.summary()

    @classmethod
    def build(cls, cfg: "JobConfig", world_size: int, has_te: Optional[bool] = None) -> "JobPlan":
        """The plan of ``cfg`` at ``world_size`` ranks; ``PlanError`` listing every problem."""
        plan, problems = cls.collect(cfg, world_size, has_te)
        if plan is None:
            raise PlanError(problems or ["plan: could not be built"])
        return plan

    @classmethod
    def collect(cls, cfg: "JobConfig", world_size: int,
                has_te: Optional[bool] = None) -> Tuple[Optional["JobPlan"], List[str]]:
        """(the plan, or None when anything failed to build; every problem, each line starting with its dotted
        key). ``has_te``: Transformer Engine on the machines the job runs on (None: ``models.attention.
        expected_te``), which decides the attention backend and what it refuses."""
        p = _Problems()
        r, d, a, ac, t, c = cfg.rollout, cfg.data, cfg.algorithm, cfg.actor, cfg.trainer, cfg.cluster
        if cfg.model is None and not ac.load_hf:
            p.add(["model: missing (give a model section or actor.load_hf with a config.json)"])
        dims = p.build(build_dims, cfg.parallel, cfg.model, world_size)
        p.add(cluster_errors(c))
        p.add(rollout_errors(r, a.advantage_estimator))
        engine = engine_class(r.engine) if r.engine in ENGINE_KINDS else None
        p.add(data_errors(d, a.advantage_estimator))
        dynamic = p.build(_dynamic_sampling, cfg)
        estimator = p.build(build_estimator, cfg)
        kl_in_reward = p.build(build_kl_in_reward, a)
        budget = p.build(_budget, r, cfg.multi_turn)
        objective = p.build(_objective, a.rollout_correction, ac.policy_loss, budget)
        lr_schedule = p.build(_lr_schedule, ac, t.steps)
        p.add(actor_size_errors(ac))
        batcher = p.build(_batcher, dims, ac, cfg.parallel)
        precision = p.build(_precision, ac)
        # actor.optimizer_cpu_offload: megatron's limits and the installed version, with the precision asked for
        p.add(offload_errors(ac, precision=precision or Precision.requested(ac)))
        if ac.load_hf is not None and not os.path.isdir(ac.load_hf):
            p.add([f"actor.load_hf: {ac.load_hf!r} is not a directory"])
        replay = p.build(_replay, ac.routing_replay, cfg.model)
        p.add(trainer_errors(t, d.max_reward_failure_frac))
        p.add(rollout_mode_errors(r))
        ws = p.build(weight_sync_of, r, t.run_dir, ac.lora)
        p.add(lora_adapter_expert_errors(cfg))
        p.add(staleness_errors(r, t))
        p.add(validation_errors_of_job(cfg, world_size))
        p.add(multi_turn_errors_of_job(cfg))
        p.add(reward_errors_of_job(cfg))  # reward.judge / reward.model (plan/reward_checks.py)
        p.add(dp_errors(cfg.parallel, d.prompts_per_step, ac.ppo_mini_batches, world_size))
        p.add(critic_dp_errors(cfg, world_size))
        attention = None
        if c.device in DEVICES:  # bf16 through Precision (the fp32_output_layer problem does not change it)
            attention = _attention(c.device, has_te, precision or Precision.requested(ac))
            p.add(attention_errors(attention, bool(ac.sequence_packing), cfg.parallel.context_parallel_size))
        p.add(model_extra_errors(cfg.model))
        recompute = p.build(_recompute, ac, cfg.model, cfg.parallel)
        lora = p.build(lora_spec, cfg)
        critic = p.build(critic_plan, cfg, precision, batcher, budget, recompute)
        if lora is not None and critic is not None:
            p.add(["critic.enable: a critic beside actor.lora is not built (the critic would train its whole body "
                   "next to a frozen, adapted actor); train the critic without LoRA or use a critic-free estimator"])
        if p.found or p.unbuilt or engine is None or cfg.model is None:
            return None, p.found
        return cls(world_size=world_size, dims=dims, engine=engine, weight_sync=ws, budget=budget,
                   dynamic_sampling=dynamic, precision=precision, batcher=batcher, replay=replay,
                   objective=objective, lr_schedule=lr_schedule, recompute=recompute, attention=attention,
                   cfg=cfg, estimator=estimator, kl_in_reward=kl_in_reward, lora=lora, critic=critic), []


def _dynamic_sampling(cfg) -> Optional[object]:
    """``algorithm.filter_groups`` when enabled; ``Unbuilt`` with its problems (only a data file's reward, not
    math / exact, returns dicts)."""
    fg = cfg.algorithm.filter_groups
    if fg is None:
        return None
    dict_rewards = cfg.data.task == "file" and cfg.data.reward_fn not in ("math", "exact") and cfg.multi_turn.env is None
    errs = fg.errors(dict_rewards)
    if errs:
        raise Unbuilt(errs)
    return fg if fg.enable else None


def _budget(rollout, multi_turn) -> ResponseBudget:
    """The response budget; its problems are the ``rollout`` / ``multi_turn`` checks' to name."""
    try:
        return ResponseBudget.of(rollout, multi_turn)
    except ValueError:
        raise Unbuilt([]) from None


def _objective(corr, policy_loss, budget: Optional[ResponseBudget]) -> Objective:
    """The policy objective of ``algorithm.rollout_correction`` and ``actor.policy_loss``; the
    ``seq-mean-token-sum-norm`` divisor from the response budget."""
    if corr is None or policy_loss is None:
        raise Unbuilt(["algorithm.rollout_correction: missing" if corr is None else "actor.policy_loss: missing"])
    errs = corr.objective.parameter_errors(policy_loss)  # the row looked up when the section was read
    if errs:
        raise Unbuilt(errs)
    if budget is None or budget.tokens < 1:
        raise Unbuilt([])  # rollout.max_new_tokens / multi_turn.* name it
    try:  # the objective's row (looked up when the section was read) with its settings, built once
        loss = build_policy_loss(policy_loss, corr.objective, corr.bypass_mode, budget.tokens)
    except ValueError as exc:
        raise Unbuilt([str(exc)]) from exc
    return Objective(loss=loss, bypass_correction=corr if corr.bypass_mode else None)


def _attention(device: str, has_te: Optional[bool], precision: Precision) -> AttentionBackend:
    """The core-attention backend on ``device`` (``has_te``: see ``JobPlan.collect``): the one site that picks it."""
    return attention_backend(device, expected_te(device, has_te)[0], precision.bf16)


def weight_sync_of(rollout, run_dir: str, lora=None) -> WeightSyncSettings:
    """The weight-sync settings of a ``rollout`` section (``run_dir``: ``trainer.run_dir``; ``lora``: ``actor.lora``),
    the one site that builds them (``WeightSyncSettings.checked`` with every engine class and the LoRA target
    check); ``Unbuilt`` with every ``rollout.weight_sync*`` / ``rollout.lora_sync`` problem."""
    return WeightSyncSettings.checked(rollout, run_dir, ENGINES, lora, lora_target_errors(rollout, lora))


def _precision(ac) -> Precision:
    """The actor's checked ``Precision`` (``actor.bf16``, ``actor.fp32_output_layer``): the one site that builds it."""
    return Precision.from_actor_config(ac)


def planning_precision(ac) -> Precision:
    """The precision to plan memory with: the actor's, or when refused what ``actor.bf16`` /
    ``actor.fp32_output_layer`` ask for (``Precision.requested``)."""
    try:
        return _precision(ac)
    except ValueError:
        return Precision.requested(ac)


def _lr_schedule(ac, steps: int) -> LRSchedule:
    if not ac.lr > 0:
        raise Unbuilt([f"actor.lr: must be > 0, got {ac.lr}"])
    errs = lr_schedule_errors(ac, steps)  # warm-up / decay keys
    if errs:
        raise Unbuilt(errs)
    return LRSchedule.from_actor(ac, steps)


def _batcher(dims: Optional[ParallelDims], ac, parallel) -> MicroBatcher:
    errs = MicroBatcher.config_errors(ac, parallel)  # a token budget's refusals
    if errs or dims is None:
        raise Unbuilt(errs)
    return MicroBatcher.build(dims, ac)


def _replay(name, model) -> ReplayMode:
    """The routing-replay mode of ``actor.routing_replay`` (the one site that builds it) for ``model``."""
    replay = replay_mode(name)  # ValueError naming the key
    if replay.needs_moe and model is not None and not model.is_moe:
        raise Unbuilt([f"actor.routing_replay: {replay.name!r} needs an MoE model (model.num_moe_experts is not set)"])
    if replay.needs_rollout_routing and model is not None and model.extra.get("moe_router_fusion"):
        raise Unbuilt([f"actor.routing_replay: {replay.name!r} needs megatron's unfused router "
                       f"(model.extra.moe_router_fusion)"])
    return replay


def _recompute(ac, model, parallel) -> Recompute:
    """``actor.recompute_*`` under megatron-core's rules, bounded by the layers of a pipeline stage."""
    rc, errs = _recompute_asked(ac, model, parallel)
    if errs:
        raise Unbuilt(errs)
    return rc


def _recompute_asked(ac, model, parallel) -> Tuple[Recompute, List[str]]:
    """(the recomputation ``actor.recompute_*`` asks for -- the one site that builds it --, its problems)."""
    rc = Recompute.from_actor(ac)
    stages = parallel.stage_layer_counts(model.num_layers) if model is not None else ()
    return rc, rc.errors(stages, moe_grouped_gemm=bool(model and model.moe_grouped_gemm),
                         multi_latent_attention=bool(model and model.multi_latent_attention))


def actor_spec(cfg: "JobConfig", world_size: Optional[int] = None) -> ActorSpec:
    """The actor's part of the plan alone (tests and tools that build an actor without a whole job): the layout,
    precision, micro-batcher, replay mode, objective, schedule and recomputation; ``PlanError`` naming what failed.
    ``world_size``: default the process group's (1 without one)."""
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    p = _Problems()
    dims = p.build(build_dims, cfg.parallel, cfg.model, world_size)
    corr, ac = cfg.algorithm.rollout_correction, cfg.actor
    objective = p.build(_objective, corr, ac.policy_loss, p.build(_budget, cfg.rollout, cfg.multi_turn))
    spec = dict(precision=p.build(_precision, ac), batcher=p.build(_batcher, dims, ac, cfg.parallel),
                replay=p.build(_replay, ac.routing_replay, cfg.model), objective=objective,
                lr_schedule=p.build(_lr_schedule, ac, cfg.trainer.steps), lora=p.build(lora_spec, cfg),
                recompute=p.build(_recompute, ac, cfg.model, cfg.parallel))
    if p.found or p.unbuilt:
        raise PlanError(p.found or ["actor: the plan could not be built"])
    return ActorSpec(model=cfg.model, parallel=cfg.parallel, actor=ac, **spec)


def critic_spec(cfg: "JobConfig", world_size: Optional[int] = None) -> CriticSpec:
    """The critic's part of the plan alone (tests and tools): the actor's layout, precision and micro-batcher with
    the critic's keys; ``PlanError`` naming what failed, or when the job trains no critic."""
    a = actor_spec(cfg, world_size)
    try:
        spec = critic_plan(cfg, a.precision, a.batcher, _budget(cfg.rollout, cfg.multi_turn), a.recompute)
    except Unbuilt as exc:
        raise PlanError(exc.problems or ["critic: the plan could not be built"]) from None
    if spec is None:
        raise PlanError(["critic.enable: the job trains no critic (set critic.enable: true or advantage_estimator: gae)"])
    return spec


def replay_of(cfg: "JobConfig") -> ReplayMode:
    """The routing-replay mode of a validated config alone (a step generator built without a job's plan)."""
    return _replay(cfg.actor.routing_replay, cfg.model)


def budget_of(cfg: "JobConfig") -> ResponseBudget:
    """The response budget (with a multi-turn job's ``TurnLimits``) of a validated config alone (a step generator
    built without a job's plan)."""
    return ResponseBudget.of(cfg.rollout, cfg.multi_turn)


def dynamic_sampling_of(cfg: "JobConfig"):
    """The dynamic-sampling choice of a validated config alone (``algorithm.filter_groups`` when enabled, else None;
    a step generator built without a job's plan)."""
    return _dynamic_sampling(cfg)


def job_engine(cfg: "JobConfig"):
    """The rollout engine of a validated config alone (tests and tools without a whole job's plan)."""
    return build_engine(cfg.rollout, cfg.actor.load_hf, cfg.trainer.seed, cfg.trainer.run_dir,
                        capture_routing=replay_of(cfg).needs_rollout_routing, lora=cfg.actor.lora)


def world_errors(cfg: "JobConfig", world_size: int) -> List[str]:
    """The problems that depend on the world size (a different node count may fix them)."""
    try:
        build_dims(cfg.parallel, cfg.model, world_size)
        layout: List[str] = []
    except Unbuilt as exc:
        layout = [e for e in exc.problems if e.startswith("world size:")]
    return (layout + dp_errors(cfg.parallel, cfg.data.prompts_per_step, cfg.actor.ppo_mini_batches, world_size)
            + critic_dp_errors(cfg, world_size))


def plan_parts(cfg: "JobConfig", world_size: int, has_te: Optional[bool] = None) -> PlanParts:
    """The plan's sizing objects alone, each None where it did not build (``megatron-rl check`` plans memory and
    the weight sync from them even when other keys are wrong; the problems are ``JobPlan.collect``'s to name)."""
    p = _Problems()
    dims = p.build(build_dims, cfg.parallel, cfg.model, world_size)
    ac = cfg.actor
    precision = planning_precision(ac)
    return PlanParts(dims=dims, budget=p.build(_budget, cfg.rollout, cfg.multi_turn),
                     batcher=p.build(_batcher, dims, ac, cfg.parallel), precision=precision,
                     attention=_attention(cfg.cluster.device, has_te, precision),
                     weight_sync=p.build(weight_sync_of, cfg.rollout, cfg.trainer.run_dir, ac.lora),
                     recompute=(p.build(_recompute_asked, ac, cfg.model, cfg.parallel) or (None,))[0],
                     replay=p.build(_replay, ac.routing_replay, cfg.model))

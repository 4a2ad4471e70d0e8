"""Building an RL job: everything a step needs, with every mode chosen once, and its checkpoints.

    job = build_job(cfg)        # every rank: the plan (JobPlan), process groups, actor, reference, task + engine
                                # (rank 0), resume, the first weight sync, the rollout source and its publisher
    ... train_step(job, step) ...
    job.checkpoint(step, stopping)
    job.close(step)

Set-up order (``build_job``): the run directory is refused or accepted before any process group or model
(``run_dir.py``); the data file and the validation files are checked; the job plan is built (``megatron_rl.plan``;
rank 0 prints it); process groups, the actor and (``kl_loss_coef`` > 0 or ``use_kl_in_reward``) the frozen reference are built from it; rank 0 starts over (``trainer.overwrite``), builds the task,
the engine (``rollout.factory``; a failure there is raised on every rank), the prompt draw (``prompt_draw``) and,
when it is evaluated, the validation set (``tasks.val_set``); ``--resume`` loads the newest COMPLETE checkpoint rank 0
chose (rank 0's prompt draw continues its order); the engine gets the starting weights; then the rollout source starts
(async: the producer thread).

Checkpoints (``Job.checkpoint``): the source's drain (async rollouts a checkpoint must hold, bounded by half of
``trainer.checkpoint_timeout_s`` per generation round dynamic sampling may take, ``config.timeouts``; the last
checkpoint, after ``trainer.steps``, waits for none and keeps those already made), then every rank writes its part
and rank 0 marks it COMPLETE. The checkpoint's watchdog (``checkpoint_phase_timeout_s``) is
``trainer.checkpoint_timeout_s``; async, half of it to save after the other ranks' bounded wait for the drain.
A failed drain still writes the checkpoint (without the rollouts: ``--resume`` regenerates them) and then raises
``AsyncDrainError`` on every rank. Rank 0 adds the prompt order's position (``PromptDraw.state``) at the checkpoint's step and at each step whose
rollouts it holds, so the resumed run draws on from whichever it regenerates first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron_rl.actor import MegatronActor
from megatron_rl.actor.critic import MegatronCritic
from megatron_rl.actor.offload import ParkedParams
from megatron_rl.actor.schedule import actor_device
from megatron_rl.algo.kl_reward import KLInReward, NoKLInReward
from megatron_rl.config import ConfigError, JobConfig
from megatron_rl.config.timeouts import checkpoint_phase_key, checkpoint_phase_timeout_s, judge_batch_budget_s
from megatron_rl.parallel.launch import init_distributed
from megatron_rl.parallel.rank0 import on_rank0, share_from_rank0
from megatron_rl.parallel.state import initialize_model_parallel
from megatron_rl.plan import JobPlan, actor_spec
from megatron_rl.rollout.sglang_server import SGLangServerHandle
from megatron_rl.tasks import build_task as build_task_for
from megatron_rl.tasks.judge import JudgedTask
from megatron_rl.tokenizer import load_tokenizer
from megatron_rl.rollout.versions import version_tag
from megatron_rl.trainer.critic_step import CriticPhase, NoCritic
from megatron_rl.trainer.prompt_draw import PromptDraw
from megatron_rl.trainer.rollout_phase import build_step_generator
from megatron_rl.trainer.rollout_source import RolloutSource, build_rollout_source
from megatron_rl.trainer.run_dir import complete_steps, run_dir_error, start_over, trim_to_step
from megatron_rl.trainer.signals import StopRequested
from megatron_rl.trainer.sinks import MetricSinks
from megatron_rl.trainer.startup import check_data
from megatron_rl.tasks.rm_task import RewardModelTask
from megatron_rl.tasks.val_set import build_val_set
from megatron_rl.trainer.validation import Validation
from megatron_rl.trainer.step_batch import StepBatch
from megatron_rl.trainer.watchdog import Watchdog
from megatron_rl.weight_sync.publisher import build_weight_publisher, deferred_publisher

__all__ = ["Job", "build_job", "setup_distributed", "build_task", "latest_checkpoint", "save", "KLReference",
           "NoReference"]


KL_CTRL_STATE_KEY = "kl_ctrl_in_reward"
"""The checkpoint's extra-state key of the KL-in-reward controller (``KLInReward.state_dict``)."""


def setup_distributed(cfg: JobConfig, plan: Optional[JobPlan] = None):
    """Process groups, megatron's parallel state (with the CPU patches when there is no GPU), the actor (of
    ``plan``; default: the actor's part of the plan of ``cfg`` at this world size, ``plan.actor_spec``)."""
    if not dist.is_initialized():
        init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
    initialize_model_parallel(cfg.parallel, seed=cfg.trainer.seed, model=cfg.model,
                              distributed_timeout_minutes=cfg.trainer.collective_timeout_s / 60)
    return MegatronActor(plan.actor if plan is not None else actor_spec(cfg, dist.get_world_size()))


def build_task(cfg: JobConfig):
    """Rank 0's task (prompts + reward) with the checkpoint's tokenizer."""
    tok = load_tokenizer(cfg.actor.load_hf)
    d = cfg.data
    task = build_task_for(d.task, tok, path=d.path, prompt_key=d.prompt_key, answer_key=d.answer_key,
                          reward_fn=d.reward_fn, task_kwargs=d.task_kwargs)
    if cfg.reward.judge.enable:  # the LLM judge scores (tasks/judge.py); raw answers sampled into the run dir
        task = JudgedTask(task, cfg.reward.judge, os.path.join(cfg.trainer.run_dir, "judge_samples.jsonl"),
                          batch_budget_s=judge_batch_budget_s(cfg))
    if cfg.reward.model.enable:   # the rule task's prompts, scored by the reward model
        print(f"[megatron-rl] {cfg.reward.model.describe()}", flush=True)
        task = RewardModelTask(task, cfg.reward.model, batch_budget_s=judge_batch_budget_s(cfg))
    return task, tok


def latest_checkpoint(run_dir: str) -> Optional[str]:
    """The newest COMPLETE ``run_dir/checkpoints/step_N`` (by N), or None."""
    steps = complete_steps(run_dir)
    return os.path.join(run_dir, "checkpoints", f"step_{steps[-1]}") if steps else None


def save(actor, cfg: JobConfig, step: int, rank0: bool, extra: Optional[Dict] = None, critic=None) -> str:
    """Checkpoint after ``step`` completed steps; a COMPLETE marker, written after every rank wrote its
    part, makes it eligible for resume. What an earlier, failed save of the same step left is removed
    first (it was never COMPLETE)."""
    path = os.path.join(cfg.trainer.run_dir, "checkpoints", f"step_{step}")
    if rank0 and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "COMPLETE")):
        shutil.rmtree(path)
    dist.barrier()
    actor.save_checkpoint(path, step, {"config": cfg.to_dict(), **(extra or {})})
    if critic is not None:  # the critic beside the actor, in path/critic (docs/critic.md)
        critic.save_checkpoint(os.path.join(path, CRITIC_DIR), step)
    dist.barrier()
    if rank0:
        open(os.path.join(path, "COMPLETE"), "w").close()
    dist.barrier()
    return path


class KLReference:
    """The frozen initial policy of the KL loss: a frozen ``MegatronActor`` from ``actor.load_hf`` (its weights only);
    with ``offload`` (``actor.ref_param_offload``) they are on the device only during its log-prob pass. With
    ``adapters_off`` (``actor.lora``): the policy actor itself with its adapters switched off (its frozen base)."""

    def __init__(self, actor, offload: bool = False, adapters_off: bool = False):
        self.actor = actor
        self.parked = ParkedParams(actor.model, actor_device()) if offload else None
        self.adapters_off = adapters_off

    def log_probs(self, batch, temperature: float) -> Optional[torch.Tensor]:
        with self.parked.on_device() if self.parked is not None else contextlib.nullcontext():
            with self.actor.adapters_off() if self.adapters_off else contextlib.nullcontext():
                return self.actor.compute_log_probs(batch, temperature, compute_entropy=False)[0]


class NoReference:
    """No KL loss (``kl_loss_coef`` 0) and no KL in the reward: no reference log-probs."""

    def log_probs(self, batch, temperature: float) -> Optional[torch.Tensor]:
        return None


CRITIC_DIR = "critic"
"""The critic's checkpoint inside a step's checkpoint directory."""


@dataclass
class Job:
    """What every step of a run uses (built once by ``build_job``)."""

    cfg: JobConfig
    """The validated job configuration."""
    plan: JobPlan
    """Every choice of the job, built once (the actor, the engine and the step read it)."""
    actor: MegatronActor
    """The trained policy."""
    reference: Union[KLReference, NoReference]
    """The reference log-probs of the KL loss."""
    source: RolloutSource
    """Hands each step's batch (sync or async) and owns the publisher of trained weights."""
    watchdog: Watchdog
    """Bounds and times each phase of a step."""
    sinks: MetricSinks
    """Console / metrics.jsonl / TensorBoard / W&B (rank 0)."""
    stop: StopRequested
    """SIGTERM / SIGINT seen by this rank."""
    start_step: int
    """Completed steps at start (> 0 after ``--resume``)."""
    pad_id: int
    """The tokenizer's pad id (rank 0's, shared)."""
    rank0: bool
    """This is global rank 0 (it owns the task, the engine and the run directory's files)."""
    prompts: Optional[PromptDraw] = None
    """Rank 0: the prompt draw (its order's position goes into each checkpoint); None elsewhere."""
    validation: Optional[Validation] = None
    """Evaluates the validation set (``trainer.test_freq``; rank 0 holds its prompts and the engine)."""
    server: Optional[SGLangServerHandle] = None
    """The SGLang server this job launched (``rollout.sglang_launch``; rank 0), terminated by ``close``."""
    kl_reward: Union[KLInReward, NoKLInReward] = dataclasses.field(default_factory=NoKLInReward)
    """The KL penalty in the reward (``algorithm.use_kl_in_reward``; its controller's beta is checkpointed)."""
    critic: Union[CriticPhase, NoCritic] = dataclasses.field(default_factory=NoCritic)
    """PPO's value model and GAE (``plan.critic``), or ``NoCritic``."""

    def dump(self, step: int, batch: StepBatch) -> None:
        """Rank 0, ``trainer.dump_rollouts``: append the step's rows to run_dir/rollouts.jsonl."""
        if self.rank0 and self.cfg.trainer.dump_rollouts:
            with open(os.path.join(self.cfg.trainer.run_dir, "rollouts.jsonl"), "a") as fh:
                for line in batch.records(step, versions=self.source.dump_versions):
                    fh.write(line + "\n")

    def checkpoint_due(self, step: int, stopping: bool) -> bool:
        """A checkpoint after ``step`` steps: every ``trainer.save_interval`` steps, at the end, or on a stop."""
        tc = self.cfg.trainer
        return bool(tc.save_interval and step % tc.save_interval == 0) or step == tc.steps or stopping

    def checkpoint(self, step: int, stopping: bool) -> None:
        """Collective: save the checkpoint after ``step`` steps (see the module docstring)."""
        tc = self.cfg.trainer
        with self.watchdog.phase("checkpoint", step, timeout_s=checkpoint_phase_timeout_s(self.cfg),
                                 config_key=checkpoint_phase_key(self.cfg)):
            # the last checkpoint keeps only rollouts already made: no step of this run trains on them
            extra, drain_error = self.source.drain(step, last=step >= tc.steps)
            if self.rank0 and self.prompts is not None:  # where the steps a resumed run may draw first start
                extra = {**extra, **self.prompts.state(step, step + len(extra.get("async_rollouts") or {}))}
            if self.kl_reward.state_dict() is not None:  # beta after ``step`` steps (the same on every rank)
                extra = {**extra, KL_CTRL_STATE_KEY: self.kl_reward.state_dict()}
            path = save(self.actor, self.cfg, step, self.rank0, extra if self.rank0 else None,
                        critic=self.critic.critic if self.critic.enabled else None)
        if drain_error is not None:
            raise drain_error
        if self.rank0:
            why = f"signal {self.stop.signum}" if self.stop.signum is not None else "a signal to another rank"
            print(f"[megatron-rl] stopped by {why} after step {step}: checkpoint {path}; continue with --resume"
                  if stopping else f"[megatron-rl] checkpoint {path}", flush=True)

    def close(self, step: int) -> None:
        """Stop the source, restore the signal handlers, flush the sinks (bounded), stop the watchdog and the
        launched server."""
        _teardown(self.watchdog, step, self.source, self.stop, self.sinks, self.server, self.validation)


def _teardown(watchdog: Watchdog, step: int, source=None, stop=None, sinks=None, server=None,
              validation=None) -> None:
    """Release what a job holds, whatever exists of it (a half-built job too), each even if another failed."""
    try:
        try:
            if source is not None:
                source.close()  # rollouts in flight are discarded (async_rollout.py)
        finally:
            if validation is not None:
                validation.close()  # the validation files' reward workers
    finally:
        try:
            if stop is not None:
                stop.restore()
        finally:
            try:
                if sinks is not None:
                    with watchdog.phase("metrics_close", step):  # a W&B / TensorBoard flush must not hang the exit
                        sinks.close()
            finally:
                watchdog.close()
                if server is not None:
                    server.terminate()


def build_job(cfg: JobConfig, stop: Optional[StopRequested] = None) -> Job:
    """Every rank: build the job (see the module docstring). A failure half-way releases what was built.
    ``stop``: the rank's stop watcher when the caller installed it earlier (the job then owns it)."""
    tc = cfg.trainer
    refusal = run_dir_error(tc.run_dir, tc.resume, tc.overwrite)  # before any process group or model
    if refusal:
        raise ConfigError(refusal)
    check_data(cfg)  # a data file with no usable row fails here, before any model is built
    plan = JobPlan.build(cfg, int(os.environ.get("WORLD_SIZE", "1")) if not dist.is_initialized()
                         else dist.get_world_size())
    actor = setup_distributed(cfg, plan)
    if plan.objective.loss.config.kl_loss_coef <= 0 and plan.kl_in_reward is None:
        reference = NoReference()
    elif plan.lora is not None:  # the base with its adapters off: no second model
        reference = KLReference(actor, adapters_off=True)
    else:
        reference = KLReference(MegatronActor(plan.actor, frozen=True), offload=cfg.actor.ref_param_offload)
    kl_reward = plan.kl_in_reward or NoKLInReward()
    critic = CriticPhase(MegatronCritic(plan.critic), cfg) if plan.critic is not None else NoCritic()
    rank0 = dist.get_rank() == 0
    if rank0:
        for line in plan.describe():
            print(f"[megatron-rl] {line}", flush=True)
    watchdog = Watchdog(dist.get_rank(), tc.phase_timeout_s)
    held: Dict[str, object] = {}  # what exists so far, for _teardown
    generator = None
    try:
        with watchdog.phase("setup", 0):  # e.g. a launched SGLang server that never becomes ready
            generator, draw, tokenizer, engine, held["server"], val_groups = on_rank0(
                lambda: _rank0_setup(cfg, plan), what="setting up the task / rollout engine") or (None,) * 6
        held["validation"] = Validation(cfg, val_groups, engine)
        start, resumed = _resume(cfg, actor, rank0, critic)
        if start > 0:  # the controller's beta continues from the checkpoint (what changed is said)
            said = kl_reward.load_state_dict(resumed.get(KL_CTRL_STATE_KEY))
            if said and rank0:
                print(f"[megatron-rl] {said}", flush=True)
        if draw is not None:  # rank 0, before the first draw (the async producer starts below)
            draw.restore(resumed, start)
        held["sinks"] = MetricSinks(tc.run_dir, tc.steps, enabled=rank0, progress=tc.progress,
                                    tensorboard=tc.tensorboard, wandb=tc.wandb, wandb_project=tc.wandb_project,
                                    config=cfg.to_dict(), resume=start > 0)
        # the job's publishers, built once from the plan's settings (async: the deferred one fails here, before
        # the first sync, when the mode cannot be applied later)
        immediate = build_weight_publisher(plan.weight_sync, actor, engine)
        deferred = deferred_publisher(plan.weight_sync, actor) if cfg.rollout.mode == "async" else None
        with watchdog.phase("weight_sync", start):
            immediate.publish(version_tag(start))
        held["stop"] = stop or StopRequested(stop_timeout_s=tc.stop_timeout_s, rank=dist.get_rank())
        held["source"] = build_rollout_source(cfg, generator, engine, actor, immediate, start, resumed, rank0,
                                              deferred=deferred)
        pad_id = share_from_rank0(int(getattr(tokenizer, "pad_token_id", 0) or 0) if rank0 else 0)
    except BaseException:
        if "source" not in held and generator is not None:  # the source did not take it over
            generator.close()
        _teardown(watchdog, 0, **held)
        raise
    return Job(cfg=cfg, plan=plan, actor=actor, reference=reference, watchdog=watchdog, start_step=start, pad_id=pad_id,
               rank0=rank0, prompts=draw, kl_reward=kl_reward, critic=critic, **held)


def _rank0_setup(cfg: JobConfig, plan: JobPlan) -> Tuple:
    """Rank 0: start over (before anything, e.g. a launched server's log, is written into run_dir), the task, its
    prompt draw and step generator, the engine, the validation set (when it is evaluated)."""
    if cfg.trainer.overwrite:
        print(start_over(cfg.trainer.run_dir, keep=cfg.actor.load_hf), flush=True)
    task, tokenizer = build_task(cfg)
    draw = PromptDraw(task, cfg)  # renders the prompts with the data options: a failure before any engine starts
    val_groups = build_val_set(task, cfg.data, tokenizer) if Validation(cfg, None, None).enabled else None
    try:
        engine, server = plan.build_engine()
    except BaseException:
        Validation(cfg, val_groups, None).close()
        raise
    greedy = "reward_baselines" in plan.estimator.spec.needs   # ReMax: a greedy response per prompt
    return (build_step_generator(cfg, task, draw, plan.replay, greedy, plan.estimator.reward_keys,
                                 budget=plan.budget, dynamic=plan.dynamic_sampling), draw, tokenizer,
            engine, server, val_groups)


def _resume(cfg: JobConfig, actor, rank0: bool, critic=None) -> Tuple[int, Dict]:
    """``(start step, the checkpoint's extra state)``: with ``--resume`` the newest COMPLETE checkpoint rank 0
    chose (a shared file system may show ranks different sets), loaded on every rank; later history is
    trimmed."""
    tc = cfg.trainer
    start, resumed = 0, {}
    if tc.resume:
        ckpt = share_from_rank0(latest_checkpoint(tc.run_dir) if rank0 else None)
        if ckpt is not None:
            start, resumed = actor.load_checkpoint(ckpt)
            if critic is not None and critic.enabled:
                critic_dir = os.path.join(ckpt, CRITIC_DIR)
                if not os.path.isdir(critic_dir):  # a checkpoint of a run without a critic
                    raise ConfigError(f"critic.enable: the checkpoint {ckpt} holds no critic ({CRITIC_DIR}/); resume "
                                      f"it without a critic, or start a new run")
                critic.critic.load_checkpoint(critic_dir)
            elif rank0 and os.path.isdir(os.path.join(ckpt, CRITIC_DIR)):
                print(f"[megatron-rl] --resume: {ckpt} holds a critic; this run trains none (it is not loaded)",
                      flush=True)
        if rank0:  # the history continues from the checkpoint's step: nothing later may mix in
            dropped = trim_to_step(tc.run_dir, start)
            print(f"[megatron-rl] resumed from {ckpt} at step {start}{dropped}" if ckpt is not None else
                  f"[megatron-rl] --resume: {tc.run_dir} had no complete checkpoint: a NEW run begins at step 0"
                  f"{dropped} (--resume=required refuses such a directory instead)", flush=True)
    elif rank0 and not tc.overwrite:
        print(f"[megatron-rl] new run in {tc.run_dir}", flush=True)
    return start, resumed

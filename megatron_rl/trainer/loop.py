"""The RL training loop (GRPO / RLOO with rollout correction) — what ``megatron-rl train`` runs.

Per step, on every rank (torchrun / srun; gloo on CPU, NCCL on GPU)::

    rollouts  = rank 0: task prompts -> engine.generate (n per prompt) -> rewards; broadcast
    shard     = this DP rank's whole prompt groups of the RolloutBatch
    old_lp    = actor.compute_log_probs(shard, T)              # fp32 recompute, vocab-parallel
    corr      = compute_rollout_correction(old_lp, rollout_lp, mask, ...)   # IS / RS / veto, exact over DP
    adv       = group advantages with the post-rejection mask
    metrics   = actor.train_step(shard, old_lp, adv, corr.response_mask, corr.weights, T)
    weights   -> engine (in-process state dict, or HF export + /update_weights_from_disk)
    metrics   -> console / metrics.jsonl / TensorBoard / W&B; checkpoint every N steps and on SIGTERM

Bounded waits: every collective has the process-group timeout ``trainer.collective_timeout_s``; each phase
of a step runs under the watchdog (``trainer.phase_timeout_s``, ``trainer.checkpoint_timeout_s``), which
ends a rank that is stuck with the phase named; an exception on any rank ends that rank, and torchrun
stops the rest. A checkpoint is marked COMPLETE only after every rank wrote it.

Run directory (``run_dir.py``): one run per ``trainer.run_dir`` -- a directory holding another run's outputs is
refused before any process group exists unless the run resumes (metrics and rollouts then continue from the
checkpoint's step; later records and stale checkpoints are dropped) or starts over (``trainer.overwrite``:
they are removed). Rank 0 says which on one line.

Rewards: a step where more than ``data.max_reward_failure_frac`` of the rewards failed or timed out raises
``RewardFailureError`` on every rank before it trains (``reward_failures.py``).

Async checkpoints: the drain of the producer's rollouts (rank 0) is shared with every rank and bounded by half
of ``trainer.checkpoint_timeout_s``; when it fails, the trained step is still checkpointed (without the
drained rollouts: ``--resume`` regenerates them from its weights) and then ``AsyncDrainError`` is raised on
every rank.

Bypass mode (``rollout_correction.bypass_mode``) uses the rollout log-probs as the PPO old policy; the
forward-only pass still runs once per step because the correction (weights, rejection, diagnostics)
needs pi_theta — verl computes the same quantity inside its loss.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_rl.actor import MegatronActor
from megatron_rl.actor.schedule import actor_device
from megatron_rl.algo.advantages import compute_advantages
from megatron_rl.config import ConfigError, JobConfig
from megatron_rl.correction import compute_rollout_correction
from megatron_rl.correction.lag import policy_lag_metrics
from megatron_rl.parallel.launch import init_distributed
from megatron_rl.parallel.state import initialize_model_parallel
from megatron_rl.rollout.base import RolloutError
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.sglang_engine import RetryPolicy, SGLangEngine
from megatron_rl.rollout.sglang_server import launch_sglang_server
from megatron_rl.tasks import build_task as build_task_for
from megatron_rl.trainer.async_rollout import (RolloutProducer, SnapshotTimeout, check_staleness,
                                              overlap_seconds, version_tag)
from megatron_rl.trainer.reward_failures import failed_fraction, reward_failure_error
from megatron_rl.trainer.rollout_phase import generate_step, share_from_rank0
from megatron_rl.trainer.run_dir import complete_steps, run_dir_error, start_over, trim_to_step
from megatron_rl.trainer.signals import StopRequested
from megatron_rl.trainer.step_inputs import any_rank, step_inputs
from megatron_rl.trainer.sinks import MetricSinks
from megatron_rl.trainer.startup import check_data, layout_line
from megatron_rl.tokenizer import load_tokenizer
from megatron_rl.trainer.watchdog import Watchdog
from megatron_rl.trainer.weight_sync import apply_weights, sync_weights


def setup_distributed(cfg: JobConfig):
    """Process groups, megatron's parallel state (with the CPU patches when there is no GPU), the actor."""
    if not dist.is_initialized():
        init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
    initialize_model_parallel(cfg.parallel, seed=cfg.trainer.seed, model=cfg.model,
                              distributed_timeout_minutes=cfg.trainer.collective_timeout_s / 60)
    return MegatronActor(cfg)


def build_engine(cfg: JobConfig):
    """Rank 0's rollout engine for ``rollout.engine`` and the handle of the SGLang server it started
    (``rollout.sglang_launch``; None otherwise) — the caller terminates it when training ends."""
    if cfg.rollout.engine == "embedded":
        return EmbeddedEngine(cfg.actor.load_hf, dtype=cfg.rollout.dtype, seed=cfg.trainer.seed), None
    urls = list(cfg.rollout.sglang_urls)
    server = None
    if cfg.rollout.sglang_launch:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        os.makedirs(cfg.trainer.run_dir, exist_ok=True)
        server = launch_sglang_server(cfg.actor.load_hf, port=cfg.rollout.sglang_port, device=device,
                                      log_path=os.path.join(cfg.trainer.run_dir, "sglang_server.log"))
        urls.append(server.url)
    try:
        engine = SGLangEngine(urls, request_timeout=cfg.rollout.request_timeout_s,
                              weight_sync_timeout=cfg.rollout.weight_sync_timeout_s,
                              retry=RetryPolicy(max_attempts=cfg.rollout.max_retries + 1), weight_version="step-0")
    except BaseException:
        if server is not None:
            server.terminate()
        raise
    return engine, server


def build_task(cfg: JobConfig):
    """Rank 0's task (prompts + reward) with the checkpoint's tokenizer."""
    tok = load_tokenizer(cfg.actor.load_hf)
    d = cfg.data
    return build_task_for(d.task, tok, path=d.path, prompt_key=d.prompt_key, answer_key=d.answer_key,
                          reward_fn=d.reward_fn, task_kwargs=d.task_kwargs), tok


class AsyncDrainError(RuntimeError):
    """The async producer could not hand over the rollouts a checkpoint must hold (raised on every rank)."""


def latest_checkpoint(run_dir: str) -> Optional[str]:
    """The newest COMPLETE ``run_dir/checkpoints/step_N`` (by N), or None."""
    steps = complete_steps(run_dir)
    return os.path.join(run_dir, "checkpoints", f"step_{steps[-1]}") if steps else None


def save(actor, cfg: JobConfig, step: int, rank0: bool, extra: Optional[Dict] = None) -> str:
    """Checkpoint after ``step`` completed steps; a COMPLETE marker, written after every rank wrote its
    part, makes it eligible for resume. What an earlier, failed save of the same step left is removed
    first (it was never COMPLETE)."""
    path = os.path.join(cfg.trainer.run_dir, "checkpoints", f"step_{step}")
    if rank0 and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "COMPLETE")):
        shutil.rmtree(path)
    dist.barrier()
    actor.save_checkpoint(path, step, {"config": cfg.to_dict(), **(extra or {})})
    dist.barrier()
    if rank0:
        open(os.path.join(path, "COMPLETE"), "w").close()
    dist.barrier()
    return path


def train(cfg: JobConfig) -> Dict[str, float]:
    """Run ``cfg.trainer.steps`` steps (or the remainder after ``--resume``); returns the last metrics."""
    tc = cfg.trainer
    refusal = run_dir_error(tc.run_dir, tc.resume, tc.overwrite)  # before any process group or model
    if refusal:
        raise ConfigError(refusal)
    check_data(cfg)  # a data file with no usable row fails here, before any model is built
    actor = setup_distributed(cfg)
    # KL to a reference policy: a frozen copy of the initial weights (actor.load_hf). It is built as a
    # second MegatronActor whose optimizer is never stepped (memory for tiny / mid-size models only).
    reference = MegatronActor(cfg) if cfg.actor.policy_loss.kl_loss_coef > 0 else None
    rank0 = dist.get_rank() == 0
    if rank0:
        print(layout_line(cfg, actor.groups, dist.get_world_size()), flush=True)
    watchdog = Watchdog(dist.get_rank(), cfg.trainer.phase_timeout_s)
    task = engine = tokenizer = server = None
    setup_error = None
    with watchdog.phase("setup", 0):  # e.g. a launched SGLang server that never becomes ready
        if rank0:  # a failure here is shared, so the other ranks raise too instead of waiting in a collective
            try:
                if tc.overwrite:  # before anything (a launched server's log) is written into run_dir
                    print(start_over(tc.run_dir, keep=cfg.actor.load_hf), flush=True)
                task, tokenizer = build_task(cfg)
                engine, server = build_engine(cfg)
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                setup_error = RuntimeError(f"rank 0 could not set up the task / rollout engine: "
                                           f"{type(exc).__name__}: {exc}")
        setup_error = share_from_rank0(setup_error)
    if setup_error is not None:
        watchdog.close()
        raise setup_error
    try:
        return _train_loop(cfg, actor, reference, task, engine, tokenizer, rank0, watchdog)
    finally:
        watchdog.close()
        if server is not None:
            server.terminate()


def _train_loop(cfg: JobConfig, actor, reference, task, engine, tokenizer, rank0: bool,
                watchdog: Watchdog) -> Dict[str, float]:
    corr_cfg, T = cfg.algorithm.rollout_correction, cfg.rollout.temperature
    start, resumed = 0, {}
    if cfg.trainer.resume:
        # rank 0 chooses, every rank loads the same step (a shared file system may show ranks different sets)
        ckpt = share_from_rank0(latest_checkpoint(cfg.trainer.run_dir) if rank0 else None)
        if ckpt is not None:
            start, resumed = actor.load_checkpoint(ckpt)
        if rank0:  # the history continues from the checkpoint's step: nothing later may mix in
            dropped = trim_to_step(cfg.trainer.run_dir, start)
            print(f"[megatron-rl] resumed from {ckpt} at step {start}{dropped}" if ckpt is not None else
                  f"[megatron-rl] --resume: no complete checkpoint in {cfg.trainer.run_dir}: starting at step 0"
                  f"{dropped}", flush=True)
    elif rank0 and not cfg.trainer.overwrite:
        print(f"[megatron-rl] new run in {cfg.trainer.run_dir}", flush=True)
    sinks = MetricSinks(cfg.trainer.run_dir, cfg.trainer.steps, enabled=rank0, progress=cfg.trainer.progress,
                        tensorboard=cfg.trainer.tensorboard, wandb=cfg.trainer.wandb,
                        wandb_project=cfg.trainer.wandb_project, config=cfg.to_dict(), resume=start > 0)
    tc = cfg.trainer
    version = version_tag(start)
    with watchdog.phase("weight_sync", start):
        sync_weights(actor, engine, cfg, version, rank0)
    stop = StopRequested(stop_timeout_s=tc.stop_timeout_s, rank=dist.get_rank())
    rc = cfg.rollout
    producer = None
    if rank0 and rc.mode == "async":  # generation overlaps training from here on (async_rollout.py)
        producer = RolloutProducer(
            engine, generate_fn=lambda s, view, tag: generate_step(task, view, cfg, s, tag),
            apply_fn=lambda payload, tag: apply_weights(engine, cfg, payload, tag, actor), start_step=start,
            max_staleness=rc.max_staleness, interrupt=rc.partial_rollout == "interrupt",
            segment_tokens=rc.segment_tokens, preloaded=_resumed_rollouts(resumed, rc)).start_thread()
    max_lag = rc.max_staleness if rc.mode == "async" else 0
    pad_id = int(getattr(tokenizer, "pad_token_id", 0) or 0) if rank0 else 0
    pad_id = share_from_rank0(pad_id)
    metrics: Dict[str, float] = {}
    step = start
    try:
        while step < cfg.trainer.steps:
            t_step = time.perf_counter()
            # 1. rollouts on rank 0 (an exception is shared so every rank stops, none hangs)
            payload = None
            with watchdog.phase("rollout", step + 1):
                if rank0:
                    try:
                        if producer is not None:
                            payload = producer.get(step)
                        else:
                            payload = generate_step(task, engine, cfg, step, version)
                        if payload.token_versions:
                            check_staleness(payload.token_versions, step, max_lag, step + 1)
                        failure = reward_failure_error(payload.metrics, len(payload.rewards),
                                                       cfg.data.max_reward_failure_frac, step + 1)
                        if failure is not None:
                            raise failure
                    except RolloutError as exc:
                        payload = exc
                    except Exception as exc:  # noqa: BLE001 - the producer thread's failure, for every rank
                        if producer is None:
                            raise
                        payload = RuntimeError(f"rank 0: async rollouts of step {step + 1} failed: "
                                               f"{type(exc).__name__}: {exc}")
                payload = share_from_rank0(payload)
            if isinstance(payload, Exception):
                raise payload
            t_roll = time.perf_counter() - t_step
            # 2. this DP rank's whole groups, on the actor's device (the one place they move there)
            inputs = step_inputs(payload, step, cfg.rollout.n_samples_per_prompt, pad_id, actor.dp_rank,
                                 actor.dp_size, actor_device())
            shard, rewards, group_index = inputs.shard, inputs.rewards, inputs.group_index
            # 3. recompute log-probs (fp32), 4. correction
            t0 = time.perf_counter()
            with watchdog.phase("logprob", step + 1):
                old_lp, _ = actor.compute_log_probs(shard, T, compute_entropy=False)  # train_step reports entropy
            t_lp = time.perf_counter() - t0
            t0 = time.perf_counter()
            with watchdog.phase("correction", step + 1):
                corr = compute_rollout_correction(old_lp, shard.rollout_log_probs, shard.response_mask, corr_cfg,
                                                  group=actor.dp_group)
                lag_metrics = policy_lag_metrics(old_lp, shard.rollout_log_probs, shard.response_mask,
                                                 inputs.token_lag, max_lag, group=actor.dp_group)
            t_corr = time.perf_counter() - t0
            # 5. advantages with the post-rejection mask, 6. train
            adv = compute_advantages(rewards, group_index, corr.response_mask.float(),
                                     estimator=cfg.algorithm.advantage_estimator,
                                     norm_adv_by_std=cfg.algorithm.norm_adv_by_std)
            t0 = time.perf_counter()
            weights = corr.weights  # whether the loss applies them: actor.train_step decides (select_loss_inputs)
            with watchdog.phase("train", step + 1):
                ref_lp = reference.compute_log_probs(shard, T, compute_entropy=False)[0] if reference else None
                actor_metrics = actor.train_step(shard, old_lp, adv, corr.response_mask, weights, T,
                                                 ref_log_probs=ref_lp)
            t_train = time.perf_counter() - t0
            step += 1
            # 7. weight sync
            t0 = time.perf_counter()
            version = version_tag(step)
            with watchdog.phase("weight_sync", step):
                sync_metrics = sync_weights(actor, engine, cfg, version, rank0, producer,
                                            deferred=rc.mode == "async")
            t_sync = time.perf_counter() - t0
            # the share of this step's wall time in which the producer generated while the trainer worked
            t_end = time.perf_counter()
            overlap = (overlap_seconds(producer.busy, (_wall(t_step + t_roll), _wall(t_end))) / (t_end - t_step)
                       if producer is not None else 0.0)
            # 8. metrics
            dt = time.perf_counter() - t_step
            resp_len = [len(r) for r in payload.response_ids]
            tokens = sum(len(p) + len(r) for p, r in zip(payload.prompt_ids, payload.response_ids))
            metrics = {
                "reward/mean": sum(payload.rewards) / len(payload.rewards),
                "reward/max": max(payload.rewards), "reward/min": min(payload.rewards),
                "reward/failed_frac": failed_fraction(payload.metrics, len(payload.rewards)),
                "response_length/mean": sum(resp_len) / len(resp_len), "response_length/max": max(resp_len),
                **actor_metrics, **corr.metrics, **lag_metrics, **payload.metrics,
                "perf/rollout_overlap_frac": overlap,
                "timing/rollout_s": t_roll, "timing/logprob_s": t_lp, "timing/correction_s": t_corr,
                "timing/train_s": t_train, "timing/weight_sync_s": t_sync, "timing/step_s": dt, **sync_metrics,
                "perf/tokens_per_s": tokens / dt,
            }
            with watchdog.phase("metrics", step):
                sinks.log(step, metrics)
                if rank0 and tc.dump_rollouts:
                    _dump(tc.run_dir, step, payload)
                # 9. checkpoints: interval, end, or a signal seen by any rank
                stopping = any_rank(stop.requested)  # the flag is staged for the default group's backend
            interval = tc.save_interval and step % tc.save_interval == 0
            if interval or step == tc.steps or stopping:
                with watchdog.phase("checkpoint", step, timeout_s=tc.checkpoint_timeout_s,
                                    config_key="trainer.checkpoint_timeout_s"):
                    extra, drain_error = (_drain_async(producer, step, rc, tc.checkpoint_timeout_s / 2)
                                          if rank0 else (None, None))
                    drain_error = share_from_rank0(drain_error)  # every rank learns it; the save still happens
                    path = save(actor, cfg, step, rank0, extra if rank0 else None)
                if drain_error is not None:
                    raise drain_error
                if rank0:
                    why = f"signal {stop.signum}" if stop.signum is not None else "a signal to another rank"
                    print(f"[megatron-rl] stopped by {why} after step {step}: checkpoint {path}; "
                          f"continue with --resume" if stopping else f"[megatron-rl] checkpoint {path}", flush=True)
            if stopping:
                break
    finally:
        if producer is not None:
            producer.close()  # rollouts in flight are discarded (see async_rollout.py)
        stop.restore()
        with watchdog.phase("metrics_close", step):  # a W&B / TensorBoard flush must not hang the exit
            sinks.close()
    return metrics


def _drain_async(producer, step: int, rc, timeout_s: float):
    """Rank 0, before a checkpoint after ``step`` steps: ``(extra, None)`` with the rollouts the producer generated
    from versions older than ``step`` (they cannot be regenerated from the checkpoint; async_rollout.py), or
    ``({}, AsyncDrainError)`` when the producer failed or did not hand them over within ``timeout_s`` (<= 0: no
    limit) -- the checkpoint is then written without them."""
    if producer is None:
        return {}, None
    try:
        rollouts = producer.snapshot(step, timeout_s=timeout_s if timeout_s > 0 else None)
        return {"async_rollouts": rollouts, "async_schedule": (rc.max_staleness, rc.partial_rollout)}, None
    except SnapshotTimeout:
        cause = f"the producer did not hand them over within {timeout_s:g} s (half of trainer.checkpoint_timeout_s)"
    except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
        cause = f"{type(exc).__name__}: {exc}"
    return {}, AsyncDrainError(f"rank 0: draining the async rollouts for the checkpoint of step {step} failed: "
                               f"{cause}. The checkpoint of step {step} is written without them (--resume "
                               f"regenerates them from its weights)")


def _resumed_rollouts(extra: Dict, rc) -> Dict:
    """The drained rollouts of a resumed checkpoint, if it was written with the same async schedule."""
    saved = extra.get("async_rollouts") or {}
    if saved and extra.get("async_schedule") != (rc.max_staleness, rc.partial_rollout):
        print(f"[megatron-rl] the checkpoint's async rollouts were made with (max_staleness, partial_rollout) = "
              f"{extra.get('async_schedule')}, this run uses {(rc.max_staleness, rc.partial_rollout)}: "
              f"regenerating them", flush=True)
        return {}
    return dict(saved)


def _wall(perf_t: float) -> float:
    """A ``time.perf_counter()`` reading as wall time (the producer records ``time.time()``)."""
    return time.time() - (time.perf_counter() - perf_t)


def _dump(run_dir: str, step: int, payload) -> None:
    """Append the step's rollouts to run_dir/rollouts.jsonl (``weight_version`` = the version the step's
    generation started from; ``token_versions`` per response token when the engine was segmented)."""
    versions = payload.token_versions or [None] * len(payload.response_ids)
    with open(os.path.join(run_dir, "rollouts.jsonl"), "a") as fh:
        for p, r, lp, rw, tv in zip(payload.prompt_ids, payload.response_ids, payload.rollout_log_probs,
                                    payload.rewards, versions):
            rec = {"step": step, "prompt_ids": p, "response_ids": r, "rollout_log_probs": lp, "reward": rw,
                   "weight_version": payload.weight_version}
            if tv is not None:
                rec["token_versions"] = tv
            fh.write(json.dumps(rec) + "\n")

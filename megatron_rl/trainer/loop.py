"""The RL training loop -- what ``megatron-rl train`` runs: ``train(cfg)``.

    job = build_job(cfg)                      # job.py: every mode chosen once (source, publisher, reference)
    validate before training (trainer.val_before_train, a fresh run: logged as step 0)
    for step in range(start, trainer.steps):
        metrics, batch = train_step(job, step)          # step.py: the same for every mode
        validate every trainer.test_freq steps and after the last (validation.py): val/* join the step's metrics
            (not when a stop was requested: the checkpoint must come within trainer.stop_timeout_s)
        log metrics (console / metrics.jsonl / TensorBoard / W&B), dump rollouts
        checkpoint every trainer.save_interval steps, at the end, and when any rank saw SIGTERM / SIGINT

Bounded waits: every collective has the process-group timeout ``trainer.collective_timeout_s``; each phase
of a step runs under the watchdog (``trainer.phase_timeout_s``, ``trainer.checkpoint_timeout_s``), which
ends a rank that is stuck with the phase named; an exception on any rank ends that rank, and torchrun
stops the rest (a failure on rank 0, which owns the task and the engine, is raised on every rank). A
checkpoint is marked COMPLETE only after every rank wrote it.

Run directory (``run_dir.py``): one run per ``trainer.run_dir`` -- a directory holding another run's outputs is
refused before any process group exists unless the run resumes (metrics and rollouts then continue from the
checkpoint's step; later records and stale checkpoints are dropped) or starts over (``trainer.overwrite``:
they are removed). Rank 0 says which on one line.

Rewards: a step where more than ``data.max_reward_failure_frac`` of the rewards failed or timed out raises
``RewardFailureError`` on every rank before it trains (``rollout_source.py``).

Async checkpoints: see ``job.py`` (the drain of the producer's rollouts is bounded; when it fails the trained step
is still checkpointed, then ``AsyncDrainError`` is raised on every rank).
"""
from __future__ import annotations

from typing import Dict, Optional

from megatron_rl.config import JobConfig
from megatron_rl.trainer.job import build_job
from megatron_rl.trainer.signals import StopRequested
from megatron_rl.trainer.step import train_step
from megatron_rl.trainer.step_batch import any_rank

__all__ = ["train"]


def train(cfg: JobConfig, stop: Optional[StopRequested] = None) -> Dict[str, float]:
    """Run ``cfg.trainer.steps`` steps (or the remainder after ``--resume``); returns the last metrics. ``stop``:
    a watcher installed before the job was built (a stop requested while the ranks start is taken at the end
    of the first step); default: one installed once the job is built."""
    job = build_job(cfg, stop)
    metrics: Dict[str, float] = {}
    step = job.start_step
    try:
        if job.validation.due_before_train(step):
            job.sinks.log_validation(step, _validate(job, step))
            _log_samples(job, step)
        while step < cfg.trainer.steps:
            metrics, batch = train_step(job, step)
            step += 1
            if job.validation.due(step):
                if any_rank(job.stop.requested):  # a stop: the checkpoint first (within trainer.stop_timeout_s)
                    if job.rank0:
                        print(f"[megatron-rl] validation after step {step} skipped: stopping", flush=True)
                else:
                    metrics = {**metrics, **_validate(job, step)}
            with job.watchdog.phase("metrics", step):
                job.sinks.log(step, metrics)
                _log_samples(job, step)
                job.dump(step, batch)
                stopping = any_rank(job.stop.requested)  # a signal seen by any rank stops every rank
            if job.checkpoint_due(step, stopping):
                job.checkpoint(step, stopping)
            if stopping:
                break
    finally:
        job.close(step)
    return metrics


def _log_samples(job, step: int) -> None:
    """Rank 0: the validation samples kept for ``trainer.val_log_samples``, logged once with ``step``."""
    samples = job.validation.take_samples()
    if samples:
        job.sinks.log_val_samples(step, samples)


def _validate(job, done: int) -> Dict[str, float]:
    """Collective: the validation after ``done`` steps, under the watchdog (``trainer.val_timeout_s``)."""
    with job.watchdog.phase("validation", done, timeout_s=job.cfg.trainer.val_timeout_s,
                            config_key="trainer.val_timeout_s"):
        return job.validation.run(done)

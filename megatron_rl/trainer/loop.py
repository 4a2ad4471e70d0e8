"""The RL training loop -- what ``megatron-rl train`` runs: ``train(cfg)``.

    job = build_job(cfg)                      # job.py: the job plan and every object built from it, once
    validate before training (trainer.val_before_train, a fresh run: logged as step 0)
    for step in range(start, trainer.steps):
        metrics, batch = train_step(job, step)          # step.py: the same for every mode
        validate every trainer.test_freq steps and after the last (not when a stop was requested)
        log metrics (console / metrics.jsonl / TensorBoard / W&B), dump rollouts
        checkpoint every trainer.save_interval steps, at the end, and when any rank saw SIGTERM / SIGINT

Rule: every wait is bounded (collectives by ``trainer.collective_timeout_s``, each phase by the watchdog) and a
checkpoint is COMPLETE only after every rank wrote it. Run directory, rewards, async checkpoints: docs/trainer.md.
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

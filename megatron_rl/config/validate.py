"""Whole-job validation: the problems of building the job's plan (``megatron_rl.plan.JobPlan.collect``).

Runs before any process group exists (the launcher calls it on every rank with $WORLD_SIZE), so a bad value costs
seconds, not a queue slot. Every problem is listed, each naming its dotted key; the checks themselves live with
the objects they build (``megatron_rl.plan``).
"""
from __future__ import annotations

from typing import List, Optional

from megatron_rl.config.job import ConfigError, JobConfig
from megatron_rl.plan import JobPlan, world_errors

__all__ = ["validate_job", "job_errors", "world_errors"]


def validate_job(cfg: JobConfig, world_size: int, has_te: Optional[bool] = None) -> None:
    """Raise ConfigError listing every violation (dotted keys and values)."""
    errs = job_errors(cfg, world_size, has_te=has_te)
    if errs:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))


def job_errors(cfg: JobConfig, world_size: int, has_te: Optional[bool] = None) -> List[str]:
    """Every violation of ``cfg`` at ``world_size`` ranks, each line starting with its dotted key: what failed to
    build of its plan. ``has_te``: Transformer Engine on the machines the job runs on (None:
    ``models.attention.expected_te`` -- detected on a CUDA machine)."""
    return JobPlan.collect(cfg, world_size, has_te=has_te)[1]

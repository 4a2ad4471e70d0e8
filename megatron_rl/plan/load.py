"""Load a job config and validate it: the plain loader (``config.load.read_job_config``) plus what fails to build
of the job's plan (``JobPlan.collect``).

Runs before any process group exists (the launcher calls it on every rank with $WORLD_SIZE), so a bad value costs
seconds, not a queue slot. Every problem is listed, each naming its dotted key; a key whose own value was already
rejected by the plain loader is not reported twice.

    cfg = load_job_config("configs/tiny_cpu.yaml", ["actor.lr=3e-4"], world_size=4)
    cfg, errors = collect_job_config("configs/tiny_cpu.yaml", [], world_size=4)   # never raises ConfigError
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

from megatron_rl.config.job import ConfigError, JobConfig
from megatron_rl.config.load import VERL_FILE_MESSAGE, format_errors, launch_world_size, read_job_config
from megatron_rl.plan.job import JobPlan

__all__ = ["validate_job", "job_errors", "collect_job_config", "load_job_config"]


def validate_job(cfg: JobConfig, world_size: int, has_te: Optional[bool] = None) -> None:
    """Raise ConfigError listing every violation (dotted keys and values)."""
    errs = job_errors(cfg, world_size, has_te=has_te)
    if errs:
        raise ConfigError(format_errors(errs))


def job_errors(cfg: JobConfig, world_size: int, has_te: Optional[bool] = None) -> List[str]:
    """Every violation of ``cfg`` at ``world_size`` ranks, each line starting with its dotted key: what failed to
    build of its plan. ``has_te``: Transformer Engine on the machines the job runs on (None:
    ``models.attention.expected_te`` -- detected on a CUDA machine)."""
    return JobPlan.collect(cfg, world_size, has_te=has_te)[1]


def collect_job_config(path: Optional[str], overrides: Sequence[str] = (), world_size: Union[int, str, None] = None,
                       has_te: Optional[bool] = None) -> Tuple[JobConfig, List[str]]:
    """(config, every problem found) -- for tools that report problems and go on (``megatron-rl check``).
    Raises ConfigError only when the file itself cannot be read. ``world_size`` as in load_job_config, or
    "cluster": the ``cluster:`` section's nodes x gpus_per_node. ``has_te``: Transformer Engine on the cluster
    (None: ``models.attention.expected_te``)."""
    cfg, errors = read_job_config(path, overrides)
    if world_size == "cluster":
        ws = cfg.cluster.world_size
    else:
        ws = world_size if world_size is not None else (launch_world_size() or 1)
    if VERL_FILE_MESSAGE in errors:
        return cfg, errors  # nothing else of a verl file is this project's config
    bad_keys = {e.split(":", 1)[0] for e in errors}
    for e in job_errors(cfg, ws, has_te=has_te):  # a key (or section) whose value was rejected above is not reported twice
        key = e.split(":", 1)[0]
        if not any(b == key or b.startswith(key + ".") for b in bad_keys) and e not in errors:
            errors.append(e)
    return cfg, errors


def load_job_config(path: Optional[str], overrides: Sequence[str] = (), world_size: Optional[int] = None) -> JobConfig:
    """Read YAML ``path`` (None: all defaults), apply overrides, build and validate; raises one ConfigError listing
    every problem. ``world_size`` (default: the launcher's, $WORLD_SIZE or $SLURM_NTASKS, else 1) is checked
    against the parallel layout."""
    cfg, errors = collect_job_config(path, overrides, world_size)
    if errors:
        raise ConfigError(format_errors(errors))
    return cfg

"""The job config -> ``weight_sync.settings.WeightSyncSettings`` boundary for code that holds a config, not the job's
plan (the trainer's async source, tests, tools): the plan's own builder (``plan.checks.weight_sync_settings``), so a
mode is built in one place."""
from __future__ import annotations

from megatron_rl.config import JobConfig
from megatron_rl.plan.checks import weight_sync_settings as _build
from megatron_rl.weight_sync.settings import WeightSyncSettings

__all__ = ["weight_sync_settings"]


def weight_sync_settings(cfg: JobConfig) -> WeightSyncSettings:
    """The weight-sync settings of the validated job ``cfg``."""
    return _build(cfg.rollout, cfg.trainer.run_dir, cfg.actor.lora)

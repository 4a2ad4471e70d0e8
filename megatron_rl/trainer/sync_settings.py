"""The job config -> ``weight_sync.settings.WeightSyncSettings`` boundary for tests and tools that hold a config, not
a job plan. Rule: nothing at run time calls it (the trainer, its rollout sources and publishers receive the plan's
``JobPlan.weight_sync``); it is the plan's own builder (``plan.checks.weight_sync_settings``), so a mode is still
resolved in one place."""
from __future__ import annotations

from megatron_rl.config import JobConfig
from megatron_rl.plan.checks import weight_sync_settings as _build
from megatron_rl.weight_sync.settings import WeightSyncSettings

__all__ = ["weight_sync_settings"]


def weight_sync_settings(cfg: JobConfig) -> WeightSyncSettings:
    """The weight-sync settings of the validated job ``cfg`` (tests and tools only)."""
    return _build(cfg.rollout, cfg.trainer.run_dir, cfg.actor.lora)

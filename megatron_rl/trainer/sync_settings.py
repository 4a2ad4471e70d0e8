"""The job config -> ``weight_sync.settings.WeightSyncSettings`` boundary for tests and tools that hold a config, not
a job plan. Rule: nothing at run time calls it (the trainer, its rollout sources and publishers receive the plan's
``JobPlan.weight_sync``); it calls the plan's own builder (``plan.job.weight_sync_of``), so a mode is still
resolved in one place."""
from __future__ import annotations

from megatron_rl.config import JobConfig
from megatron_rl.plan.job import weight_sync_of
from megatron_rl.weight_sync.settings import WeightSyncSettings

__all__ = ["weight_sync_settings", "settings_of"]


def settings_of(rollout, run_dir: str, lora=None) -> WeightSyncSettings:
    """The settings of a ``rollout`` section (``run_dir``: ``trainer.run_dir``; ``lora``: ``actor.lora``) as the
    job plan builds them; ``Unbuilt`` with every ``rollout.weight_sync*`` / ``rollout.lora_sync`` problem."""
    return weight_sync_of(rollout, run_dir, lora)


def weight_sync_settings(cfg: JobConfig) -> WeightSyncSettings:
    """The weight-sync settings of the validated job ``cfg`` (tests and tools only)."""
    return settings_of(cfg.rollout, cfg.trainer.run_dir, cfg.actor.lora)

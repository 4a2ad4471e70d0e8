"""The job config -> ``weight_sync.settings.WeightSyncSettings`` boundary: the one place a job's weight-sync choices
(the mode, ``auto`` resolved against the engine class, the bucket size, bounds, verification) are read from it."""
from __future__ import annotations

from megatron_rl.config import JobConfig
from megatron_rl.rollout.factory import engine_class
from megatron_rl.weight_sync.settings import WeightSyncSettings

__all__ = ["weight_sync_settings"]


def weight_sync_settings(cfg: JobConfig) -> WeightSyncSettings:
    """The weight-sync settings of the validated job ``cfg``."""
    return WeightSyncSettings.build(cfg.rollout, cfg.trainer.run_dir, engine_class(cfg.rollout.engine))

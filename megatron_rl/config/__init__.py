"""Job configuration: typed sections, YAML loading with dotted overrides (validation across keys: ``megatron_rl.plan``)."""
from megatron_rl.config.job import ConfigError, JobConfig
from megatron_rl.config.load import apply_overrides, job_config_from_dict, launch_world_size, read_job_config
from megatron_rl.config.sections import (ActorConfig, AlgorithmConfig, ClusterConfig, DataConfig, RolloutConfig,
                                         TrainerConfig)

__all__ = ["ConfigError", "JobConfig", "apply_overrides", "job_config_from_dict", "launch_world_size",
           "read_job_config", "ActorConfig", "AlgorithmConfig",
           "ClusterConfig", "DataConfig", "RolloutConfig", "TrainerConfig"]

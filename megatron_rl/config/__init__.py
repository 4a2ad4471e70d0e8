"""Job configuration: typed sections, YAML loading with dotted overrides, whole-job validation."""
from megatron_rl.config.job import ConfigError, JobConfig
from megatron_rl.config.load import (apply_overrides, collect_job_config, job_config_from_dict, launch_world_size,
                                     load_job_config)
from megatron_rl.config.sections import (ActorConfig, AlgorithmConfig, ClusterConfig, DataConfig, RolloutConfig,
                                         TrainerConfig)
from megatron_rl.config.validate import job_errors, validate_job

__all__ = ["ConfigError", "JobConfig", "apply_overrides", "collect_job_config", "job_config_from_dict",
           "launch_world_size", "load_job_config", "job_errors", "validate_job", "ActorConfig", "AlgorithmConfig",
           "ClusterConfig", "DataConfig", "RolloutConfig", "TrainerConfig"]

"""Job configuration: typed sections, YAML loading with dotted overrides, whole-job validation."""
from megatron_rl.config.load import ConfigError, JobConfig, apply_overrides, job_config_from_dict, load_job_config
from megatron_rl.config.sections import ActorConfig, AlgorithmConfig, DataConfig, RolloutConfig, TrainerConfig
from megatron_rl.config.validate import validate_job

__all__ = ["ConfigError", "JobConfig", "apply_overrides", "job_config_from_dict", "load_job_config",
           "validate_job", "ActorConfig", "AlgorithmConfig", "DataConfig", "RolloutConfig", "TrainerConfig"]

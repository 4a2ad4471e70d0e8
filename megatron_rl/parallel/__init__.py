"""Parallel setup: typed layout config + validation, launcher env / process groups, megatron groups.

    from megatron_rl.parallel import ParallelConfig, validate_parallel_config, init_distributed, \
        initialize_model_parallel
"""
from megatron_rl.parallel.config import (ParallelConfig, ParallelConfigError, parallel_config_from_dict,
                                         validate_parallel_config)
from megatron_rl.parallel.launch import LaunchEnv, init_distributed, parse_slurm_nodelist, resolve_launch_env
from megatron_rl.parallel.state import destroy_model_parallel, initialize_model_parallel

__all__ = ["ParallelConfig", "ParallelConfigError", "parallel_config_from_dict", "validate_parallel_config",
           "LaunchEnv", "init_distributed", "parse_slurm_nodelist", "resolve_launch_env",
           "initialize_model_parallel", "destroy_model_parallel"]

"""Parallel setup: the layout's sizes and their one validation (``ParallelDims``), this rank's process groups
(``ActorGroups``), launcher env / process groups, megatron's groups.

    from megatron_rl.parallel import ParallelConfig, ParallelDims, init_distributed, initialize_model_parallel
    dims = ParallelDims.build(cfg, world_size, model)        # raises ParallelConfigError listing every violation
"""
from megatron_rl.parallel.config import ParallelConfig, ParallelConfigError, parallel_config_from_dict
from megatron_rl.parallel.dims import ParallelDims, validate_parallel_config
from megatron_rl.parallel.groups import ActorGroups
from megatron_rl.parallel.launch import LaunchEnv, init_distributed, parse_slurm_nodelist, resolve_launch_env
from megatron_rl.parallel.state import destroy_model_parallel, initialize_model_parallel

__all__ = ["ParallelConfig", "ParallelConfigError", "parallel_config_from_dict", "ParallelDims",
           "validate_parallel_config", "ActorGroups", "LaunchEnv", "init_distributed", "parse_slurm_nodelist",
           "resolve_launch_env", "initialize_model_parallel", "destroy_model_parallel"]

"""Create megatron's model-parallel groups from the ``ParallelDims`` of a ``ParallelConfig`` and seed its RNG tracker.

Usage (after ``init_distributed()`` or inside ``run_ranks``)::

    dims = initialize_model_parallel(cfg, seed=1234, model=model_cfg)   # ParallelDims.build validates first
    ...
    destroy_model_parallel()

The platform patches this machine needs are applied first (``platform.select``: megatron's local layers
without Transformer Engine; on CPU also the CUDA stand-ins, so the CUDA RNG tracker is backed by the CPU
generator, ``model_parallel_cuda_manual_seed`` works and dropout regions are reproducible).
"""
from __future__ import annotations

from typing import Any

from megatron_rl.parallel.config import ParallelConfig
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.platform.select import apply_platform_patches

__all__ = ["initialize_model_parallel", "destroy_model_parallel", "shutdown_distributed"]


def initialize_model_parallel(cfg: ParallelConfig, seed: int = 1234, model: Any = None,
                              distributed_timeout_minutes: float = 30) -> ParallelDims:
    """Build the ``ParallelDims`` of ``cfg`` at the world size (validated, also against ``model``'s shape), call
    megatron's ``parallel_state.initialize_model_parallel`` with its sizes and
    ``model_parallel_cuda_manual_seed(seed)``, and return the dims.

    Requires an initialised default process group. Raises ``ParallelConfigError`` before creating
    any group if the layout is invalid."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel: torch.distributed is not initialised "
                           "(call megatron_rl.parallel.init_distributed() first)")
    dims = ParallelDims.build(cfg, dist.get_world_size(), model)
    apply_platform_patches()  # the project's one call (what this machine lacks: TE, CUDA); idempotent
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.interleaved else None,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        distributed_timeout_minutes=distributed_timeout_minutes,
        create_gloo_process_groups=True,  # megatron defaults (optimizer, checkpointing) expect them
    )
    model_parallel_cuda_manual_seed(seed)
    return dims


def destroy_model_parallel() -> None:
    """Tear down megatron's groups (safe if none exist)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def shutdown_distributed() -> None:
    """End of a successful job: every rank reaches a barrier, then megatron's groups and the default process
    group are destroyed, so gloo / NCCL threads stop before the interpreter exits (a group left to the
    interpreter's exit could abort a rank that already finished its work, e.g. ``terminate called without an
    active exception``, and turn a finished job into a failed one)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    dist.barrier()
    destroy_model_parallel()
    dist.destroy_process_group()

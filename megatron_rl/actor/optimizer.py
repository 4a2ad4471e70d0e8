"""Megatron DDP wrapping and the Megatron optimizer for the actor's model chunks.

    ddp_chunks = wrap_ddp(chunks, actor_cfg)            # megatron DistributedDataParallel per chunk
    optimizer = build_optimizer(ddp_chunks, actor_cfg, precision)  # get_megatron_optimizer(OptimizerConfig(...))

Choices: gradients are accumulated and reduced in fp32 (``grad_reduce_in_fp32``, Megatron-LM's
``--accumulate-allreduce-grads-in-fp32``) whatever the parameter dtype (each micro-batch's own weight gradient is in
the parameter's dtype, bf16 with ``actor.bf16``, before DDP adds it into the fp32 buffer: no fused wgrad
accumulation, ``gradient_accumulation_fusion=False``); with ``actor.bf16`` the optimizer keeps
fp32 main parameters (megatron's mixed-precision optimizer, no loss scaling for bf16).
``actor.use_distributed_optimizer`` shards the fp32 main parameters and Adam state over the data-parallel
ranks (gradients reduce-scattered, parameters all-gathered after the step). ``actor.optimizer_cpu_offload`` is
megatron's (``HybridDeviceOptimizer`` through its precision-aware path, as Megatron-LM requires); its limits are
``offload_errors`` (docs/memory.md). No overlap (the RL step is small
and overlap needs CUDA streams). Adam is megatron's choice of implementation (torch AdamW when neither TE nor
apex is installed); weight decay is decoupled and — megatron's default — not applied to biases and 1-D params
(norm weights). ``apply_constant_schedule`` writes ``actor.lr`` / weight decay into the param groups the way
megatron's ``OptimizerParamScheduler`` does for a constant schedule (megatron leaves that to the scheduler); the
actor then drives megatron's scheduler itself (``lr_schedule``: warm-up and decay). On CPU, megatron's ``torch.cuda.*Tensor`` type checks of the mixed-precision and
distributed optimizers are met by ``platform/cpu_compat`` (CPU stand-ins).
"""
from __future__ import annotations

import gc
from typing import List, Optional, Sequence

import torch

from megatron_rl.actor.precision import Precision
from megatron_rl.platform import distrib_optimizer
from megatron_rl.platform.cpu_compat import cpu_patches_applied
from megatron_rl.platform.cpu_hybrid_optimizer import apply_cpu_hybrid_optimizer

__all__ = ["wrap_ddp", "build_optimizer", "optimizer_config", "OPTIMIZER_KEYS", "optimizer_settings", "offload_errors"]

#: the megatron-core ``OptimizerConfig`` fields ``actor.optimizer_cpu_offload`` needs
OFFLOAD_FIELDS = ("optimizer_cpu_offload", "optimizer_offload_fraction", "use_precision_aware_optimizer")

#: every ``actor`` key the optimizer and its learning-rate schedule are built from (what a resume takes from the
#: config, not from the checkpoint; megatron's adam_eps is fixed at 1e-8)
OPTIMIZER_KEYS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "clip_grad", "lr_warmup_steps",
                  "lr_warmup_fraction", "lr_warmup_init", "lr_decay_style", "lr_decay_steps")


def optimizer_settings(actor_cfg) -> dict:
    """{key: value} of ``OPTIMIZER_KEYS`` in ``actor_cfg`` (saved with a checkpoint, compared on resume)."""
    return {k: getattr(actor_cfg, k) for k in OPTIMIZER_KEYS}


def wrap_ddp(chunks: Sequence[torch.nn.Module], actor_cfg=None) -> List[torch.nn.Module]:
    """Wrap each model chunk in megatron's ``DistributedDataParallel`` (fp32 gradient buffers; sharded for
    ``actor_cfg.use_distributed_optimizer``) and register ``finalize_model_grads`` (DP all-reduce,
    tied embeddings, SP norms) on the model config."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)

    tcfg = chunks[0].config
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=_distributed(actor_cfg),
                                            check_for_nan_in_grad=True)
    wrapped = [DistributedDataParallel(tcfg, ddp_cfg, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    tcfg.finalize_model_grads_func = finalize_model_grads
    return wrapped


def _distributed(actor_cfg) -> bool:
    return bool(getattr(actor_cfg, "use_distributed_optimizer", False))


def offload_errors(actor_cfg, optimizer_fields=None, precision: Optional[Precision] = None) -> List[str]:
    """The problems (each naming its key) of ``actor.optimizer_cpu_offload`` / ``optimizer_offload_fraction`` with the
    rest of ``actor_cfg``, the actor's ``precision`` (default: the one ``actor_cfg`` asks for) and the installed
    megatron-core (``optimizer_fields``: its ``OptimizerConfig`` field names, read from it when None). megatron's ``HybridDeviceOptimizer`` runs through its precision-aware distributed
    optimizer, whose main parameters must be copies of bf16 weights: an fp32 weight's shard is a view, which a torch
    optimizer refuses ("can't optimize a non-leaf Tensor")."""
    frac = getattr(actor_cfg, "optimizer_offload_fraction", 1.0)
    errs = []
    if not 0.0 < frac <= 1.0:
        errs.append(f"actor.optimizer_offload_fraction: must be in (0, 1], got {frac}")
    if not getattr(actor_cfg, "optimizer_cpu_offload", False):
        return errs
    if optimizer_fields is None:
        import dataclasses

        from megatron.core.optimizer import OptimizerConfig

        optimizer_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    missing = [f for f in OFFLOAD_FIELDS if f not in optimizer_fields]
    if missing:
        from importlib.metadata import version

        errs.append(f"actor.optimizer_cpu_offload: the installed megatron-core {version('megatron-core')} has no "
                    f"OptimizerConfig.{', '.join(missing)}; it needs a megatron-core with optimizer CPU offload "
                    f"(0.16.1 and later have it)")
    if not _distributed(actor_cfg):
        errs.append("actor.optimizer_cpu_offload: needs actor.use_distributed_optimizer: true (megatron offloads "
                    "through its precision-aware distributed optimizer)")
    precision = precision or Precision.requested(actor_cfg)
    if not precision.bf16:
        errs.append("actor.optimizer_cpu_offload: needs actor.bf16: true (megatron's offload keeps fp32 main copies "
                    "of bf16 weights; an fp32 actor's weights cannot be offloaded by it)")
    elif precision.fp32_output_layer:
        errs.append("actor.optimizer_cpu_offload: not with actor.fp32_output_layer (megatron's offload cannot take "
                    "the fp32 output layer's weight)")
    return errs


def optimizer_config(actor_cfg, precision: Precision = Precision()):
    """megatron ``OptimizerConfig`` from ``ActorConfig`` (lr, min_lr — each param group's ``max_lr`` / ``min_lr`` of
    megatron's scheduler —, weight_decay, adam betas, clip_grad, use_distributed_optimizer) for the actor's
    ``precision`` (the job plan's; bf16: fp32 main parameters)."""
    from megatron.core.optimizer import OptimizerConfig

    cfg = OptimizerConfig(optimizer="adam", lr=float(actor_cfg.lr), min_lr=float(actor_cfg.min_lr),
                           weight_decay=float(actor_cfg.weight_decay), adam_beta1=float(actor_cfg.adam_beta1),
                           adam_beta2=float(actor_cfg.adam_beta2), adam_eps=1e-8,
                           clip_grad=float(actor_cfg.clip_grad), bf16=precision.bf16,
                           fp16=False, params_dtype=precision.params_dtype,
                           use_distributed_optimizer=_distributed(actor_cfg),
                           **_offload_settings(actor_cfg, precision))
    if cfg.optimizer_cpu_offload:
        # megatron's precision-aware path, set after __post_init__: its Transformer Engine version check crashes
        # without TE (TypeError) and is skipped for CPU offload anyway; the derived flag as __post_init__ sets it
        cfg.use_precision_aware_optimizer = True
        cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    return cfg


def _offload_settings(actor_cfg, precision: Precision) -> dict:
    """megatron's ``OptimizerConfig`` keys of ``actor.optimizer_cpu_offload`` ({} without it; the precision-aware
    switch megatron needs with it is set by ``optimizer_config``), checked with the actor's ``precision``."""
    if not getattr(actor_cfg, "optimizer_cpu_offload", False):
        return {}
    problems = offload_errors(actor_cfg, precision=precision)
    if problems:
        raise ValueError("; ".join(problems))
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=float(actor_cfg.optimizer_offload_fraction))


def build_optimizer(ddp_chunks: Sequence[torch.nn.Module], actor_cfg, precision: Precision = Precision()):
    """``get_megatron_optimizer`` over the DDP-wrapped chunks (separate dense / expert param groups,
    chained by megatron). The model config's ``grad_scale_func`` is set to the optimizer's loss scaling
    (identity for fp32)."""
    from megatron.core.optimizer import get_megatron_optimizer

    if _distributed(actor_cfg):
        distrib_optimizer.install()  # its checkpoints load with torch's Adam (see that module)
    if getattr(actor_cfg, "optimizer_cpu_offload", False) and cpu_patches_applied():
        apply_cpu_hybrid_optimizer()  # on a CPU the CPU is megatron's offload device (see that module)

    opt = get_megatron_optimizer(optimizer_config(actor_cfg, precision), list(ddp_chunks),
                                 use_gloo_process_groups=True)  # the distributed optimizer saves over gloo
    if getattr(actor_cfg, "optimizer_cpu_offload", False):
        # megatron's first HybridDeviceOptimizer (over the unsharded parameters, replaced by the distributed
        # optimizer's over its shards) holds fp32 copies of every parameter -- on the device for the share not
        # offloaded -- and is in a reference cycle (its step hooks): freed now, not whenever Python collects
        gc.collect()
    ddp_chunks[0].config.grad_scale_func = opt.scale_loss
    apply_constant_schedule(opt, actor_cfg)
    return opt


def apply_constant_schedule(opt, actor_cfg) -> None:
    """Set every param group's ``lr`` / ``weight_decay`` as megatron's ``OptimizerParamScheduler`` would
    for a constant schedule: ``lr * lr_mult`` and ``weight_decay * wd_mult``. Without this the torch
    optimizer keeps its constructor defaults and megatron's per-group multipliers (wd_mult = 0 for
    biases and 1-D params such as norm weights) are silently ignored."""
    for group in opt.param_groups:
        group["lr"] = float(actor_cfg.lr) * group.get("lr_mult", 1.0)
        group["weight_decay"] = float(actor_cfg.weight_decay) * group.get("wd_mult", 1.0)

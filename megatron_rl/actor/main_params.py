"""fp32 main parameters of a bf16 actor from the weights it was loaded from, not from their bf16 rounding.

    fp32 = load_keeping_fp32(chunks, lambda: load_checkpoint_into_model(chunks, hf_dir, model_cfg, groups), hf_dir)
    ...  wrap_ddp, build_optimizer (its main parameters: copies of the bf16 weights)
    set_main_params(optimizer, fp32)      # the main parameters: the loaded values exactly

``actor.load_hf`` into an ``actor.bf16`` actor: megatron builds the fp32 main parameters from the bf16 model
weights, so an fp32 HF checkpoint would lose its low bits in the main copy the optimizer steps (and in every
later update). ``load_keeping_fp32`` runs the load with each bf16 parameter's storage swapped for an fp32 one, moves
those to host memory, gives each parameter its bf16 rounding; ``set_main_params`` copies into the main parameters
what each rank's optimizer holds of them (the whole parameter, or with ``actor.use_distributed_optimizer`` only this
rank's data-parallel slice goes back to the device) and frees them.

Where the copy lives: host memory (CPU RAM), 4 bytes per bf16 parameter of the rank's model-parallel shard, on every
rank (8 ranks per node: 8 times that per node), from the load until the optimizer is built. On the device: 4 bytes
per bf16 parameter during the load itself only, before the gradient buffers and the optimizer exist (6 bytes per
parameter with the bf16 weights; training holds those 2, the fp32 gradient buffer's 4 and the optimizer's state). None at all for a source whose weights are all bf16 (their rounding is
exact: a plain load) or for an actor that is never trained (the KL reference: ``keep=False``).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch

from megatron_rl.actor.chained import sub_optimizers
from megatron_rl.convert.storage import weight_dtypes

__all__ = ["load_keeping_fp32", "set_main_params", "needs_fp32_copy"]


def needs_fp32_copy(ckpt_dir: str) -> bool:
    """Whether a checkpoint holds weights bf16 cannot represent (any weight not stored as bf16)."""
    return weight_dtypes(ckpt_dir) != {"BF16"}


def load_keeping_fp32(chunks: Sequence[torch.nn.Module], load: Callable[[], object], ckpt_dir: Optional[str] = None,
                      keep: bool = True) -> Dict[int, torch.Tensor]:
    """Run ``load()`` (it copies a checkpoint into ``chunks``' parameters) with every bf16 parameter held in fp32;
    afterwards the parameters are bf16 again (the loaded values rounded). Returns
    {id(parameter): fp32 values, on the host} of the bf16 parameters; {} (a plain load) when ``keep`` is False or
    ``ckpt_dir``'s weights are all bf16."""
    params = {id(p): p for c in chunks for p in c.parameters() if p.dtype == torch.bfloat16}
    if not params or not keep or (ckpt_dir is not None and not needs_fp32_copy(ckpt_dir)):
        load()
        return {}
    held = {k: p.data for k, p in params.items()}
    fp32 = {k: torch.empty(p.shape, dtype=torch.float32, device=p.device) for k, p in params.items()}
    try:
        for k, p in params.items():
            p.data = fp32[k]
        load()
    finally:
        for k, p in params.items():
            p.data = held[k]
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(fp32[k])
            fp32[k] = fp32[k].cpu()  # (one parameter at a time: the device holds one fp32 copy less each time)
    return fp32


@torch.no_grad()
def set_main_params(optimizer, fp32: Dict[int, torch.Tensor]) -> int:
    """Copy the ``load_keeping_fp32`` values into the fp32 main parameter of each bf16 parameter (megatron's
    mixed-precision optimizer: the whole parameter; its distributed optimizer: this rank's shard of it, with
    ``actor.optimizer_cpu_offload`` the HybridDeviceOptimizer's fp32 copy of that shard); empties
    ``fp32``. Returns the number of main parameters set."""
    n = 0
    for o in sub_optimizers(optimizer):
        if hasattr(o, "shard_fp32_from_float16_groups"):  # distributed: shard = the parameter's range on this rank
            # actor.optimizer_cpu_offload (megatron's precision-aware path): no main shard of its own; the fp32 copy
            # is the HybridDeviceOptimizer's, of the bf16 shard (on the host where offloaded)
            hybrid = getattr(o.optimizer, "param_to_fp32_param", {})
            for model_group, shard_group, main_group in zip(o.model_float16_groups, o.shard_float16_groups,
                                                            o.shard_fp32_from_float16_groups):
                for p, shard, main in zip(model_group, shard_group, main_group):
                    main = hybrid.get(shard) if main is None else main
                    if main is None or id(p) not in fp32:
                        continue
                    r = o._get_model_param_range_map(p)["param"]
                    main.copy_(fp32.pop(id(p)).view(-1)[r.start:r.end])  # only the slice goes to the device
                    n += 1
        elif hasattr(o, "fp32_from_float16_groups"):
            for model_group, main_group in zip(o.float16_groups, o.fp32_from_float16_groups):
                for p, main in zip(model_group, main_group):
                    if id(p) in fp32:
                        main.copy_(fp32.pop(id(p)))
                        n += 1
    fp32.clear()
    return n

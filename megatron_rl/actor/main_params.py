"""fp32 main parameters of a bf16 actor from the weights it was loaded from, not from their bf16 rounding.

    fp32 = load_keeping_fp32(chunks, lambda: load_checkpoint_into_model(chunks, hf_dir, model_cfg, groups))
    ...  wrap_ddp, build_optimizer (its main parameters: copies of the bf16 weights)
    set_main_params(optimizer, fp32)      # the main parameters: the loaded values exactly

``actor.load_hf`` into an ``actor.bf16`` actor: megatron builds the fp32 main parameters from the bf16 model
weights, so an fp32 HF checkpoint would lose its low bits in the main copy the optimizer steps (and in every
later update). ``load_keeping_fp32`` runs the load with each bf16 parameter's storage swapped for an fp32 one, keeps
those fp32 tensors and gives each parameter its bf16 rounding; ``set_main_params`` copies them into the main
parameters (whole, or this rank's shard with ``actor.use_distributed_optimizer``) and frees them. Cost: 4 bytes per
bf16 parameter of the rank, from the load until the optimizer is built. A bf16 source loads the same either way.
"""
from __future__ import annotations

from typing import Callable, Dict, Sequence

import torch

__all__ = ["load_keeping_fp32", "set_main_params"]


def load_keeping_fp32(chunks: Sequence[torch.nn.Module], load: Callable[[], object]) -> Dict[int, torch.Tensor]:
    """Run ``load()`` (it copies a checkpoint into ``chunks``' parameters) with every bf16 parameter held in fp32;
    afterwards the parameters are bf16 again (the loaded values rounded). Returns {id(parameter): fp32 values}
    of the bf16 parameters."""
    params = {id(p): p for c in chunks for p in c.parameters() if p.dtype == torch.bfloat16}
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
    return fp32


def _optimizers(optimizer) -> list:
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]


@torch.no_grad()
def set_main_params(optimizer, fp32: Dict[int, torch.Tensor]) -> int:
    """Copy the ``load_keeping_fp32`` values into the fp32 main parameter of each bf16 parameter (megatron's
    mixed-precision optimizer: the whole parameter; its distributed optimizer: this rank's shard of it); empties
    ``fp32``. Returns the number of main parameters set."""
    n = 0
    for o in _optimizers(optimizer):
        if hasattr(o, "shard_fp32_from_float16_groups"):  # distributed: shard = the parameter's range on this rank
            pairs = zip(o.model_float16_groups, o.shard_fp32_from_float16_groups)
            for model_group, main_group in pairs:
                for p, main in zip(model_group, main_group):
                    if main is None or id(p) not in fp32:
                        continue
                    r = o._get_model_param_range_map(p)["param"]
                    main.copy_(fp32[id(p)].view(-1)[r.start:r.end])
                    n += 1
        elif hasattr(o, "fp32_from_float16_groups"):
            for model_group, main_group in zip(o.float16_groups, o.fp32_from_float16_groups):
                for p, main in zip(model_group, main_group):
                    if id(p) in fp32:
                        main.copy_(fp32[id(p)])
                        n += 1
    fp32.clear()
    return n

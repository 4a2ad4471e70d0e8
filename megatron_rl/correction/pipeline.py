"""Pipeline parallel: make the last stage's correction result available on every stage.

Log-probs exist only on the last pipeline stage, so the correction runs there; stages that also need
the weights / mask / metrics (e.g. for logging on rank 0 or loss bookkeeping) receive them with
:func:`broadcast_from_last_stage` over the PP group: one small object broadcast (shapes, dtypes,
metrics) plus one tensor broadcast per tensor (mask, weights, valid mask), each staged for the group's
backend by ``parallel.devices`` (NCCL: CUDA, gloo: CPU), whatever device the result lives on.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.correction.core import CorrectionResult
from megatron_rl.parallel.devices import broadcast_, collective_device


#: The CorrectionResult tensors every pipeline stage receives (None where the last stage has none).
_SHARED_TENSORS = ("response_mask", "weights", "valid_mask")


def broadcast_from_last_stage(result: Optional[CorrectionResult], pp_group,
                              device: Optional[torch.device] = None) -> CorrectionResult:
    """Return the last stage's ``result`` on every rank of ``pp_group``.

    Args:
        result: the :class:`CorrectionResult` on the last stage; ignored (may be None) elsewhere.
        pp_group: the pipeline-parallel group; its last rank (in group order) is the source.
        device: where received tensors live (default: the device the PP group's backend takes,
            ``parallel.devices.collective_device``).
    """
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        if result is None:
            raise ValueError("broadcast_from_last_stage: no PP group and no result on this rank")
        return result
    ranks = dist.get_process_group_ranks(pp_group)
    src = ranks[-1]
    is_src = dist.get_rank() == src
    if is_src and result is None:
        raise ValueError(f"broadcast_from_last_stage: last stage (global rank {src}) has no result")
    if device is None:
        device = result.response_mask.device if is_src else collective_device(pp_group)
    header = [None]
    if is_src:
        header[0] = {
            "tensors": {name: None if getattr(result, name) is None else
                        (tuple(getattr(result, name).shape), getattr(result, name).dtype) for name in _SHARED_TENSORS},
            "metrics": dict(result.metrics), "num_collectives": result.num_collectives,
            "old_from_rollout": result.old_from_rollout, "weights_in_loss": result.weights_in_loss,
        }
    dist.broadcast_object_list(header, src=src, group=pp_group)
    h = header[0]
    got = {}
    for name, spec in h["tensors"].items():   # the same order on every rank: the source's header
        if spec is None:
            got[name] = None
            continue
        got[name] = getattr(result, name).contiguous() if is_src else torch.empty(spec[0], dtype=spec[1], device=device)
        broadcast_(got[name], src=src, group=pp_group)
    if is_src:
        return result
    return CorrectionResult(**got, metrics=h["metrics"], num_collectives=h["num_collectives"],
                            old_from_rollout=h["old_from_rollout"], weights_in_loss=h["weights_in_loss"])

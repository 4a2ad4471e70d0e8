"""The critic's two passes through megatron's schedule: values (forward only) and one value-loss optimizer step.

Both cut micro-batches exactly as the actor's passes do (``MicroBatcher``) and read the model's [b, s, 1] output
as per-token values: column t holds V(state after token t), the value of the state before token t+1 -- verl's
alignment (``values[:, t]`` for the response token at t+1). The loss is ``losses.compute_value_loss`` with global
denominators over the DP group, scaled like the policy loss (x num_microbatches x dp_size) to undo megatron's
scaling, so gradients are exactly the full batch's.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence, Tuple

import torch

from megatron_rl.actor.batch import RolloutBatch, scatter_rows
from megatron_rl.actor.batcher import MicroBatcher
from megatron_rl.actor.forward import broadcast_from_last_stage_tensors
from megatron_rl.actor.schedule import MicroBatch, actor_device, run_schedule
from megatron_rl.actor.train_step import broadcast_object, forward_step
from megatron_rl.losses import global_denominators, merge_metrics, reduce_metrics
from megatron_rl.losses.metrics import SumCount
from megatron_rl.losses.value import compute_value_loss
from megatron_rl.parallel.groups import ActorGroups

__all__ = ["compute_values", "train_value_mini_batch", "VALUE_INPUTS"]

VALUE_INPUTS = ("values", "returns", "response_mask")
"""Per-token [B, L-1] inputs of the value loss: the values before this step, the returns, the response mask."""


def _values_of(output: torch.Tensor) -> torch.Tensor:
    return output[..., 0].to(torch.float32)


def _values_loss_func(mb: MicroBatch, output: torch.Tensor):
    return output.new_zeros(()), {"values": _values_of(output).detach()}


def compute_values(model_chunks: Sequence[torch.nn.Module], batch: RolloutBatch, *,
                   bounds: Sequence[Tuple[int, int]], groups: ActorGroups,
                   batcher: MicroBatcher) -> torch.Tensor:
    """fp32 [B, L-1] values of ``batch`` (this rank's DP shard) on every rank of the PP group; 0 where
    t + 1 >= lengths[b]. Collective over the model-parallel group."""
    mbs = batcher.cut(batch, bounds, groups)
    for chunk in model_chunks:
        chunk.eval()
    step = functools.partial(forward_step, _values_loss_func)
    with torch.no_grad():
        results = run_schedule(model_chunks, mbs, step, forward_only=True,
                               vp_group_size=batcher.vp_group_size(len(mbs)))
    B, W = batch.num_rows, batch.max_length - 1
    dev = actor_device()
    if groups.is_last_stage:
        pieces = []
        for mb, res in zip(mbs, results):
            full = mb.layout.gather_rows(res["values"], groups)
            pieces.append((mb.rows, full[:, : min(full.shape[1], batch.max_length) - 1]))
        out = scatter_rows(pieces, B, W, device=dev)
        valid = torch.arange(1, W + 1, device=dev).unsqueeze(0) < batch.lengths.to(dev).unsqueeze(1)
        out = out * valid
    else:
        out = torch.empty(B, W, dtype=torch.float32, device=dev)
    broadcast_from_last_stage_tensors([out], groups)
    return out


class _ValueMicroBatchLoss:
    """Last stage: the value loss of one micro-batch, scaled for megatron, plus its (sum, count) metrics."""

    def __init__(self, cliprange_value: float, loss_agg_mode: str, denominators, scale: float,
                 loss_scale_factor: Optional[float]):
        self.cliprange_value, self.loss_agg_mode = cliprange_value, loss_agg_mode
        self.denominators, self.scale, self.loss_scale_factor = denominators, scale, loss_scale_factor

    def __call__(self, mb: MicroBatch, output: torch.Tensor):
        vpreds = mb.layout.loss_rows(_values_of(output))
        p = mb.per_token
        out = compute_value_loss(vpreds, p["returns"], p["values"], p["response_mask"], self.cliprange_value,
                                 self.loss_agg_mode, self.denominators, loss_scale_factor=self.loss_scale_factor,
                                 seq_valid_tokens=mb.seq_valid_tokens)
        metrics = dict(out.metrics)
        one = torch.ones((), dtype=torch.float64, device=output.device)
        metrics["vf_loss"] = SumCount(out.loss.detach().to(torch.float64).reshape(()), one)
        return out.loss * self.scale, {"metrics": metrics}


def train_value_mini_batch(model_chunks: Sequence[torch.nn.Module], optimizer, batch: RolloutBatch,
                           per_token: Dict[str, torch.Tensor], *, cliprange_value: float, loss_agg_mode: str,
                           bounds: Sequence[Tuple[int, int]], groups: ActorGroups,
                           batcher: MicroBatcher,
                           loss_scale_factor: Optional[float] = None) -> Dict[str, float]:
    """Forward/backward of the value loss over this rank's rows of one mini-batch and one optimizer step.
    ``per_token``: each of ``VALUE_INPUTS`` as [B, L-1]. Returns vf_loss (the global batch's aggregated loss),
    vf_clipfrac and vpred_mean (token means over the global batch), grad_norm, update_successful; identical on
    every rank. Collective over every rank."""
    missing = [k for k in VALUE_INPUTS if per_token.get(k) is None]
    if missing or set(per_token) - set(VALUE_INPUTS):
        raise ValueError(f"train_value_mini_batch: per-token inputs must be exactly {VALUE_INPUTS}, got "
                         f"{sorted(per_token)}")
    dev = actor_device()
    inputs = {k: per_token[k].to(dev) for k in VALUE_INPUTS}
    den = global_denominators(inputs["response_mask"], group=groups.dp_group if groups.dp_size > 1 else None)
    mbs = batcher.cut(batch, bounds, groups, per_token=inputs)
    loss_func = _ValueMicroBatchLoss(float(cliprange_value), loss_agg_mode, den, float(len(mbs) * groups.dp_size),
                                     loss_scale_factor)
    for chunk in model_chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    results = run_schedule(model_chunks, mbs, functools.partial(forward_step, loss_func), forward_only=False,
                           vp_group_size=batcher.vp_group_size(len(mbs)))
    update_successful, grad_norm, _ = optimizer.step()
    metrics = None
    if groups.is_last_stage:
        merged = merge_metrics(r["metrics"] for r in results)
        merged = reduce_metrics(merged, group=groups.dp_cp_group if groups.dp_size * groups.cp_size > 1 else None)
        metrics = {k: v.mean() for k, v in merged.items() if k != "vf_loss"}
        metrics["vf_loss"] = float(merged["vf_loss"].sum)
    metrics = broadcast_object(metrics, groups)
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["update_successful"] = float(bool(update_successful))
    return metrics

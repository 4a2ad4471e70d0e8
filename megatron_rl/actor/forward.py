"""The log-prob pass: forward-only through megatron's pipeline schedule, log-probs + entropy of every
scored token, made available on every pipeline stage.

Flow (``compute_log_probs``):
  1. micro-batches of variable length (``MicroBatcher.cut``; trimmed per micro-batch);
  2. ``get_forward_backward_func()(forward_only=True)``; on the last stage the model returns
     vocab-parallel logits [b, s, V/TP] and ``megatron_rl.logprobs.vocab_parallel_logprobs`` turns them
     into log-probs and entropy of softmax(logits / temperature) against ``targets`` (token t+1 at
     position t) — exact across TP (two small all-reduces), never an fp32 copy of the logits;
  3. per micro-batch results gathered over CP (zigzag inverse), placed into [B, L-1];
  4. broadcast from the last stage over the PP group, so every rank of the model-parallel group holds
     the log-probs of its DP shard (what the correction and the loss bookkeeping need).

Choice: the logits path (GPTModel's output layer, then ``vocab_parallel_logprobs``) rather than
``fused_linear_logprobs`` on the final hidden states: megatron-core's GPTModel has no public hook that
returns the post-norm hidden states without also running the output layer, and the logits path keeps
the TE / SP / tied-embedding handling of megatron's own output layer. Memory per micro-batch: one
[b, s, V/TP] logits tensor in the params dtype (the log-prob kernel itself is chunked).

Columns of padding (t + 1 >= length) are 0; prompt columns hold the prompt tokens' log-probs.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import RolloutBatch, scatter_rows
from megatron_rl.actor.batcher import MicroBatcher
from megatron_rl.actor.schedule import MicroBatch, actor_device, run_schedule
from megatron_rl.logprobs import vocab_parallel_logprobs
from megatron_rl.parallel.groups import ActorGroups

__all__ = ["compute_log_probs", "check_token_ids", "broadcast_from_last_stage_tensors"]


def check_token_ids(batch: RolloutBatch, vocab_size: int) -> None:
    """Raise ValueError naming the row/column of the first token id outside [0, vocab_size)."""
    bad = (batch.tokens < 0) | (batch.tokens >= vocab_size)
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"RolloutBatch.tokens[{b}, {t}] = {int(batch.tokens[b, t])} is outside the model "
                         f"vocabulary [0, {vocab_size})")


def _logprob_loss_func(mb: MicroBatch, tp_group, temperature: float, compute_entropy: bool,
                       logits: torch.Tensor, compute_sum_pi_squared: bool = False):
    res = vocab_parallel_logprobs(logits, mb.targets, tp_group=tp_group, temperature=temperature,
                                  compute_entropy=compute_entropy, compute_sum_pi_squared=compute_sum_pi_squared)
    out = {"log_probs": res[0].detach()}
    if compute_entropy:
        out["entropy"] = res[1].detach()
    if compute_sum_pi_squared:
        out["sum_pi_squared"] = res[2].detach()
    return logits.new_zeros(()), out


def _forward_step(tp_group, temperature, compute_entropy, compute_sum_pi_squared, mb: MicroBatch, model):
    output = model(mb.tokens, mb.position_ids, attention_mask=None, **mb.model_kwargs)
    return output, functools.partial(_logprob_loss_func, mb, tp_group, temperature, compute_entropy,
                                     compute_sum_pi_squared=compute_sum_pi_squared)


def broadcast_from_last_stage_tensors(tensors: Sequence[torch.Tensor], groups: ActorGroups) -> None:
    """In place: every rank of ``groups.pp_group`` receives the last stage's ``tensors`` (same shapes
    and dtypes must already be allocated on every stage)."""
    if groups.pp_size == 1:
        return
    src = dist.get_process_group_ranks(groups.pp_group)[-1]
    for t in tensors:
        dist.broadcast(t, src=src, group=groups.pp_group)


def compute_log_probs(model_chunks: Sequence[torch.nn.Module], batch: RolloutBatch, *,
                      bounds: Sequence[Tuple[int, int]], temperature: float, groups: ActorGroups,
                      batcher: MicroBatcher, compute_entropy: bool = True,
                      replay=None, compute_sum_pi_squared: bool = False) -> Tuple[Optional[torch.Tensor], ...]:
    """Log-probs (and entropy) of every token of ``batch`` (this rank's DP shard) under
    softmax(logits / temperature); with ``compute_sum_pi_squared`` a third tensor, sum_j p_j^2 of that softmax
    at every column (verl's ``calculate_sum_pi_squared``; 0 at padding), the same way.

    Returns fp32 ``(log_probs [B, L-1], entropy [B, L-1] or None)`` on every rank of the PP group
    (column t scores token t+1; 0 where t + 1 >= lengths[b]). ``bounds``: the micro-batches, contiguous
    [start, end) row blocks (``MicroBatcher.plan``), cut into model inputs by ``batcher`` (the actor's: the job
    plan's). ``replay``: a ``router_replay.ReplayPass`` that sets / records MoE routing around each chunk's
    forward (its ``micro_batches`` are set for ``assemble``). Collective over the model-parallel group.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    mbs = batcher.cut(batch, bounds, groups)
    for chunk in model_chunks:
        chunk.eval()
    step = functools.partial(_forward_step, groups.tp_group, float(temperature), compute_entropy,
                             bool(compute_sum_pi_squared))
    if replay is not None:  # MoE routing replay / recording (megatron_rl.actor.router_replay.ReplayPass)
        step = replay.wrap(step)
    with torch.no_grad():
        results = run_schedule(model_chunks, mbs, step, forward_only=True,
                               vp_group_size=batcher.vp_group_size(len(mbs)))
    if replay is not None:
        replay.micro_batches = mbs
    B, W = batch.num_rows, batch.max_length - 1
    keys = ["log_probs"] + (["entropy"] if compute_entropy else []) + (
        ["sum_pi_squared"] if compute_sum_pi_squared else [])
    if groups.is_last_stage:
        if len(results) != len(mbs):
            raise RuntimeError(f"log-prob pass: {len(results)} results for {len(mbs)} micro-batches")
        out = {}
        for k in keys:
            pieces = []
            for mb, res in zip(mbs, results):
                full = mb.layout.gather_rows(res[k], groups)
                # a micro-batch padded beyond the batch length (to a multiple of TP for SP / 2 x CP) is cut back
                pieces.append((mb.rows, full[:, : min(full.shape[1], batch.max_length) - 1]))
            out[k] = scatter_rows(pieces, B, W, device=actor_device())
        valid = torch.arange(1, W + 1, device=actor_device()).unsqueeze(0) < batch.lengths.to(actor_device()).unsqueeze(1)
        for k in keys:
            out[k] = out[k] * valid
    else:
        out = {k: torch.empty(B, W, dtype=torch.float32, device=actor_device()) for k in keys}
    broadcast_from_last_stage_tensors([out[k] for k in keys], groups)
    if compute_sum_pi_squared:
        return out["log_probs"], out.get("entropy"), out["sum_pi_squared"]
    return out["log_probs"], out.get("entropy")

"""Model inputs per micro-batch and one call of megatron's pipeline schedule over them.

``prepare_micro_batches`` turns a (DP-shard) ``RolloutBatch`` plus per-token tensors ([B, L-1], column
t scores token t+1) into ``MicroBatch`` objects the model consumes:
  * rows split into ``micro_batch_size`` chunks, each cut to its own longest row (variable sequence
    lengths) rounded up to ``groups.seq_multiple`` (TP with sequence parallel, 2 x CP with CP);
  * ``targets[:, t] = tokens[:, t+1]`` (pad id in the last column) so the log-prob at position t of
    the model output scores token t+1 — computed on the full logits tensor, no shifted copy;
  * per-token tensors placed at the same positions (one zero column at the end), then every
    sequence-shaped tensor cut to this CP rank's zigzag part (``cp_split``).

``run_schedule`` calls ``megatron.core.pipeline_parallel.get_forward_backward_func()`` (1F1B with PP,
no-pipelining otherwise; interleaved with VPP) with ``forward_step_func(mb, model) -> (output,
loss_func)``; it returns megatron's list of per-micro-batch loss_func dicts (last stage only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_rl.actor.batch import RolloutBatch, fit_columns
from megatron_rl.actor.cp import cp_split
from megatron_rl.parallel.groups import ActorGroups

__all__ = ["MicroBatch", "prepare_micro_batches", "run_schedule", "actor_device"]


def actor_device() -> torch.device:
    """Where the model's inputs live: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class MicroBatch:
    """Inputs of one micro-batch on this rank (sequence dims already cut to this CP rank)."""

    rows: Tuple[int, int]
    """[start, end) rows of the (DP-shard) batch."""
    full_length: int
    """Padded sequence length s before the CP split (tokens / positions / targets span s)."""
    tokens: torch.Tensor
    """[b, s/CP] int64 input ids."""
    position_ids: torch.Tensor
    """[b, s/CP] int64 positions (0-based per row)."""
    targets: torch.Tensor
    """[b, s/CP] int64: the token each position scores (token t+1 for position t)."""
    per_token: Dict[str, Optional[torch.Tensor]] = field(default_factory=dict)
    """Per-token tensors at the same positions ([b, s/CP]); e.g. old_log_probs, advantages, mask."""
    seq_valid_tokens: Optional[torch.Tensor] = None
    """[b] float64 valid tokens of each whole row under ``per_token['response_mask']`` (before the CP
    split) — what seq-mean-token-mean divides by."""


def prepare_micro_batches(batch: RolloutBatch, micro_batch_size: int, groups: ActorGroups, trim: bool = True,
                          per_token: Optional[Dict[str, Optional[torch.Tensor]]] = None) -> List[MicroBatch]:
    """Cut ``batch`` (and ``per_token`` [B, L-1] tensors; None values stay None) into micro-batches."""
    per_token = per_token or {}
    B, Lm1 = batch.num_rows, batch.max_length - 1
    for name, t in per_token.items():
        if t is not None and tuple(t.shape) != (B, Lm1):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [B, L-1] = [{B}, {Lm1}] "
                             f"(column t scores token t+1 of RolloutBatch.tokens)")
    mult = groups.seq_multiple
    dev = actor_device()
    out = []
    for (start, end), mb in batch.micro_batches(micro_batch_size, trim=trim, multiple_of=mult):
        s = mb.max_length
        b = end - start
        tokens = mb.tokens.to(dev)
        targets = torch.cat([tokens[:, 1:], tokens.new_full((b, 1), batch.pad_id)], dim=1)
        pos = torch.arange(s, dtype=torch.int64, device=dev).unsqueeze(0).expand(b, s).contiguous()
        extras: Dict[str, Optional[torch.Tensor]] = {}
        svt = None
        for name, t in per_token.items():
            if t is None:
                extras[name] = None
                continue
            # columns [0, s-1) of the batch tensor, then one zero column (position s-1 scores nothing)
            placed = fit_columns(fit_columns(t[start:end].to(dev), s - 1), s)
            if name == "response_mask":
                svt = (placed != 0).sum(dim=-1).to(torch.float64)
            extras[name] = cp_split(placed, groups.cp_rank, groups.cp_size)
        out.append(MicroBatch(rows=(start, end), full_length=s,
                              tokens=cp_split(tokens, groups.cp_rank, groups.cp_size),
                              position_ids=cp_split(pos, groups.cp_rank, groups.cp_size),
                              targets=cp_split(targets, groups.cp_rank, groups.cp_size),
                              per_token=extras, seq_valid_tokens=svt))
    return out


def run_schedule(model_chunks: Sequence[torch.nn.Module], micro_batches: List[MicroBatch],
                 forward_step: Callable[[MicroBatch, torch.nn.Module], Tuple[torch.Tensor, Callable]],
                 forward_only: bool, pp_size: int = 1) -> List[dict]:
    """One pass of megatron's schedule over ``micro_batches``; returns the loss_func dicts (last stage).
    With interleaved VPP (several chunks) megatron needs at least ``pp_size`` micro-batches."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("run_schedule: no micro-batches")
    if len(model_chunks) > 1 and len(micro_batches) < pp_size:
        rows = sum(mb.tokens.shape[0] for mb in micro_batches)
        raise ValueError(f"interleaved pipeline (virtual_pipeline_model_parallel_size={len(model_chunks)}) needs "
                         f">= pipeline_model_parallel_size={pp_size} micro-batches per step, got "
                         f"{len(micro_batches)} ({rows} rows / actor.micro_batch_size); lower "
                         f"actor.micro_batch_size or send more rows per DP rank / mini-batch")

    def step(data_iterator, model):
        return forward_step(next(data_iterator), model)

    its = [iter(micro_batches) for _ in model_chunks]
    return get_forward_backward_func()(
        forward_step_func=step, data_iterator=its if len(its) > 1 else its[0], model=list(model_chunks),
        num_microbatches=len(micro_batches),
        seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
        micro_batch_size=max(mb.tokens.shape[0] for mb in micro_batches),
        forward_only=forward_only)

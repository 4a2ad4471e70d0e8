"""Context-parallel (CP) sequence split and gather in megatron's zigzag convention.

megatron-core (``megatron.core.utils.get_batch_on_this_cp_rank``) cuts each sequence of length s into
2 x CP equal chunks and gives CP rank r the chunks r and 2*CP-1-r (load balance under causal
attention); RoPE and TE's attention follow the same convention. ``cp_split`` does that cut for any
per-token tensor ([b, s, ...], sequence on dim 1); ``cp_gather`` is its inverse over ``cp_group``
(forward-only: used for log-probs / entropy leaving the model, no autograd).

On CPU CP cannot run: megatron's local ``DotProductAttention`` asserts "Context parallelism is only
supported by TEDotProductAttention!" and transformer-engine does not install without CUDA. These
functions are tested on their own (``tests/integration/test_actor_cp.py``) and used by the log-prob pass and the
train step when ``context_parallel_size > 1`` on GPU.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["cp_split", "cp_gather"]


def _chunks_of(rank: int, size: int):
    return rank, 2 * size - 1 - rank


def cp_split(x: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This CP rank's zigzag part of ``x`` [b, s, ...] (s divisible by 2 x cp_size): chunks
    ``cp_rank`` and ``2*cp_size-1-cp_rank`` of 2*cp_size, concatenated along dim 1."""
    if cp_size == 1:
        return x
    s = x.shape[1]
    if s % (2 * cp_size):
        raise ValueError(f"cp_split: sequence length {s} is not divisible by 2 x context_parallel_size "
                         f"= {2 * cp_size}")
    c = s // (2 * cp_size)
    a, b = _chunks_of(cp_rank, cp_size)
    return torch.cat([x[:, a * c:(a + 1) * c], x[:, b * c:(b + 1) * c]], dim=1).contiguous()


def cp_gather(x_local: torch.Tensor, cp_group, cp_size: int) -> torch.Tensor:
    """Inverse of ``cp_split`` over ``cp_group``: every rank gets the full [b, s, ...] tensor."""
    if cp_size == 1:
        return x_local
    parts = [torch.empty_like(x_local) for _ in range(cp_size)]
    dist.all_gather(parts, x_local.contiguous(), group=cp_group)
    c = x_local.shape[1] // 2
    chunks = [None] * (2 * cp_size)
    for r, p in enumerate(parts):
        a, b = _chunks_of(r, cp_size)
        chunks[a], chunks[b] = p[:, :c], p[:, c:]
    return torch.cat(chunks, dim=1)

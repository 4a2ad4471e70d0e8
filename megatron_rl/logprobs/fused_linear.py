"""``fused_linear_logprobs``: output projection + vocab-parallel log-probs/entropy, never materialising
the [tokens, V/TP] logits.

Forward per token chunk equals ``vocab_parallel_logprobs(hidden @ W_r.T)``; backward recomputes the logits block
by block (5 GEMMs of tokens x V/TP x H instead of 3: the price of never storing them). The rule to keep:
with ``reduce_hidden_grad=True`` (default) the hidden gradient is all-reduced over ``tp_group``; pass False when
``hidden`` comes out of megatron's ``copy_to_tensor_model_parallel_region`` / sequence-parallel gather, whose
backward already sums over TP (reducing twice multiplies the gradient by TP). The backward's passes and memory:
docs/logprob_kernels.md.

    logp, ent = fused_linear_logprobs(hidden, output_layer.weight, target_ids, tp_group=tp_group)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .backend import BlockOps, default_chunk_rows, resolve_backend
from .combine import combine_partials
from .sum_pi_squared import chunk_rows_for, chunk_sum_pi_squared
from .validation import (check_chunk_size, check_float_tensor, check_partition, check_targets,
                         check_temperature)
from .vocab_parallel import flatten_rows


def _buffer(n: int, dtype, device):
    return torch.empty(n, dtype=dtype, device=device)


def _nonfinite_message(h2d, weight, bad, token_shape, rank) -> str:
    n_bad = int(bad.sum())
    first = int(bad.nonzero()[0, 0])
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(token_shape))) \
        if len(token_shape) else ()
    nh = int((~torch.isfinite(h2d)).sum())
    nw = int((~torch.isfinite(weight)).sum())
    where = []
    if nh:
        where.append(f"hidden has {nh} NaN/inf value(s)")
    if nw:
        where.append(f"output_weight_shard on TP rank {rank} has {nw} NaN/inf value(s)")
    if not where:
        where.append(f"the logits hidden @ output_weight_shard^T overflow {h2d.dtype} or are non-finite "
                     f"on another TP rank")
    return (f"non-finite logits (NaN/inf) for {n_bad} token(s), first at token index {pos}: "
            + "; ".join(where))


class _FusedLinearLogprobs(torch.autograd.Function):
    """Inputs (hidden2d [N, H], weight [Vp, H], local target columns [N]); outputs fp32 (logp, ent, sum p^2)
    (sum p^2: an empty tensor unless ``want_spp``; never differentiable)."""

    @staticmethod
    def forward(ctx, h2d, weight, t_local, inv_temp, chunk_rows, tp_group, world_size, rank,
                backend, token_shape, reduce_hidden_grad, want_spp=False):
        ops = BlockOps(backend, h2d.device)
        n, vp = h2d.shape[0], weight.shape[0]
        stats = torch.empty(4, n, dtype=torch.float32, device=h2d.device)
        xbuf = _buffer(min(n, chunk_rows) * vp, h2d.dtype, h2d.device)
        wt = weight.t()
        for i in range(0, n, chunk_rows):
            j = min(n, i + chunk_rows)
            x = xbuf[:(j - i) * vp].view(j - i, vp)
            torch.matmul(h2d[i:j], wt, out=x)
            m, s, tgt, spz = ops.partials(x, t_local[i:j], inv_temp)
            stats[0, i:j], stats[1, i:j], stats[2, i:j], stats[3, i:j] = m, s, tgt, spz
        del xbuf, ops
        logp, ent, mx, log_s, bad = combine_partials(stats[0], stats[1], stats[2], stats[3], inv_temp, tp_group,
                                                        world_size)
        if bool(bad.any()):
            raise ValueError(_nonfinite_message(h2d, weight, bad, token_shape, rank))
        spp = _sum_pi_squared(h2d, weight, mx, log_s, inv_temp, chunk_rows, tp_group, world_size) if want_spp \
            else h2d.new_empty(0, dtype=torch.float32)
        ctx.save_for_backward(h2d, weight, t_local, mx, log_s, ent)
        ctx.cfg = (inv_temp, chunk_rows, tp_group, world_size, backend, reduce_hidden_grad)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(spp)
        return logp, ent, spp

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_spp=None):
        h2d, weight, t_local, mx, log_s, ent = ctx.saved_tensors
        inv_temp, chunk_rows, tp_group, world_size, backend, reduce_hidden_grad = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.zeros_like(h2d) if need_h else None
        dw = torch.zeros_like(weight) if need_w else None
        if g_logp is None and g_ent is None:
            return dh, dw, *([None] * 10)
        g_logp = None if g_logp is None else g_logp.float()
        g_ent = None if g_ent is None else g_ent.float()
        ops = BlockOps(backend, h2d.device)
        n, vp = h2d.shape[0], weight.shape[0]
        dev, dt = h2d.device, h2d.dtype
        if need_h:
            rows = min(n, chunk_rows)
            xbuf, gbuf = _buffer(rows * vp, dt, dev), _buffer(rows * vp, weight.dtype, dev)
            wt = weight.t()
            for i in range(0, n, chunk_rows):
                j = min(n, i + chunk_rows)
                x = xbuf[:(j - i) * vp].view(j - i, vp)
                g = gbuf[:(j - i) * vp].view(j - i, vp)
                torch.matmul(h2d[i:j], wt, out=x)
                ops.grad(x, t_local[i:j], inv_temp, mx[i:j], log_s[i:j], ent[i:j],
                         None if g_logp is None else g_logp[i:j], None if g_ent is None else g_ent[i:j], g)
                torch.matmul(g, weight, out=dh[i:j])
            del xbuf, gbuf
            if reduce_hidden_grad and world_size > 1:
                dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=tp_group)
        if need_w:
            # vocab-column blocks with the same element budget as a token chunk
            cols = max(1, min(vp, (chunk_rows * vp) // max(1, n)))
            xbuf, gbuf = _buffer(n * cols, dt, dev), _buffer(n * cols, weight.dtype, dev)
            for v0 in range(0, vp, cols):
                v1 = min(vp, v0 + cols)
                x = xbuf[:n * (v1 - v0)].view(n, v1 - v0)
                g = gbuf[:n * (v1 - v0)].view(n, v1 - v0)
                torch.matmul(h2d, weight[v0:v1].t(), out=x)
                ops.grad(x, t_local - v0, inv_temp, mx, log_s, ent, g_logp, g_ent, g)
                torch.matmul(g.t(), h2d, out=dw[v0:v1])
        return dh, dw, *([None] * 10)


@torch.no_grad()
def _sum_pi_squared(h2d, weight, mx, log_s, inv_temp, chunk_rows, tp_group, world_size) -> torch.Tensor:
    """sum p^2 per token: the logits recomputed chunk by chunk (one more GEMM), then one SUM all-reduce of [N]."""
    n, vp = h2d.shape[0], weight.shape[0]
    out = torch.zeros(n, dtype=torch.float32, device=h2d.device)
    step = chunk_rows_for(chunk_rows, vp, h2d.device)
    xbuf = _buffer(min(n, step) * vp, h2d.dtype, h2d.device)
    buf = _buffer(min(n, step) * vp, torch.float32, h2d.device)
    for i in range(0, n, step):
        j = min(n, i + step)
        x = xbuf[:(j - i) * vp].view(j - i, vp)
        torch.matmul(h2d[i:j], weight.t(), out=x)
        out[i:j] = chunk_sum_pi_squared(x, mx[i:j], log_s[i:j], inv_temp, buf)
    if world_size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=tp_group)
    return out


def fused_linear_logprobs(hidden: torch.Tensor, output_weight_shard: torch.Tensor, target_ids: torch.Tensor,
                          tp_group=None, temperature: float = 1.0, compute_entropy: bool = True,
                          chunk_size: Optional[int] = None, backend: str = "auto",
                          reduce_hidden_grad: bool = True, compute_sum_pi_squared: bool = False):
    """Log-probs / entropy of softmax((hidden @ W^T) / T) with W vocab-sharded, without storing logits.

    Args:
        hidden: [..., H] fp32/bf16/fp16 activations (full sequence, identical on every TP rank).
        output_weight_shard: [V/TP, H] this rank's rows of the output layer weight (same dtype/device).
        target_ids: [...] global token ids in [0, V), identical on every TP rank.
        tp_group, temperature, compute_entropy, chunk_size, backend: as ``vocab_parallel_logprobs``.
        reduce_hidden_grad: all-reduce (SUM) d hidden over ``tp_group`` in backward (see module doc).
        compute_sum_pi_squared: also return sum_j p_j^2 per token (one more GEMM, chunked, and one more
            all-reduce of [tokens]; ``sum_pi_squared.py``).
    Returns:
        (logp, entropy) fp32 [...] (entropy None if not requested), differentiable w.r.t. ``hidden`` and
        ``output_weight_shard``; with ``compute_sum_pi_squared`` a third fp32 [...] tensor (no gradient).
    """
    check_float_tensor(hidden, "hidden")
    check_float_tensor(output_weight_shard, "output_weight_shard", min_dim=2)
    if output_weight_shard.dim() != 2:
        raise ValueError(f"output_weight_shard must be 2-D [V/TP, H], got shape {tuple(output_weight_shard.shape)}")
    if output_weight_shard.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden size mismatch: hidden {tuple(hidden.shape)} has H={hidden.shape[-1]} but "
                         f"output_weight_shard {tuple(output_weight_shard.shape)} has H={output_weight_shard.shape[1]}")
    if output_weight_shard.dtype != hidden.dtype or output_weight_shard.device != hidden.device:
        raise ValueError(f"hidden ({hidden.dtype}, {hidden.device}) and output_weight_shard "
                         f"({output_weight_shard.dtype}, {output_weight_shard.device}) must share dtype and device")
    token_shape = tuple(hidden.shape[:-1])
    check_targets(target_ids, token_shape, hidden.device)
    temperature = check_temperature(temperature)
    chunk_size = check_chunk_size(chunk_size)
    backend = resolve_backend(backend, hidden.device)
    vp = output_weight_shard.shape[0]
    targets = target_ids.reshape(-1).to(torch.int64)
    info = check_partition(targets, token_shape, vp, tp_group, "output_weight_shard")
    h2d = flatten_rows(hidden, "hidden")
    if chunk_size is None:
        chunk_size = default_chunk_rows(vp, hidden.device)
    logp, ent, spp = _FusedLinearLogprobs.apply(h2d, output_weight_shard, targets - info.vocab_start,
                                                1.0 / temperature, chunk_size, tp_group, info.world_size, info.rank,
                                                backend, token_shape, bool(reduce_hidden_grad),
                                                bool(compute_sum_pi_squared))
    out = (logp.view(token_shape), ent.view(token_shape) if compute_entropy else None)
    return out + (spp.view(token_shape),) if compute_sum_pi_squared else out

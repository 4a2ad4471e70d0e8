"""``vocab_parallel_logprobs``: log-probs and entropy of the target tokens from vocab-sharded logits.

Memory-bounded and exact across tensor parallelism:
  * forward: token chunks; per chunk ONE softmax pass gives per-token (max, sum-exp, target logit,
    sum p*z) partials in fp32 (``torch_path`` / Triton kernels); then two all-reduces over
    ``tp_group`` for all tokens (a MAX, then a SUM of the packed partials, ``combine.py``).
    Never an fp32 copy of the whole shard, never an in-place write to the inputs.
  * backward: per chunk, recompute p from the saved fp32 per-token raw max, log sum-exp and entropy
    (O(tokens) saved state; the logits are saved by reference, not copied) and write the gradient
    (dtype of the logits, computed in fp32 and rounded once) chunk by chunk into the single returned
    gradient tensor.
Works for a loss built from log-probs, entropy or both (unused outputs cost nothing in backward).
Errors found on the device (non-finite logits; without TP, target ids outside the vocab) are one int32
flag copied to the host without blocking (``ErrorFlags``): read before the forward returns when no
gradient will be taken, else in the backward before the gradient is returned (the forward never stalls
a training step's host).

Usage::

    from megatron_rl.logprobs import vocab_parallel_logprobs
    logp, ent = vocab_parallel_logprobs(logits_shard, target_ids, tp_group=tp_group, temperature=1.0)
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from .backend import BlockOps, default_chunk_rows, resolve_backend
from .combine import combine_partials
from .sum_pi_squared import sum_pi_squared_from_stats
from .validation import (check_chunk_size, check_float_tensor, check_partition, check_targets,
                         check_temperature, locate_nonfinite, target_range_error)


def flatten_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """View ``t`` [..., W] as [N, W]; copies (with a warning) only if no view exists."""
    w = t.shape[-1]
    try:
        return t.view(-1, w)
    except RuntimeError:
        warnings.warn(f"{name} of shape {tuple(t.shape)} / strides {t.stride()} cannot be viewed as "
                      f"[tokens, {w}]; making a contiguous copy in {t.dtype} (pass a contiguous tensor "
                      f"to avoid it)", stacklevel=3)
        return t.reshape(-1, w)


class _VocabParallelLogprobs(torch.autograd.Function):
    """Autograd wrapper: inputs (logits2d [N, Vp], local target columns [N]); outputs fp32 (logp, ent, sum p^2)
    (sum p^2: an empty tensor unless ``want_spp``; never differentiable)."""

    @staticmethod
    def forward(ctx, logits2d, t_local, inv_temp, chunk_rows, tp_group, world_size, rank,
                backend, token_shape, defer_check, want_spp=False):
        ops = BlockOps(backend, logits2d.device)
        n, vp = logits2d.shape
        if ops.fused_final and world_size == 1 and chunk_rows >= n:
            # one pass, statistics finished on the device: status bit 1 = non-finite, bit 2 = bad target
            logp, ent, mx, log_s, status = ops.logprobs(logits2d, t_local, inv_temp)
            bad = status
            flags = status.max() if n else None
        else:
            stats = torch.empty(4, n, dtype=torch.float32, device=logits2d.device)
            for i in range(0, n, chunk_rows):
                j = min(n, i + chunk_rows)
                m, s, tgt, spz = ops.partials(logits2d[i:j], t_local[i:j], inv_temp)
                stats[0, i:j], stats[1, i:j], stats[2, i:j], stats[3, i:j] = m, s, tgt, spz
            logp, ent, mx, log_s, bad = combine_partials(stats[0], stats[1], stats[2], stats[3], inv_temp,
                                                            tp_group, world_size)
            flags = None
            if n:
                flags = bad.any().to(torch.int32)
                if world_size == 1:  # the target range check was left to this device-side flag
                    flags = flags + 2 * ((t_local < 0) | (t_local >= vp)).any().to(torch.int32)
        del ops
        # sum p^2 from the combined statistics: one more SUM all-reduce of [N] (sum_pi_squared.py)
        spp = (sum_pi_squared_from_stats(logits2d, mx, log_s, inv_temp, chunk_rows, tp_group, world_size)
               if want_spp else logits2d.new_empty(0, dtype=torch.float32))
        check = ErrorFlags(flags, (logits2d, t_local, bad, token_shape, rank), asynchronous=defer_check)
        if not defer_check:
            check.raise_if_set()  # the forward's only host synchronisation
        ctx.save_for_backward(logits2d, t_local, mx, log_s, ent)
        ctx.inv_temp, ctx.chunk_rows, ctx.backend = inv_temp, chunk_rows, backend
        ctx.check = check if defer_check else None
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(spp)
        return logp, ent, spp

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_spp=None):
        logits2d, t_local, mx, log_s, ent = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0]:
            grad = torch.empty_like(logits2d)
            if g_logp is None and g_ent is None:
                grad.zero_()
            else:
                ops = BlockOps(ctx.backend, logits2d.device)
                g_logp = None if g_logp is None else g_logp.float()
                g_ent = None if g_ent is None else g_ent.float()
                n, step = logits2d.shape[0], ctx.chunk_rows
                for i in range(0, n, step):
                    j = min(n, i + step)
                    ops.grad(logits2d[i:j], t_local[i:j], ctx.inv_temp, mx[i:j], log_s[i:j], ent[i:j],
                             None if g_logp is None else g_logp[i:j],
                             None if g_ent is None else g_ent[i:j], grad[i:j])
        if ctx.check is not None:
            # the forward's deferred check, read after the gradient kernels are queued (the flag was
            # copied to the host right after the forward, so this waits for the forward only) and before
            # the gradient is returned
            check, ctx.check = ctx.check, None
            check.raise_if_set()
        return grad, None, None, None, None, None, None, None, None, None, None


class ErrorFlags:
    """The forward's error flags (int32 on the device: bit 1 = non-finite statistics, bit 2 = target id
    outside [0, V)); ``raise_if_set`` reads them and raises the named error.

    ``asynchronous`` (CUDA): the flags are copied to pinned host memory without blocking and
    ``raise_if_set`` waits for the work queued before that copy only (the forward), not for the work
    queued since. ``where`` = (logits2d, t_local, bad_rows, token_shape, rank), for the message.
    """

    def __init__(self, flags: Optional[torch.Tensor], where, asynchronous: bool):
        self.where, self.event = where, None
        if flags is None:
            self.host = None
        elif asynchronous and flags.device.type == "cuda":
            self.host = torch.empty((), dtype=flags.dtype, pin_memory=True)
            self.host.copy_(flags, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flags

    def raise_if_set(self) -> None:
        if self.host is None:
            return
        if self.event is not None:
            self.event.synchronize()
        value = int(self.host)
        if not value:
            return
        logits2d, t_local, bad, token_shape, rank = self.where
        if value & 2:
            raise ValueError(target_range_error(t_local, logits2d.shape[1], token_shape))
        raise ValueError(locate_nonfinite(logits2d, bad != 0, token_shape, rank))


def vocab_parallel_logprobs(logits_shard: torch.Tensor, target_ids: torch.Tensor, tp_group=None,
                            temperature: float = 1.0, compute_entropy: bool = True,
                            chunk_size: Optional[int] = None, backend: str = "auto",
                            compute_sum_pi_squared: bool = False):
    """Log-probs of ``target_ids`` and entropy under softmax(logits / temperature), vocab-parallel.

    Args:
        logits_shard: [..., V/TP] fp32/bf16/fp16 logits of this TP rank's vocab slice; rank r owns
            global ids [r * V/TP, (r + 1) * V/TP) (megatron ``VocabUtility``). Not modified.
        target_ids: [...] integer global token ids in [0, V), identical on every TP rank.
        tp_group: the tensor-model-parallel process group, or None for a single process (no TP).
        temperature: > 0; logits are divided by it before the softmax (SGLang's sampled-token
            log-probs are log_softmax(logits / T)).
        compute_entropy: return the entropy of softmax(logits / T) (else None; costs nothing extra).
        chunk_size: tokens per chunk (None: ``backend.default_chunk_rows``; memory ~ 8 B x chunk x V/TP).
        backend: "auto" | "torch" | "triton" (see ``megatron_rl.logprobs.backend``).
        compute_sum_pi_squared: also return sum_j p_j^2 per token (verl's ``calculate_sum_pi_squared``; one
            more chunked read of the logits and one more all-reduce of [tokens]; ``sum_pi_squared.py``).
    Returns:
        (logp, entropy): fp32 tensors of shape [...] (entropy None if not requested), differentiable
        w.r.t. ``logits_shard``; with ``compute_sum_pi_squared`` a third fp32 [...] tensor (no gradient).
    Raises:
        ValueError naming the problem: bad dtype/shape, target ids outside [0, V), temperature <= 0,
        token count / partition size / target ids differing across TP ranks (raised on every rank),
        NaN/inf logits (count and first position; raised on every rank after the forward pass). Without
        TP, target ids outside [0, V) are found on the device with the NaN/inf check. When a gradient will
        be taken (grad mode on and ``logits_shard.requires_grad``) these two are raised from the backward,
        before the gradient is returned; otherwise from this call.
    """
    check_float_tensor(logits_shard, "logits_shard")
    token_shape = tuple(logits_shard.shape[:-1])
    check_targets(target_ids, token_shape, logits_shard.device)
    temperature = check_temperature(temperature)
    chunk_size = check_chunk_size(chunk_size)
    backend = resolve_backend(backend, logits_shard.device)
    vp = logits_shard.shape[-1]
    targets = target_ids.reshape(-1).to(torch.int64)
    n = targets.numel()
    # without TP the forward checks the target range on the device, together with the logits
    info = check_partition(targets, token_shape, vp, tp_group, "logits_shard", defer_range_check=True)
    logits2d = flatten_rows(logits_shard, "logits_shard")
    t_local = targets - info.vocab_start if info.vocab_start else targets
    if chunk_size is None:
        # the Triton forward/backward stream over the vocab without a workspace: no chunking needed
        chunk_size = max(1, n) if backend == "triton" else default_chunk_rows(vp, logits2d.device)
    # training (a gradient will be taken): the error check waits for the backward, so the forward never
    # blocks the host; otherwise (no_grad, inference) it is read before returning
    defer_check = torch.is_grad_enabled() and logits_shard.requires_grad
    logp, ent, spp = _VocabParallelLogprobs.apply(logits2d, t_local, 1.0 / temperature, chunk_size, tp_group,
                                                  info.world_size, info.rank, backend, token_shape, defer_check,
                                                  bool(compute_sum_pi_squared))
    logp = logp.view(token_shape)
    out = (logp, ent.view(token_shape) if compute_entropy else None)
    return out + (spp.view(token_shape),) if compute_sum_pi_squared else out

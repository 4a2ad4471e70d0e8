"""Triton kernels for vocab-parallel log-probs / entropy: the GPU path of ``megatron_rl.logprobs``.

Two kernels over a block of logits x [rows, W] (any row/column strides, fp32/bf16/fp16):
  * ``_partials_kernel`` - one program per row streams over vocab blocks of BLOCK columns with an
    ONLINE log-sum-exp in fp32 and emits the per-row partials consumed by the TP combine
    (``megatron_rl.logprobs.combine``): m = max x (raw units), s = sum exp(d), spz = sum exp(d) * d
    with d = (x - m) * inv_temp, tgt = x[target] or 0 when the target is not in this block.
    Online update when the running max moves from m to m': a = (m - m') * inv_temp,
    s <- e^a s + sum_new,  spz <- e^a (spz + a s) + spz_new.  Masked tails load -inf and are zeroed
    explicitly in spz (0 * -inf), so real -inf / NaN / +inf logits still poison s or spz (detected).
  * ``_grad_kernel`` - 2-D grid (row, column block); recomputes log p = (x - M) * inv_temp - log_s
    from the saved global row statistics and writes
    dL/dx = inv_temp * (g_logp * ([j == target] - p) - g_ent * p * (log p + H)) in the output dtype.
No workspace, no fp32 copy of the logits: the logits are read once per kernel.

Tested on CPU with the Triton interpreter (``TRITON_INTERPRET=1`` must be set BEFORE this module is
imported; see tests/integration/test_kernels_interpret.py, which runs scripts in a subprocess). Interpreter limits
this code respects: numpy has no bf16, so bf16 tensors are handled as their int16 bit pattern and are
cast to fp32 right after every load (``.to(tl.float32)``) - never do arithmetic on a loaded bf16 value;
the interpreter's fp32 -> bf16 cast truncates, so the gradient kernel rounds to bf16 explicitly (RTNE by
integer ops, the same result as torch's ``.to(torch.bfloat16)`` on every backend);
no libdevice (only tl.exp / tl.log / tl.maximum / tl.where are used); no autotune (BLOCK and num_warps
are fixed per call, chosen from the width). The same tests are marked ``gpu`` for real devices.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _partials_kernel(X, TL, M_OUT, S_OUT, TGT_OUT, SPZ_OUT, width, stride_row, stride_col, inv_temp,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_row
    offs = tl.arange(0, BLOCK)
    # first block peeled: it initialises the running max (width >= 1, so it holds a real value)
    mask = offs < width
    x = tl.load(x_row + offs * stride_col, mask=mask, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    d = (x - m) * inv_temp
    e = tl.exp(d)
    s = tl.sum(tl.where(mask, e, 0.0), axis=0)
    spz = tl.sum(tl.where(mask, e * d, 0.0), axis=0)
    for start in range(BLOCK, width, BLOCK):
        cols = start + offs
        mask = cols < width
        x = tl.load(x_row + cols * stride_col, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        a = (m - m_new) * inv_temp
        alpha = tl.exp(a)
        d = (x - m_new) * inv_temp
        e = tl.exp(d)
        spz = alpha * (spz + a * s) + tl.sum(tl.where(mask, e * d, 0.0), axis=0)
        s = alpha * s + tl.sum(tl.where(mask, e, 0.0), axis=0)
        m = m_new
    t = tl.load(TL + row)
    owned = (t >= 0) & (t < width)
    t_safe = tl.where(owned, t, 0)
    tgt = tl.load(x_row + t_safe * stride_col).to(tl.float32)
    tgt = tl.where(owned, tgt, 0.0)
    tl.store(M_OUT + row, m)
    tl.store(S_OUT + row, s)
    tl.store(TGT_OUT + row, tgt)
    tl.store(SPZ_OUT + row, spz)


@triton.jit
def _grad_kernel(X, TL, MX, LOGS, ENT, GLP, GENT, OUT, width, stride_row, stride_col, out_stride_row,
                 out_stride_col, inv_temp, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, OUT_BF16: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(X + row * stride_row + cols * stride_col, mask=mask, other=0.0).to(tl.float32)
    mx = tl.load(MX + row)
    log_s = tl.load(LOGS + row)
    logp = (x - mx) * inv_temp - log_s
    p = tl.exp(logp)
    coef = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_GENT:
        h = tl.load(ENT + row)
        g_ent = tl.load(GENT + row)
        coef = g_ent * (logp + h)
    grad = -p * coef
    if HAS_GLP:
        g_lp = tl.load(GLP + row)
        t = tl.load(TL + row)
        grad = grad - p * g_lp + tl.where(cols == t, g_lp, 0.0)
    grad = grad * inv_temp
    if OUT_BF16:
        # round-to-nearest-even to bf16 by integer ops: identical on GPU and in the interpreter (whose
        # fp32 -> bf16 cast truncates); the gradient is finite here (checked in the forward)
        bits = grad.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = grad.to(OUT.dtype.element_ty)
    tl.store(OUT + row * out_stride_row + cols * out_stride_col, out, mask=mask)


MAX_BLOCK = 4096  #: largest vocab block per program (tests lower it to exercise the online loop and tails)


def _block_size(width: int) -> int:
    return max(16, min(MAX_BLOCK, triton.next_power_of_2(width)))


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def block_partials(x: torch.Tensor, t_local: torch.Tensor, inv_temp: float, block: int | None = None):
    """Per-row fp32 (m, s, tgt, spz) of the 2-D block ``x`` [c, W]; ``t_local`` int64 [c] (see module doc)."""
    c, w = x.shape
    outs = [torch.empty(c, dtype=torch.float32, device=x.device) for _ in range(4)]
    if c == 0:
        return tuple(outs)
    block = block or _block_size(w)
    t_local = t_local.to(torch.int64).contiguous()
    _partials_kernel[(c,)](x, t_local, *outs, w, x.stride(0), x.stride(1), float(inv_temp),
                           BLOCK=block, num_warps=_num_warps(block))
    return tuple(outs)


def block_grad(x: torch.Tensor, t_local: torch.Tensor, inv_temp: float, mx: torch.Tensor, log_s: torch.Tensor,
               ent: torch.Tensor, g_logp, g_ent, out: torch.Tensor, block: int | None = None) -> None:
    """Write d(loss)/dx for the block ``x`` [c, W] into ``out`` [c, W]; g_logp / g_ent fp32 [c] or None."""
    c, w = x.shape
    if c == 0:
        return
    if g_logp is None and g_ent is None:
        out.zero_()
        return
    block = block or min(1024, _block_size(w))  # 2-D grid: smaller blocks, more programs
    dummy = mx
    glp = g_logp.float().contiguous() if g_logp is not None else dummy
    gent = g_ent.float().contiguous() if g_ent is not None else dummy
    _grad_kernel[(c, triton.cdiv(w, block))](
        x, t_local.to(torch.int64).contiguous(), mx.contiguous(), log_s.contiguous(), ent.contiguous(),
        glp, gent, out, w, x.stride(0), x.stride(1), out.stride(0), out.stride(1), float(inv_temp),
        HAS_GLP=g_logp is not None, HAS_GENT=g_ent is not None,
        OUT_BF16=out.dtype == torch.bfloat16, BLOCK=block, num_warps=_num_warps(block))

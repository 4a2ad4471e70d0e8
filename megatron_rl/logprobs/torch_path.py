"""Torch (CPU / any device) implementation of the two per-chunk primitives.

``chunk_partials``: one softmax pass over a [c, W] block of logits -> fp32 per-row (m, s, tgt, spz)
(see ``combine.py`` for their meaning). ``chunk_grad``: recomputes p from the saved global
log-sum-exp and writes d(loss)/d(logits) for the block. Both work on any column block of the
vocab shard (the fused linear backward uses vocab-column blocks), never modify the logits and use
two caller-provided fp32 workspaces of at least [c, W] so that repeated chunks do not re-allocate
(re-allocating large buffers on CPU costs page faults every chunk).

Memory per call: the two workspaces (2 x 4 x c x W bytes) plus O(c) vectors.

Two variants of each primitive, chosen once per device by ``backend.BlockOps``: the CPU ones upcast into
the workspace first (measured ~2x faster on CPU than mixed-dtype ops); the ``*_fewer_passes`` ones
(CUDA, where time is memory traffic) read the low-precision logits directly in mixed-dtype fp32 ops and
fold the gradient's coefficients, so a forward chunk costs ~32 bytes of traffic per element (the fp32
``log_softmax`` + entropy of the naive path ~46) and a gradient chunk ~40 (naive autograd ~60).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


class Workspace:
    """Two reusable fp32 buffers of ``max_rows * width`` elements each (grown on demand)."""

    def __init__(self, device):
        self.device = device
        self.a = torch.empty(0, dtype=torch.float32, device=device)
        self.b = torch.empty(0, dtype=torch.float32, device=device)

    def get(self, rows: int, width: int):
        """Two fp32 views of shape [rows, width]."""
        n = rows * width
        if self.a.numel() < n:
            self.a = torch.empty(n, dtype=torch.float32, device=self.device)
            self.b = torch.empty(n, dtype=torch.float32, device=self.device)
        return self.a[:n].view(rows, width), self.b[:n].view(rows, width)


def _local_targets(t_local: torch.Tensor, width: int):
    """Clamp local target columns into [0, width) and return (clamped, owned mask)."""
    owned = (t_local >= 0) & (t_local < width)
    return torch.where(owned, t_local, torch.zeros_like(t_local)), owned


def chunk_partials(x: torch.Tensor, t_local: torch.Tensor, inv_temp: float, ws: Workspace):
    """Per-row fp32 partials of softmax(x * inv_temp) over the block ``x`` [c, W] (any float dtype).

    ``t_local``: [c] int64 target column inside this block (out-of-block -> not owned, tgt = 0).
    Returns (m, s, tgt, spz), each fp32 [c], with d_j = (x_j - m) * inv_temp (= z_j - max z):
    m = max x (raw logit units), s = sum exp(d), spz = sum exp(d) * d, tgt = x[target] (raw) or 0.
    Subtracting the raw max BEFORE scaling keeps d exact-ish for the large probabilities
    (x * inv_temp - max would carry ~ulp(|x|) absolute error into every p).
    """
    c, w = x.shape
    a, b = ws.get(c, w)
    # upcast into the workspace, then reduce in fp32: on CPU, copy_ + fp32 amax + in-place sub is ~2x
    # faster than bf16 amax + mixed-dtype sub (measured); the max of the upcast values is exact
    a.copy_(x)
    m = torch.amax(a, dim=-1)
    a.sub_(m.unsqueeze(-1)).mul_(inv_temp * LOG2E)  # d / ln 2
    torch.exp2(a, out=b)  # exp(d); CPU exp2 is ~2x faster than exp (same accuracy where p matters)
    s = b.sum(dim=-1)
    # sum p~ * d in place in the workspace (torch.bmm as a batched dot was ~10x less accurate)
    spz = b.mul_(a).sum(dim=-1).mul_(LN2)
    idx, owned = _local_targets(t_local, w)
    tgt = x.gather(1, idx.unsqueeze(1)).squeeze(1).float()
    tgt = torch.where(owned, tgt, torch.zeros_like(tgt))
    return m, s, tgt, spz


def chunk_grad(x: torch.Tensor, t_local: torch.Tensor, inv_temp: float, mx: torch.Tensor,
               log_s: torch.Tensor, ent: torch.Tensor, g_logp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor],
               out: torch.Tensor, ws: Workspace) -> None:
    """Write d(loss)/d(x) for the block ``x`` [c, W] into ``out`` [c, W] (any float dtype).

    With z = x * inv_temp, log p = (x - mx) * inv_temp - log_s (mx: global raw max, log_s: log of the
    global sum-exp relative to it), H = entropy:
        dL/dz_j = g_logp * ([j == target] - p_j) - g_ent * p_j * (log p_j + H)
        dL/dx   = inv_temp * dL/dz
    ``g_logp`` / ``g_ent`` are fp32 [c] upstream gradients or None (treated as zero).
    """
    c, w = x.shape
    a, b = ws.get(c, w)
    a.copy_(x)
    a.sub_(mx.unsqueeze(-1))
    if inv_temp != 1.0:
        a.mul_(inv_temp)
    a.sub_(log_s.unsqueeze(-1))  # log p
    torch.exp(a, out=b)  # p  (exp, not exp2: p multiplies the upstream gradient directly)
    if g_ent is not None:
        # coef_j = g_logp + g_ent * (log p_j + H);   grad = -p * coef
        a.add_(ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1))
        if g_logp is not None:
            a.add_(g_logp.unsqueeze(-1))
        b.mul_(a)
    elif g_logp is not None:
        b.mul_(g_logp.unsqueeze(-1))
    else:
        b.zero_()
    b.neg_()
    if g_logp is not None:
        idx, owned = _local_targets(t_local, w)
        b.scatter_add_(1, idx.unsqueeze(1), torch.where(owned, g_logp, torch.zeros_like(g_logp)).unsqueeze(1))
    if inv_temp != 1.0:
        b.mul_(inv_temp)
    out.copy_(b)


def chunk_partials_fewer_passes(x: torch.Tensor, t_local: torch.Tensor, inv_temp: float, ws: Workspace):
    """``chunk_partials`` with fewer passes over memory (same results up to fp32 rounding).

    One fp32 workspace, all in place: e = exp(d) overwrites d, then spz = sum e * d = -sum entr(e)
    (entr(e) = -e ln e, d recovered as ln e: absolute error ~1e-7 per element where e matters, exact 0
    where e underflows). The row min comes with the max (one pass): a -inf logit makes e 0 and its term
    0, so ``min * 0`` (NaN for an infinite min) keeps such rows non-finite, as in ``chunk_partials``.
    """
    c, w = x.shape
    a, _ = ws.get(c, w)
    mn, m = torch.aminmax(x, dim=-1)  # the min / max of the low-precision values are exact
    m = m.float()
    torch.sub(x, m.unsqueeze(-1), out=a)  # fp32 (type promotion), the upcast happens inside the kernel
    if inv_temp != 1.0:
        a.mul_(inv_temp)  # d
    a.exp_()  # e
    s = a.sum(dim=-1)
    spz = torch.special.entr(a, out=a).sum(dim=-1).neg_().add_(mn.float() * 0.0)
    idx, owned = _local_targets(t_local, w)
    tgt = x.gather(1, idx.unsqueeze(1)).squeeze(1).float()
    tgt = torch.where(owned, tgt, torch.zeros_like(tgt))
    return m, s, tgt, spz


def chunk_grad_fewer_passes(x: torch.Tensor, t_local: torch.Tensor, inv_temp: float, mx: torch.Tensor,
                            log_s: torch.Tensor, ent: torch.Tensor, g_logp: Optional[torch.Tensor],
                            g_ent: Optional[torch.Tensor], out: torch.Tensor, ws: Workspace) -> None:
    """``chunk_grad`` with fewer passes: dL/dx = p * (k0 + k1 * log p) (+ inv_temp * g_logp at the target).

    k0 = -inv_temp * (g_logp + g_ent * H), k1 = -inv_temp * g_ent; the product is rounded once into
    ``out``, and the target column is recomputed from the same fp32 values with the one-hot term added
    before its single rounding (so every element equals the fp32 value rounded once, as in ``chunk_grad``).
    """
    c, w = x.shape
    a, b = ws.get(c, w)
    torch.sub(x, mx.unsqueeze(-1), out=a)
    if inv_temp != 1.0:
        a.mul_(inv_temp)
    a.sub_(log_s.unsqueeze(-1))  # log p
    torch.exp(a, out=b)  # p
    zero = torch.zeros_like(mx)
    k0 = -inv_temp * ((g_logp if g_logp is not None else zero) + (g_ent * ent if g_ent is not None else zero))
    if g_ent is not None:
        coef = torch.addcmul(k0.unsqueeze(-1), a, (-inv_temp * g_ent).unsqueeze(-1), out=a)
    else:
        coef = k0.unsqueeze(-1)
    torch.mul(b, coef, out=out)
    if g_logp is not None:
        idx, owned = _local_targets(t_local, w)
        col = idx.unsqueeze(1)
        coef_t = coef.gather(1, col).squeeze(1) if g_ent is not None else k0
        fixed = b.gather(1, col).squeeze(1) * coef_t + inv_temp * g_logp
        keep = out.gather(1, col).squeeze(1)
        out.scatter_(1, col, torch.where(owned, fixed.to(out.dtype), keep).unsqueeze(1))

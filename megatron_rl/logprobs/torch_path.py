"""Torch (CPU / any device) implementation of the two per-chunk primitives.

``chunk_partials``: one softmax pass over a [c, W] block of logits -> fp32 per-row (m, s, tgt, spz)
(see ``combine.py`` for their meaning). ``chunk_grad``: recomputes p from the saved global
log-sum-exp and writes d(loss)/d(logits) for the block. Both work on any column block of the
vocab shard (the fused linear backward uses vocab-column blocks), never modify the logits and use
two caller-provided fp32 workspaces of at least [c, W] so that repeated chunks do not re-allocate
(re-allocating large buffers on CPU costs page faults every chunk).

Memory per call: the two workspaces (2 x 4 x c x W bytes) plus O(c) vectors.

Two variants of each primitive, chosen once per device by ``backend.BlockOps``: the CPU ones upcast into
the workspace first (measured ~2x faster on CPU than mixed-dtype ops); the CUDA ones (where time is
memory traffic): ``chunk_partials_log_softmax`` runs the naive path's own passes (upcast, fused
``log_softmax``, exp / mul / sum; no broadcast elementwise ops, no allocation) plus one bf16 row max, and
``chunk_grad_fewer_passes`` reads the low-precision logits directly in mixed-dtype fp32 ops and folds the
gradient's coefficients (~40 bytes of traffic per element; naive autograd ~60).
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


def chunk_partials_log_softmax(x: torch.Tensor, t_local: torch.Tensor, inv_temp: float, ws: Workspace):
    """``chunk_partials`` by the naive path's own passes (the CUDA variant): same results up to fp32 rounding.

    Per chunk: the row max and its column (one reduction over the low-precision logits: 2 B per element
    for bf16), the upcast into the workspace, the scale by inv_temp when T != 1, the fused ``log_softmax``
    kernel (max, sum-exp and output in one launch), then exp / mul / sum over its output - the passes of
    ``log_softmax(x.float() / T)`` + ``-(ls.exp() * ls).sum(-1)``, plus the max, without allocations and
    without broadcast elementwise ops. At the max column log p = -log s exactly, so
    log s = -log p[argmax] and spz = s * (log s + sum p log p). Non-finite logits: NaN / +inf make the
    max non-finite; a -inf logit makes its term 0 * -inf = NaN in sum p log p.
    """
    c, w = x.shape
    a, b = ws.get(c, w)
    m, arg = torch.max(x, dim=-1)  # exact in the input dtype
    a.copy_(x)
    if inv_temp != 1.0:
        a.mul_(inv_temp)  # z
    torch.log_softmax(a, dim=-1, out=b)  # log p
    log_s = b.gather(1, arg.unsqueeze(1)).squeeze(1).neg_()
    plogp = torch.exp(b, out=a).mul_(b).sum(dim=-1)
    s = torch.exp(log_s)
    spz = (log_s + plogp).mul_(s)
    idx, owned = _local_targets(t_local, w)
    tgt = x.gather(1, idx.unsqueeze(1)).squeeze(1).float()
    tgt = torch.where(owned, tgt, torch.zeros_like(tgt))
    return m.float(), s, tgt, spz


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

"""Triton kernels for vocab-parallel log-probs / entropy: the GPU path of ``megatron_rl.logprobs``.

Three kernels over a block of logits x [rows, W] (any row/column strides, fp32/bf16/fp16):
  * ``_fwd_kernel`` - 1-D grid of rows x splits programs; program (row, k) streams columns
    [k * chunk, (k + 1) * chunk) in blocks of BLOCK with an online softmax and writes fp32 partials
    (m, s, z, tgt) to a small workspace [4, rows, splits] (16 bytes per program). Inside a program the
    sums are kept per lane (vectors of BLOCK), so a block costs ONE reduction (its max) and one exp per
    element; the lane vectors are rescaled only when the running max grows (rare after a few blocks)
    and summed once at the end. Units: d2 = (x - m) * inv_temp * log2(e) (exp2 is the hardware exp),
    s = sum 2**d2 = sum exp(d), z = sum 2**d2 * d2; rescale when m grows to m': a = (m - m') * c2,
    s <- 2**a s, z <- 2**a (z + a s). Masked tails load -inf and contribute exact zeros; real -inf /
    +inf / NaN logits poison s or z (detected after the combine). tgt = x[target] for the program whose
    columns hold the target, else 0. splits = 1 streams whole rows; more splits give short rows or few
    rows enough programs to fill the device (the chosen configuration is tuned on the device).
  * ``_finalize_kernel`` - one program per ROWS rows merges the splits (the same rescale) and writes
    either the per-row partials (m, s, tgt, spz) in natural units for the TP combine
    (``megatron_rl.logprobs.combine``), or - without TP - the final (logp, entropy, M, log_s) and a
    status per row (1: non-finite statistics, 2: target outside [0, W)); the caller reduces it on the
    device and reads it without stalling the device (``megatron_rl.logprobs.vocab_parallel.ErrorFlags``).
  * ``_grad_kernel`` - 1-D grid over (row, column block), column blocks fastest (contiguous streaming);
    recomputes log p = (x - M) * inv_temp - log_s from the saved row statistics and writes
    dL/dx = inv_temp * (g_logp * ([j == target] - p) - g_ent * p * (log p + H)) in the output dtype.
No fp32 copy of the logits: the forward reads them once, the backward reads them once and writes the
gradient once. Offsets are int64 (rows x W past 2**31 elements).

Configuration (BLOCK, num_warps, columns per program) is chosen per (kind, dtype, width, row bucket) by
timing a few candidates on the device on first use (``Tuner``; ``MEGATRON_RL_KERNEL_TUNE=0`` turns it
off and uses the width heuristic); the choices and their timings are kept in ``TUNER.log``.

Tested on CPU with the Triton interpreter (``TRITON_INTERPRET=1`` must be set BEFORE this module is
imported; see tests/integration/test_kernels_interpret.py, which runs scripts in a subprocess). Interpreter limits
this code respects: numpy has no bf16, so bf16 tensors are handled as their int16 bit pattern and are
cast to fp32 right after every load (``.to(tl.float32)``) - never do arithmetic on a loaded bf16 value;
the interpreter's fp32 -> bf16 cast truncates, so the gradient kernel rounds to bf16 explicitly (RTNE by
integer ops, the same result as torch's ``.to(torch.bfloat16)`` on every backend); no libdevice
(only tl.exp2 / tl.log / tl.maximum / tl.where are used); no Triton autotuner (``Tuner`` times plain
launches). The same tests are marked ``gpu`` for real devices.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import triton
import triton.language as tl

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


@triton.jit
def _accumulate(x, mask, m, s_acc, z_acc, scale2, MASKED: tl.constexpr):
    """One block of the online softmax: (m, s_acc, z_acc) after the fp32 block ``x``."""
    m_new = tl.maximum(m, tl.max(x, axis=0))
    if m_new > m:  # the running max grew: rescale the lane sums (scalar branch, uniform)
        a = (m - m_new) * scale2
        alpha = tl.exp2(a)
        z_acc = alpha * (z_acc + a * s_acc)
        s_acc = alpha * s_acc
        m = m_new
    d = (x - m) * scale2
    e = tl.exp2(d)
    if MASKED:
        e = tl.where(mask, e, 0.0)
        ed = tl.where(mask, e * d, 0.0)
    else:
        ed = e * d
    return m, s_acc + e, z_acc + ed


@triton.jit
def _fwd_kernel(X, TL, WS, width, n_splits, chunk, total, stride_row, stride_col, scale2, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row32 = pid // n_splits
    c0 = (pid - row32 * n_splits) * chunk
    c1 = tl.minimum(width, c0 + chunk)
    row = row32.to(tl.int64)
    x_row = X + row * stride_row
    offs = tl.arange(0, BLOCK)
    # first block (masked; always holds at least one real column): initialises the running max
    cols = c0 + offs
    mask = cols < c1
    x = tl.load(x_row + cols * stride_col, mask=mask, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    d = (x - m) * scale2
    s_acc = tl.where(mask, tl.exp2(d), 0.0)
    z_acc = tl.where(mask, s_acc * d, 0.0)
    n_full = (c1 - c0) // BLOCK
    c_full = c0 + n_full * BLOCK
    # full blocks, unmasked; the next block is loaded before this one is reduced (its load is in flight
    # during the reduction); its mask is all-true or all-false (c_full - start is a multiple of BLOCK)
    cols = c0 + BLOCK + offs
    x_next = tl.load(x_row + cols * stride_col, mask=cols < c_full, other=0.0)
    for start in range(c0 + BLOCK, c_full, BLOCK):
        x = x_next.to(tl.float32)
        cols = start + BLOCK + offs
        x_next = tl.load(x_row + cols * stride_col, mask=cols < c_full, other=0.0)
        m, s_acc, z_acc = _accumulate(x, mask, m, s_acc, z_acc, scale2, MASKED=False)  # mask unused
    if (n_full > 0) & (c_full < c1):
        cols = c_full + offs
        mask = cols < c1
        x = tl.load(x_row + cols * stride_col, mask=mask, other=float("-inf")).to(tl.float32)
        m, s_acc, z_acc = _accumulate(x, mask, m, s_acc, z_acc, scale2, MASKED=True)
    t = tl.load(TL + row)
    owned = (t >= c0) & (t < c1)
    tgt = tl.load(x_row + tl.where(owned, t, c0) * stride_col).to(tl.float32)
    out = WS + pid.to(tl.int64)
    tl.store(out, m)
    tl.store(out + total, tl.sum(s_acc, axis=0))
    tl.store(out + 2 * total, tl.sum(z_acc, axis=0))
    tl.store(out + 3 * total, tl.where(owned, tgt, 0.0))


@triton.jit
def _finalize_kernel(WS, TL, OUT, STATUS, n_rows, n_splits, total, width, inv_temp, scale2,
                     FINAL: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ks = tl.arange(0, SPLITS)
    rmask = rows < n_rows
    mask = rmask[:, None] & (ks[None, :] < n_splits)
    idx = rows.to(tl.int64)[:, None] * n_splits + ks[None, :]
    m_k = tl.load(WS + idx, mask=mask, other=float("-inf"))
    s_k = tl.load(WS + total + idx, mask=mask, other=0.0)
    z_k = tl.load(WS + 2 * total + idx, mask=mask, other=0.0)
    t_k = tl.load(WS + 3 * total + idx, mask=mask, other=0.0)
    mx = tl.max(m_k, axis=1)
    a = (m_k - mx[:, None]) * scale2
    w = tl.exp2(a)
    s = tl.sum(tl.where(mask, w * s_k, 0.0), axis=1)
    spz = tl.sum(tl.where(mask, w * (z_k + a * s_k), 0.0), axis=1) * 0.6931471805599453
    tgt = tl.sum(t_k, axis=1)
    if FINAL:
        log_s = tl.log(s)
        logp = (tgt - mx) * inv_temp - log_s
        ent = log_s - spz / s
        inf = float("inf")
        ok = (tl.abs(logp) < inf) & (tl.abs(ent) < inf) & (tl.abs(mx) < inf) & (tl.abs(log_s) < inf)
        t = tl.load(TL + rows, mask=rmask, other=0)
        status = tl.where(ok, 0, 1) + tl.where((t < 0) | (t >= width), 2, 0)
        tl.store(OUT + rows, logp, mask=rmask)
        tl.store(OUT + n_rows + rows, ent, mask=rmask)
        tl.store(OUT + 2 * n_rows + rows, mx, mask=rmask)
        tl.store(OUT + 3 * n_rows + rows, log_s, mask=rmask)
        tl.store(STATUS + rows, status.to(tl.int32), mask=rmask)
    else:
        tl.store(OUT + rows, mx, mask=rmask)
        tl.store(OUT + n_rows + rows, s, mask=rmask)
        tl.store(OUT + 2 * n_rows + rows, tgt, mask=rmask)
        tl.store(OUT + 3 * n_rows + rows, spz, mask=rmask)


@triton.jit
def _grad_kernel(X, TL, MX, LOGS, ENT, GLP, GENT, OUT, width, n_blocks, stride_row, stride_col, out_stride_row,
                 out_stride_col, inv_temp, scale2, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
                 OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row32 = pid // n_blocks
    cols = (pid - row32 * n_blocks) * BLOCK + tl.arange(0, BLOCK)
    row = row32.to(tl.int64)
    mask = cols < width
    x = tl.load(X + row * stride_row + cols * stride_col, mask=mask, other=0.0).to(tl.float32)
    mx = tl.load(MX + row)
    log2_s = tl.load(LOGS + row) * 1.4426950408889634
    logp2 = (x - mx) * scale2 - log2_s  # log2 p
    p = tl.exp2(logp2)
    # coef = inv_temp * (g_logp + g_ent * (log p + H)) = c0 + c1 * log2 p
    c0 = 0.0
    c1 = 0.0
    if HAS_GENT:
        g_ent = tl.load(GENT + row)
        c0 = inv_temp * g_ent * tl.load(ENT + row)
        c1 = inv_temp * g_ent * 0.6931471805599453
    if HAS_GLP:
        g_lp = inv_temp * tl.load(GLP + row)
        c0 = c0 + g_lp
    grad = -p * (c0 + c1 * logp2)
    if HAS_GLP:
        t = tl.load(TL + row)
        grad = grad + tl.where(cols == t, g_lp, 0.0)
    if OUT_BF16:
        # round-to-nearest-even to bf16 by integer ops: identical on GPU and in the interpreter (whose
        # fp32 -> bf16 cast truncates); the gradient is finite here (checked in the forward)
        bits = grad.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = grad.to(OUT.dtype.element_ty)
    tl.store(OUT + row * out_stride_row + cols * out_stride_col, out, mask=mask)


# ---------------------------------------------------------------------------------------- configuration
MAX_BLOCK = 4096  #: largest vocab block per program (tests lower it to exercise the online loop and tails)
SPLIT_COLS: Optional[int] = None  #: force the columns per forward program (tests); None: tuned / heuristic
TUNE_MIN_ELEMENTS = 1 << 22  #: smaller inputs use the heuristic configuration (timing them is noise)
MAX_SPLITS = 64  #: most column splits per row (the finalize kernel holds them in one tile)


@dataclass(frozen=True)
class FwdConfig:
    """One forward launch configuration."""

    block: int  #: columns per block (power of two)
    warps: int  #: num_warps
    blocks_per_program: int  #: 0: one program streams the whole row; k: k blocks per program (split rows)


@dataclass(frozen=True)
class GradConfig:
    """One gradient launch configuration."""

    block: int  #: columns per program (power of two)
    warps: int  #: num_warps


# (ptxas for sm_90: 64-88 registers, no spills; blocks of 32 elements per thread need ~170 and were dropped)
FWD_CANDIDATES = (FwdConfig(4096, 8, 0), FwdConfig(2048, 4, 0), FwdConfig(8192, 16, 0), FwdConfig(4096, 8, 4),
                  FwdConfig(2048, 4, 8))
GRAD_CANDIDATES = (GradConfig(2048, 4), GradConfig(4096, 8), GradConfig(1024, 4), GradConfig(8192, 8))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _fwd_default(rows: int, width: int) -> FwdConfig:
    block = max(16, min(MAX_BLOCK, 4096, triton.next_power_of_2(width)))
    warps = 8 if block >= 2048 else 4
    if rows >= 1024:
        return FwdConfig(block, warps, 0)
    # few rows: split them so that rows x splits >= ~1024 programs, at least 4 blocks per program
    n_blocks = triton.cdiv(width, block)
    per = max(4, triton.cdiv(n_blocks, max(1, 1024 // max(1, rows))))
    return FwdConfig(block, warps, per if per < n_blocks else 0)


def _grad_default(width: int) -> GradConfig:
    block = max(16, min(MAX_BLOCK, 2048, triton.next_power_of_2(width)))
    return GradConfig(block, 8 if block >= 4096 else 4)


def cuda_time_ms(fn: Callable[[], None], reps: int = 3) -> float:
    """Median time of ``fn`` in ms over ``reps`` runs after one warm-up run (compilation), by CUDA events."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return sorted(ts)[len(ts) // 2]


class Tuner:
    """Times candidate configurations once per key on the device and remembers the fastest.

    ``log`` holds one dict per tuned key: kind, key, the winner and every candidate's time (ms), and one
    per candidate that could not run (skipped, with its error). ``timer(fn) -> ms`` measures a candidate.
    """

    def __init__(self, timer: Callable = cuda_time_ms):
        self.best: dict = {}
        self.log: list = []
        self.timer = timer

    def enabled(self, device: torch.device, numel: int) -> bool:
        return (device.type == "cuda" and not _interpreting() and numel >= TUNE_MIN_ELEMENTS
                and os.environ.get("MEGATRON_RL_KERNEL_TUNE", "1") != "0")

    def pick(self, kind: str, key: tuple, candidates: Sequence, launch: Callable):
        """The fastest of ``candidates`` for ``key`` (``launch(cfg)`` runs one; its outputs are overwritten)."""
        full = (kind,) + key
        if full in self.best:
            return self.best[full]
        times = {}
        for cfg in candidates:
            try:
                times[cfg] = self.timer(lambda: launch(cfg))
            except Exception as e:  # noqa: BLE001 - a candidate the device cannot run is skipped
                self.log.append(dict(kind=kind, key=key, skipped=str(cfg), error=repr(e)[:200]))
        if not times:
            raise RuntimeError(f"no {kind} kernel configuration runs on this device for {key}: "
                               + "; ".join(e["error"] for e in self.log[-len(candidates):]))
        best = min(times, key=times.get)
        self.best[full] = best
        self.log.append(dict(kind=kind, key=key, best=str(best),
                             times_ms={str(c): round(t, 4) for c, t in times.items()}))
        return best


TUNER = Tuner()


def _row_bucket(rows: int) -> int:
    return min(triton.next_power_of_2(max(1, rows)), 1 << 16)


# ---------------------------------------------------------------------------------------- launchers
def _launch_fwd(x, t_local, cfg: FwdConfig, inv_temp: float, ws_cache: dict):
    c, w = x.shape
    if SPLIT_COLS is not None:
        chunk = triton.cdiv(SPLIT_COLS, cfg.block) * cfg.block
    elif cfg.blocks_per_program == 0:
        chunk = w
    else:
        chunk = cfg.block * cfg.blocks_per_program
    splits = triton.cdiv(w, chunk)
    if splits > MAX_SPLITS:
        splits = MAX_SPLITS
        chunk = triton.cdiv(triton.cdiv(w, splits), cfg.block) * cfg.block
        splits = triton.cdiv(w, chunk)
    total = c * splits
    ws = ws_cache.get(total)
    if ws is None:
        ws = ws_cache[total] = torch.empty(4 * total, dtype=torch.float32, device=x.device)
    _fwd_kernel[(total,)](x, t_local, ws, w, splits, chunk, total, x.stride(0), x.stride(1),
                          float(inv_temp) * LOG2E, BLOCK=cfg.block, num_warps=cfg.warps)
    return ws, splits


def _forward(x: torch.Tensor, t_local: torch.Tensor, inv_temp: float, final: bool):
    c, w = x.shape
    t_local = t_local.to(torch.int64).contiguous()
    ws_cache: dict = {}
    if TUNER.enabled(x.device, c * w):
        cfg = TUNER.pick("fwd", (x.dtype, w, _row_bucket(c)), FWD_CANDIDATES,
                         lambda k: _launch_fwd(x, t_local, k, inv_temp, ws_cache))
    else:
        cfg = _fwd_default(c, w)
    ws, splits = _launch_fwd(x, t_local, cfg, inv_temp, ws_cache)
    out = torch.empty(4, c, dtype=torch.float32, device=x.device)
    status = torch.empty(c if final else 1, dtype=torch.int32, device=x.device)
    rows = 64 if splits <= 8 else 16
    _finalize_kernel[(triton.cdiv(c, rows),)](ws, t_local, out, status, c, splits, c * splits, w, float(inv_temp),
                                              float(inv_temp) * LOG2E, FINAL=final, ROWS=rows,
                                              SPLITS=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out, status


def block_partials(x: torch.Tensor, t_local: torch.Tensor, inv_temp: float):
    """Per-row fp32 (m, s, tgt, spz) of the 2-D block ``x`` [c, W] for the TP combine; ``t_local`` int [c].

    m = max x (raw), s = sum exp(d), spz = sum exp(d) * d with d = (x - m) * inv_temp, tgt = x[target]
    (raw) or 0 when the target column is outside [0, W).
    """
    c = x.shape[0]
    if c == 0:
        return tuple(torch.empty(0, dtype=torch.float32, device=x.device) for _ in range(4))
    out, _ = _forward(x, t_local, inv_temp, final=False)
    return out[0], out[1], out[2], out[3]


def block_logprobs(x: torch.Tensor, t_local: torch.Tensor, inv_temp: float):
    """Without TP: (logp, entropy, M, log_s, status) of the block ``x`` [c, W] in one pass over the logits.

    M: raw row max, log_s: log sum exp((x - M) * inv_temp) (so lse = M * inv_temp + log_s); status int32
    per row: bit 1 = non-finite statistics (NaN/inf logits), bit 2 = target outside [0, W).
    """
    c = x.shape[0]
    if c == 0:
        e = torch.empty(0, dtype=torch.float32, device=x.device)
        return e, e, e, e, torch.empty(0, dtype=torch.int32, device=x.device)
    out, status = _forward(x, t_local, inv_temp, final=True)
    return out[0], out[1], out[2], out[3], status


def _launch_grad(x, t_local, inv_temp, mx, log_s, ent, glp, gent, has_glp, has_gent, out, cfg: GradConfig):
    c, w = x.shape
    n_blocks = triton.cdiv(w, cfg.block)
    _grad_kernel[(c * n_blocks,)](
        x, t_local, mx, log_s, ent, glp, gent, out, w, n_blocks, x.stride(0), x.stride(1), out.stride(0),
        out.stride(1), float(inv_temp), float(inv_temp) * LOG2E, HAS_GLP=has_glp, HAS_GENT=has_gent,
        OUT_BF16=out.dtype == torch.bfloat16, BLOCK=cfg.block, num_warps=cfg.warps)


def block_grad(x: torch.Tensor, t_local: torch.Tensor, inv_temp: float, mx: torch.Tensor, log_s: torch.Tensor,
               ent: torch.Tensor, g_logp, g_ent, out: torch.Tensor) -> None:
    """Write d(loss)/dx for the block ``x`` [c, W] into ``out`` [c, W]; g_logp / g_ent fp32 [c] or None."""
    c, w = x.shape
    if c == 0:
        return
    if g_logp is None and g_ent is None:
        out.zero_()
        return
    mx, log_s, ent = mx.contiguous(), log_s.contiguous(), ent.contiguous()
    glp = g_logp.float().contiguous() if g_logp is not None else mx
    gent = g_ent.float().contiguous() if g_ent is not None else mx
    t_local = t_local.to(torch.int64).contiguous()
    args = (x, t_local, inv_temp, mx, log_s, ent, glp, gent, g_logp is not None, g_ent is not None, out)
    if TUNER.enabled(x.device, c * w):
        cfg = TUNER.pick("grad", (x.dtype, w, _row_bucket(c)), GRAD_CANDIDATES, lambda k: _launch_grad(*args, k))
    else:
        cfg = _grad_default(w)
    _launch_grad(*args, cfg)

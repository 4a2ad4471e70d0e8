"""Benchmark: peak extra memory and time of per-token log-probs + entropy (forward + backward).

Cases (each in its own subprocess, bf16 logits [tokens, vocab/TP], loss = sum(g1 * logp + g2 * entropy)):
  a  naive: fp32 upcast, log_softmax + gather, separate entropy -(exp(ls) * ls).sum, autograd
  b  verl path: fp32 copy, megatron-core vocab_parallel_cross_entropy on a clone (it writes in place)
     plus a separate softmax entropy pass, autograd (TP=1: parallel_state on a 1-rank gloo group)
  c  megatron_rl.logprobs.vocab_parallel_logprobs
  d  megatron_rl.logprobs.fused_linear_logprobs (hidden 1024; the logits are never stored)
  floor: a streaming chunked ``logits.float().amax(-1)`` over the same logits, timed in c's process
Peak extra memory = peak RSS (VmHWM, reset via /proc/self/clear_refs after the inputs exist)
  - RSS with the inputs resident - bytes of the returned gradient(s).
Ratios printed: peak extra / one fp32 copy of the shard (4 * tokens * vocab bytes), time / case b,
and c's forward time / floor. Targets: c extra <= 10%, c time <= b, d extra <= 5%, c fwd <= 3x floor.

Device table (``--device cuda|cpu``; in one process): for each shape, paths naive (fp32 log_softmax +
entropy, autograd), triton (``backend="triton"``) and torch (``backend="torch"``): forward ms (no_grad,
and with logits that require grad as in a training step), forward + backward ms (loss = sum(g1 * logp
+ g2 * entropy), a fresh leaf per call, so the gradient is assigned, not accumulated), timed as calls back
to back between two CUDA events (what a training step pays: the host's launch time hides behind the
device's work unless the call synchronises), each over its bandwidth floor (the bf16
logits read once / the copy bandwidth measured in the same run; forward + backward: read once + the bf16
gradient written once = twice that), peak extra device memory over one fp32 copy of the logits (the
returned gradient not counted), and float64 errors of the same run (log-prob / entropy max abs error and
gradient relative error on the first and last 64 rows). Then a correctness sweep (fp32 / bf16 logits,
temperatures 0.7 / 1.0 / 1.3, three widths, both backends) and, on CUDA, a shape past 2**31 elements
(``--no-big`` skips it). The tuned kernel configurations (``megatron_rl_kernels.logprob_kernels.TUNER``)
are printed: the winners always, every candidate's time with ``--sweep``. On CPU the Triton kernels run
under the interpreter (``TRITON_INTERPRET=1`` is set by the tool), on small default shapes: a check that
the tool and the kernels run, not a measurement.
  PYTHONPATH=.:kernels python tools/bench_logprobs.py --device cuda [--sweep]
  python tools/bench_logprobs.py --device cpu                 # seconds (tests run this)

Usage:
  OMP_NUM_THREADS=1 python tools/bench_logprobs.py            # 8192 x 32768 and 8192 x 37984
  OMP_NUM_THREADS=1 python tools/bench_logprobs.py --quick    # 1024 x 4096 (seconds; a smoke run: the
      ratio targets are meaningless there, c's ~8 MiB workspace is a large fraction of a 16 MiB fp32 copy)
  ... --cases c,d --chunk-size 64 --threads 1
Runs single-threaded by default (shared machines); every number is from one run, so timings carry the
noise of whatever else runs on the machine.

Measured (2026-11-22, 2 shared AMD EPYC cores (AVX-512), load average 6-9 from other jobs, 1 thread,
torch 2.13 CPU; default chunk = 2**20 elements = 32 / 27 rows):
  8192 x 32768   case  total s  peak extra MiB  extra / fp32 copy  time / b
                 a      71.7       5632           5.50               5.27
                 b      13.6       6657           6.50               1.00
                 c       2.5          8.7         0.008              0.18
                 d      67.8         18.3         0.018              4.98
                 c forward 0.70 s vs streaming floor 0.12 s: 5.9x
  8192 x 37984   a      25.9       6529           5.50               1.61
                 b      16.0       7716           6.50               1.00
                 c       4.9          8.6         0.007              0.31
                 d      81.0         19.3         0.016              5.05
                 c forward 1.07 s vs streaming floor 0.20 s: 5.4x
  Memory targets met (c <= 10%, d <= 5%), c time <= b met; c forward within 3x of the floor NOT met on
  CPU: the softmax needs one exp per element, and single-threaded CPU exp2 alone costs ~2x the floor
  (which is a bf16->fp32 convert + max); the rest is ~5 more elementwise passes over a cache-resident
  chunk. The Triton forward reads the logits once (bandwidth-bound on a GPU); not measurable here.
  Chunk sweep for c at 8192 x 32768 (rows per chunk: peak extra MiB / total s): 8: 3.7 / 2.8,
  32: 8.8 / 3.9, 128: 32.5 / 3.9 - time flat within the machine's noise, memory linear; 32 rows
  (2**20 elements) keeps the extra under 1% of an fp32 copy and the chunk in L2/L3.
  Timings vary 2-3x between runs on this shared machine (a: 25.6 s in an earlier run); memory is stable.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

SHAPES_FULL = [(8192, 32768), (8192, 37984)]
SHAPES_QUICK = [(1024, 4096), (1024, 4749)]
HIDDEN = 1024


# ---------------------------------------------------------------- worker side (one case per process)
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _settle():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _make_logits(torch, n, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, v, dtype=torch.bfloat16)
    for i in range(0, n, 128):  # filled in slices: no full-size fp32 temporary
        j = min(n, i + 128)
        x[i:j] = torch.randn(j - i, v, generator=g) * 2
    return x, torch.randint(0, v, (n,), generator=g)


def _case_fn(torch, case, chunk_size):
    """Return f(inputs) -> (logp, ent, grad_tensors_fn) running forward; backward is done by caller."""
    if case == "a":
        def fwd(x, t):
            lf = x.float()
            ls = torch.log_softmax(lf, dim=-1)
            logp = ls.gather(-1, t.unsqueeze(-1)).squeeze(-1)
            ls2 = torch.log_softmax(lf, dim=-1)  # separate entropy pass
            ent = -(ls2.exp() * ls2).sum(-1)
            return logp, ent
    elif case == "b":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        def fwd(x, t):
            lf = x.float()
            p = torch.softmax(lf, dim=-1)  # separate entropy pass (vocab_parallel_entropy style)
            ent = torch.logsumexp(lf, dim=-1) - (p * lf).sum(-1)
            logp = -vocab_parallel_cross_entropy(lf.clone(), t)  # clone: it overwrites fp32 logits
            return logp, ent
    elif case == "c":
        from megatron_rl.logprobs import vocab_parallel_logprobs

        def fwd(x, t):
            return vocab_parallel_logprobs(x, t, chunk_size=chunk_size)
    elif case == "d":
        from megatron_rl.logprobs import fused_linear_logprobs

        def fwd(hw, t):
            h, w = hw
            return fused_linear_logprobs(h, w, t, chunk_size=chunk_size)
    else:
        raise ValueError(f"unknown case {case!r}")
    return fwd


def worker(args):
    import torch
    torch.set_num_threads(args.threads)
    n, v = args.tokens, args.vocab
    if args.case == "b":
        import torch.distributed as dist
        import tempfile
        from megatron.core import parallel_state
        store = os.path.join(tempfile.mkdtemp(prefix="bench_lp_"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.rand(n, generator=g) * 2 - 1, torch.rand(n, generator=g) * 2 - 1
    if args.case == "d":
        h = (torch.randn(n, HIDDEN, generator=g)).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(v, HIDDEN, generator=g) * (2 / HIDDEN ** 0.5)).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, v, (n,), generator=g)
        inputs, leaves = (h, w), [h, w]
        small = ((h[:64].detach().clone().requires_grad_(), w.detach()[:512].clone().requires_grad_()),
                 t[:64] % 512)
    else:
        x, t = _make_logits(torch, n, v)
        x.requires_grad_()
        inputs, leaves = x, [x]
        small = (x.detach()[:64, :512].clone().requires_grad_(), t[:64] % 512)
    fwd = _case_fn(torch, args.case, args.chunk_size)
    out = {}
    # warm-up on a small slice (lazy init, imports), then release it
    lp, ent = fwd(*small)
    (lp * g_lp[:64] + ent * g_ent[:64]).sum().backward()
    del lp, ent, small
    _settle()
    base = _status_kb("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    lp, ent = fwd(inputs, t)
    t1 = time.perf_counter()
    (lp * g_lp + ent * g_ent).sum().backward()
    t2 = time.perf_counter()
    peak = _status_kb("VmHWM")
    grad_bytes = sum(leaf.grad.numel() * leaf.grad.element_size() for leaf in leaves)
    if args.case == "c":
        # streaming floor: one chunked fp32 reduction over the same logits, same chunking budget;
        # floor and forward-only timed alternately 3x, min of each (shared machines are noisy)
        from megatron_rl.logprobs.backend import default_chunk_rows
        rows = args.chunk_size or default_chunk_rows(v, x.device)
        xd = x.detach()
        floor, fwd_only = [], []
        for _ in range(3):
            f0 = time.perf_counter()
            for i in range(0, n, rows):
                xd[i:i + rows].float().amax(-1)
            f1 = time.perf_counter()
            with torch.no_grad():
                fwd(xd, t)
            floor.append(f1 - f0)
            fwd_only.append(time.perf_counter() - f1)
        out.update(floor_s=min(floor), fwd_only_s=min(fwd_only), floor_rows=rows)
    out.update(case=args.case, tokens=n, vocab=v, fwd_s=t1 - t0, bwd_s=t2 - t1, total_s=t2 - t0,
               base_rss=base, peak_rss=peak, grad_bytes=grad_bytes, extra_bytes=peak - base - grad_bytes,
               fp32_copy_bytes=4 * n * v, logp_mean=float(lp.mean()), ent_mean=float(ent.mean()))
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------- device table (one process)
DEVICE_SHAPES = {"cuda": [(8192, 151936), (16384, 37984), (16384, 18992)], "cpu": [(12, 2000), (16, 517)]}
BIG_SHAPE = (16384, 151936)  # 2.49e9 elements: offsets past 2**31
BATCH = 5  # calls per timed sample on CUDA, back to back (see _median_time)


def _sync(torch, dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(torch, dev) -> float:
    """Device-to-device copy rate in GB/s, counting the bytes read plus the bytes written (median of 10)."""
    n = (2 * 1024 ** 3 if dev.type == "cuda" else 64 * 1024 ** 2) // 4
    x = torch.empty(n, dtype=torch.float32, device=dev).normal_()
    y = torch.empty_like(x)
    ts = [_timed(torch, dev, lambda: y.copy_(x)) for _ in range(12)][2:]
    del x, y
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * n * 4 / sorted(ts)[len(ts) // 2] / 1e9


def _timed(torch, dev, fn) -> float:
    if dev.type == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median_time(torch, dev, fn, reps, batch=1):
    """Median over ``reps`` samples of the time per call of ``fn``, each sample ``batch`` calls back to back.

    Calls in a batch are not separated by a host synchronisation: as in a training step, where the host
    queues work ahead of the device, the host's Python and launch time is hidden behind the device's
    work unless ``fn`` itself synchronises (then it shows, as it does in training). One call per sample
    with a synchronisation in between would instead add the host time before the first kernel to every
    call.
    """
    fn()
    fn()  # warm-up (compilation, tuning, allocator)
    _sync(torch, dev)

    def calls():
        for _ in range(batch):
            fn()
    ts = sorted(_timed(torch, dev, calls) / batch for _ in range(reps))
    return ts[len(ts) // 2]


def _paths(torch):
    from megatron_rl.logprobs import vocab_parallel_logprobs

    def naive(x, t, temperature):
        z = x.float() if temperature == 1.0 else x.float() / temperature
        ls = torch.log_softmax(z, dim=-1)
        return ls.gather(-1, t.unsqueeze(-1)).squeeze(-1), -(ls.exp() * ls).sum(-1)

    def ours(backend):
        return lambda x, t, temperature: vocab_parallel_logprobs(x, t, temperature=temperature, backend=backend)
    return {"naive": naive, "triton": ours("triton"), "torch": ours("torch")}


def _ref_rows(torch, x, t, g1, g2, temperature, rows):
    """float64 (logp, entropy, grad) of the given rows (the loss is a sum over rows)."""
    xd = x[rows].double().requires_grad_()
    ls = torch.log_softmax(xd / temperature, dim=-1)
    lp = ls.gather(-1, t[rows].unsqueeze(-1)).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    (lp * g1[rows].double() + ent * g2[rows].double()).sum().backward()
    return lp.detach(), ent.detach(), xd.grad


def _errors(torch, lp, ent, grad, ref, rows):
    r_lp, r_ent, r_g = ref
    g = grad[rows].double()
    return dict(err_logp=float((lp.detach()[rows].double() - r_lp).abs().max()),
                err_ent=float((ent.detach()[rows].double() - r_ent).abs().max()),
                grad_rel=float((g - r_g).norm() / r_g.norm()))


def bench_shape(torch, dev, n, v, bw, paths, reps, temperature=1.0, seed=0, only=None):
    """One table row per path for bf16 logits [n, v]; returns a list of dicts."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = (torch.randn(n, v, device=dev, generator=g) * 3).to(torch.bfloat16) if dev.type == "cuda" else \
        (torch.randn(n, v, generator=g) * 3).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    g1 = torch.rand(n, device=dev, generator=g) * 2 - 1
    g2 = torch.rand(n, device=dev, generator=g) * 2 - 1
    rows = torch.cat([torch.arange(0, min(64, n)), torch.arange(max(0, n - 64), n)]).unique().to(dev)
    ref = _ref_rows(torch, x, t, g1, g2, temperature, rows)
    nbytes = x.numel() * x.element_size()
    floor_f = nbytes / (bw * 1e9)
    out = []
    for name, fn in paths.items():
        if only and name not in only:
            continue
        r = dict(shape=f"{n}x{v}", path=name)
        try:
            def fwd():
                with torch.no_grad():
                    return fn(x, t, temperature)

            def fwd_train():  # the forward of a training step: the logits require grad (backward not run)
                return fn(x.detach().requires_grad_(), t, temperature)

            def fwd_bwd():
                xi = x.detach().requires_grad_()
                lp, ent = fn(xi, t, temperature)
                (lp * g1 + ent * g2).sum().backward()
                return lp, ent, xi.grad
            timed = (("fwd", fwd, floor_f, 0), ("fwdtrain", fwd_train, floor_f, 0),
                     ("fwdbwd", fwd_bwd, 2 * floor_f, nbytes))
            for label, f, floor, grad_bytes in timed:
                _sync(torch, dev)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                s = _median_time(torch, dev, f, reps, batch=BATCH if dev.type == "cuda" else 1)
                r[label + "_ms"] = s * 1e3
                r[label + "_x_floor"] = s / floor
                if dev.type == "cuda":
                    peak = torch.cuda.max_memory_allocated() - base - grad_bytes
                    r[label + "_extra_over_fp32"] = peak / (4 * x.numel())
            lp, ent, grad = fwd_bwd()
            r.update(_errors(torch, lp, ent, grad, ref, rows))
            del lp, ent, grad
        except Exception as e:  # noqa: BLE001 - reported in the table (e.g. out of memory for naive)
            r["error"] = repr(e)[:200]
        out.append(r)
    del x
    return out


def correctness_sweep(torch, dev, backends):
    """float64 errors for fp32 / bf16 logits x temperatures x widths, every backend."""
    g = torch.Generator().manual_seed(0)
    cases = [(513, 151936), (1000, 37984), (77, 50001)] if dev.type == "cuda" else [(9, 300), (5, 1031)]
    res = []
    tune = os.environ.get("MEGATRON_RL_KERNEL_TUNE")
    os.environ["MEGATRON_RL_KERNEL_TUNE"] = "0"  # heuristic configurations here (tuned ones: the table above)
    try:
        _sweep_cases(torch, dev, backends, g, cases, res)
    finally:
        if tune is None:
            os.environ.pop("MEGATRON_RL_KERNEL_TUNE")
        else:
            os.environ["MEGATRON_RL_KERNEL_TUNE"] = tune
    return res


def _sweep_cases(torch, dev, backends, g, cases, res):
    from megatron_rl.logprobs import vocab_parallel_logprobs
    for dtype in (torch.bfloat16, torch.float32):
        for (n, v), temp in zip(cases, (1.0, 0.7, 1.3)):
            x = (torch.randn(n, v, generator=g) * 3).to(dtype)
            t = torch.randint(0, v, (n,), generator=g)
            g1, g2 = torch.rand(n, generator=g) * 2 - 1, torch.rand(n, generator=g) * 2 - 1
            rows = torch.arange(n)
            ref = _ref_rows(torch, x, t, g1, g2, temp, rows)
            for backend in backends:
                xin = x.to(dev).clone().requires_grad_()
                lp, ent = vocab_parallel_logprobs(xin, t.to(dev), temperature=temp, backend=backend)
                (lp * g1.to(dev) + ent * g2.to(dev)).sum().backward()
                e = _errors(torch, lp.cpu(), ent.cpu(), xin.grad.cpu(), ref, rows)
                res.append(dict(dtype=str(dtype).replace("torch.", ""), n=n, v=v, T=temp, backend=backend, **e,
                                grad_dtype=str(xin.grad.dtype).replace("torch.", "")))


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def print_table(rows, bw, dev_name):
    print(f"\nDevice: {dev_name}; measured copy bandwidth {bw:.0f} GB/s (read + write). Floor: bf16 logits read "
          f"once (forward); read once + bf16 gradient written once (forward + backward).")
    print("fwd: no_grad (inference; the error check blocks before returning); train fwd: the logits require grad "
          "(the check is read in the backward); fwd+bwd: a training step's forward + backward. Each time: calls back "
          f"to back ({BATCH} per sample on CUDA), median of the samples.")
    print("| shape | path | fwd ms | fwd / floor | train fwd ms | train fwd / floor | fwd+bwd ms | fwd+bwd / floor | "
          "peak extra / fp32 copy (fwd / fwd+bwd) | logp err | ent err | grad rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['path']} | error: {r['error']} |||||||||")
            continue
        mem = f"{_fmt(r.get('fwd_extra_over_fp32'), '.3f')} / {_fmt(r.get('fwdbwd_extra_over_fp32'), '.3f')}"
        print(f"| {r['shape']} | {r['path']} | {r['fwd_ms']:.3f} | {r['fwd_x_floor']:.2f} | {r['fwdtrain_ms']:.3f} | "
              f"{r['fwdtrain_x_floor']:.2f} | {r['fwdbwd_ms']:.3f} | {r['fwdbwd_x_floor']:.2f} | {mem} | "
              f"{r['err_logp']:.1e} | {r['err_ent']:.1e} | {r['grad_rel']:.1e} |")


def device_main(args):
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    import torch
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    import triton
    from megatron_rl_kernels import logprob_kernels as k
    print(f"torch {torch.__version__}, triton {triton.__version__}, {dev_name}", flush=True)
    bw = copy_bandwidth(torch, dev)
    print(f"RESULT {json.dumps(dict(case='bandwidth', copy_GBs=round(bw, 1)))}", flush=True)
    shapes = [tuple(int(s) for s in sh.lower().split("x")) for sh in args.shape] if args.shape else \
        DEVICE_SHAPES[dev.type]
    paths = _paths(torch)
    only = [p.strip() for p in args.paths.split(",")] if args.paths else None
    reps = args.reps or (10 if dev.type == "cuda" else 2)
    table = []
    for n, v in shapes:
        for r in bench_shape(torch, dev, n, v, bw, paths, reps, only=only):
            print("RESULT " + json.dumps(r), flush=True)
            table.append(r)
    big = []
    if dev.type == "cuda" and not args.no_big:
        n, v = BIG_SHAPE
        big = bench_shape(torch, dev, n, v, bw, paths, 3, temperature=0.8, only=["triton", "torch"])
        for r in big:
            r["shape"] += " (T=0.8, past 2**31)"
            print("RESULT " + json.dumps(r), flush=True)
    sweep = correctness_sweep(torch, dev, ["triton", "torch"])
    for r in sweep:
        print("RESULT " + json.dumps(dict(case="fp64", **r)), flush=True)
    print_table(table + big, bw, dev_name)
    print("\nfloat64 correctness (all rows): dtype, rows x width, T, backend: logp err / ent err / grad rel err")
    for r in sweep:
        print(f"  {r['dtype']:<8} {r['n']}x{r['v']:<7} T={r['T']:<4} {r['backend']:<7} {r['err_logp']:.1e} / "
              f"{r['err_ent']:.1e} / {r['grad_rel']:.1e} ({r['grad_dtype']} grad)")
    print("\nkernel configurations chosen on this device (fwd: block, warps, blocks per program; 0 = whole row):")
    for entry in k.TUNER.log:
        if "best" in entry:
            print(f"  {entry['kind']:<5} {entry['key']}: {entry['best']}")
            if args.sweep:
                for cfg, ms in sorted(entry["times_ms"].items(), key=lambda kv: kv[1]):
                    print(f"      {ms:9.4f} ms  {cfg}")
        else:
            print(f"  {entry['kind']:<5} {entry['key']}: skipped {entry['skipped']}: {entry['error']}")
    if not k.TUNER.log:
        print("  (none tuned: heuristic configurations; tuning runs on CUDA for inputs >= "
              f"{k.TUNE_MIN_ELEMENTS} elements)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev_name, copy_GBs=bw, table=table + big, fp64=sweep, tuner=k.TUNER.log), f,
                      indent=1, default=str)
    return table + big, sweep


# ---------------------------------------------------------------- driver
def run_case(case, n, v, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", case, "--tokens", str(n), "--vocab", str(v),
           "--threads", str(args.threads)]
    if args.chunk_size:
        cmd += ["--chunk-size", str(args.chunk_size)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"case {case} {n}x{v} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def report(results, n, v):
    mb = 2 ** 20
    fp32 = 4 * n * v
    b = results.get("b")
    print(f"\n== {n} tokens x {v} vocab/TP (bf16 logits {2 * n * v / mb:.0f} MiB; one fp32 copy {fp32 / mb:.0f} MiB)")
    print(f"{'case':<6}{'fwd s':>8}{'bwd s':>8}{'total s':>9}{'extra MiB':>11}{'extra/fp32':>12}{'time/b':>8}")
    for case, r in results.items():
        tb = f"{r['total_s'] / b['total_s']:.2f}" if b else "-"
        print(f"{case:<6}{r['fwd_s']:8.2f}{r['bwd_s']:8.2f}{r['total_s']:9.2f}{r['extra_bytes'] / mb:11.1f}"
              f"{r['extra_bytes'] / fp32:12.3f}{tb:>8}")
    checks = []
    c, d = results.get("c"), results.get("d")
    if c:
        checks.append(("c peak extra <= 10% of fp32 copy", c["extra_bytes"] / fp32, 0.10))
        if b:
            checks.append(("c time <= b time", c["total_s"] / b["total_s"], 1.0))
        checks.append((f"c forward ({c['fwd_only_s']:.2f} s) <= 3x streaming floor ({c['floor_s']:.2f} s, "
                       f"{c['floor_rows']} rows/chunk; min of 3 alternating runs)",
                       c["fwd_only_s"] / c["floor_s"], 3.0))
    if d:
        checks.append(("d peak extra <= 5% of fp32 copy", d["extra_bytes"] / fp32, 0.05))
    for name, ratio, limit in checks:
        print(f"  {'PASS' if ratio <= limit else 'FAIL'}  {name}: ratio {ratio:.3f} (limit {limit})")
    return checks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (seconds)")
    ap.add_argument("--cases", default="a,b,c,d", help="comma list of a,b,c,d")
    ap.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk for c/d (default: automatic)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per case (default 1)")
    ap.add_argument("--shape", action="append", default=None, help="TOKENSxVOCAB, repeatable")
    ap.add_argument("--json", default=None, help="also write all results to this file")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="device table mode (one process): time / floor / memory / float64 errors per path")
    ap.add_argument("--paths", default=None, help="device mode: comma list of naive,triton,torch")
    ap.add_argument("--reps", type=int, default=None, help="device mode: timed repetitions (median)")
    ap.add_argument("--sweep", action="store_true", help="device mode: print every tuned candidate's time")
    ap.add_argument("--no-big", action="store_true", help="device mode: skip the shape past 2**31 elements")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.case = args.worker
        return worker(args)
    if args.device:
        return device_main(args)
    shapes = [tuple(int(s) for s in sh.lower().split("x")) for sh in args.shape] if args.shape else \
        (SHAPES_QUICK if args.quick else SHAPES_FULL)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    everything = []
    for n, v in shapes:
        results = {}
        for case in cases:
            results[case] = run_case(case, n, v, args)
            print(f"  ran {case} {n}x{v}: {results[case]['total_s']:.2f} s, "
                  f"extra {results[case]['extra_bytes'] / 2 ** 20:.1f} MiB", flush=True)
        report(results, n, v)
        everything.append(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()

"""Triton kernels (megatron_rl_kernels.logprob_kernels) against float64 torch math and the torch path.

On CPU the kernels run under the Triton interpreter: TRITON_INTERPRET=1 must be set before the kernels
are defined, so the checks run in a fresh subprocess (this file executed as a script). The same checks
run in-process on CUDA in the ``gpu``-marked tests. Covered: fp32 and bf16 logits, vocab widths that are
not multiples of the block (block forced small so the online log-sum-exp loop and masked tails run),
rows split across programs (forced column splits, merged by the finalize kernel), the one-pass path
(statistics finished on the device) and the chunked partials path, temperature, losses on log-probs +
entropy and on one of them, padded rows (constant logits, zero upstream gradient), the fused linear path,
NaN/inf detection, target ids out of range, and TP=2 over gloo (the combine of per-rank kernel partials).
On a GPU also a shape past 2**31 elements (int64 offsets) against float64 on its first and last rows.
Run: OMP_NUM_THREADS=1 pytest tests/integration/test_kernels_interpret.py -q
"""
import json
import os
import subprocess
import sys

import pytest
import torch

TOL_LOGP = 1e-5
TOL_ENT = 1e-5
TOL_GRAD = 1e-6


def _ref(x, t, temperature, g_lp, g_ent):
    xd = x.detach().double().requires_grad_()
    ls = torch.log_softmax(xd / temperature, dim=-1)
    lp = ls.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return lp.detach(), ent.detach(), xd.grad


def _errors(x, t, temperature, device, chunk_size=None, g_lp=None, g_ent=None):
    from megatron_rl.logprobs import vocab_parallel_logprobs
    g = torch.Generator().manual_seed(2)
    if g_lp is None:
        g_lp, g_ent = torch.rand(t.shape, generator=g) * 2 - 1, torch.rand(t.shape, generator=g) * 2 - 1
    out = {}
    for backend in ("triton", "torch"):
        xin = x.to(device).clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(xin, t.to(device), temperature=temperature, backend=backend,
                                          chunk_size=chunk_size)
        (lp * g_lp.to(device) + ent * g_ent.to(device)).sum().backward()
        out[backend] = (lp.cpu(), ent.cpu(), xin.grad.cpu())
    r_lp, r_ent, r_g = _ref(x, t, temperature, g_lp, g_ent)
    lp, ent, gr = out["triton"]
    rel = r_g.abs() * (2 ** -8 if x.dtype == torch.bfloat16 else 0.0)
    zero_rows = (g_lp == 0) & (g_ent == 0)
    return dict(logp=float((lp.detach().double() - r_lp).abs().max()),
                ent=float((ent.detach().double() - r_ent).abs().max()),
                grad_excess=float(((gr.double() - r_g).abs() - rel).max()),
                vs_torch_logp=float((lp - out["torch"][0]).detach().abs().max()),
                zero_rows_grad=float(gr[zero_rows].abs().max()) if bool(zero_rows.any()) else 0.0,
                grad_dtype=str(gr.dtype), unchanged=True)


def _tp_rank(rank, world, x, t, temperature):
    import torch.distributed as dist
    from megatron_rl.logprobs import vocab_parallel_logprobs
    vp = x.shape[-1] // world
    xin = x[..., rank * vp:(rank + 1) * vp].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(xin, t, tp_group=dist.group.WORLD, temperature=temperature,
                                      backend="triton")
    (lp * 0.5 + ent * -0.25).sum().backward()
    return lp.detach(), ent.detach(), xin.grad


def run_checks(device: str) -> dict:
    """All kernel checks on ``device``; returns a dict of named error figures (asserted by the tests)."""
    from megatron_rl_kernels import logprob_kernels as k
    k.MAX_BLOCK = 32  # widths below are not multiples of 32: online loop + masked tails
    res = {}
    g = torch.Generator().manual_seed(0)
    cases = [("fp32_w100", torch.float32, 100, 1.0), ("fp32_w77_t07", torch.float32, 77, 0.7),
             ("bf16_w100", torch.bfloat16, 100, 1.0), ("bf16_w45_t13", torch.bfloat16, 45, 1.3),
             ("fp32_w5", torch.float32, 5, 1.0)]
    # chunked partials path (chunk_size=4) / one pass (None) / one pass with rows split in 64-column programs
    for mode, chunk, split in [("chunked", 4, None), ("onepass", None, None), ("split", None, 64)]:
        k.SPLIT_COLS = split
        for name, dtype, width, temp in cases:
            x = (torch.randn(3, 5, width, generator=g) * 2).to(dtype)
            t = torch.randint(0, width, (3, 5), generator=g)
            x0 = x.clone()
            res[f"{mode}_{name}"] = _errors(x, t, temp, device, chunk_size=chunk)
            res[f"{mode}_{name}"]["unchanged"] = bool(torch.equal(x, x0))
    k.SPLIT_COLS = 64
    # padded rows: constant logits and zero upstream gradients (exactly zero gradient there)
    x = torch.randn(6, 150, generator=g) * 2
    x[4:] = 0.0
    t = torch.randint(0, 150, (6,), generator=g)
    g_lp, g_ent = torch.rand(6, generator=g) * 2 - 1, torch.rand(6, generator=g) * 2 - 1
    g_lp[4:], g_ent[4:] = 0.0, 0.0
    res["padded_bf16"] = _errors(x.to(torch.bfloat16), t, 0.9, device, g_lp=g_lp, g_ent=g_ent)
    res["padded_fp32_logp_only"] = _errors(x, t, 1.0, device, g_lp=g_lp, g_ent=torch.zeros(6))
    k.SPLIT_COLS = None
    # a loss on one output only (the other's upstream gradient is None in backward)
    from megatron_rl.logprobs import vocab_parallel_logprobs
    x = torch.randn(7, 90, generator=g) * 2
    t = torch.randint(0, 90, (7,), generator=g)
    single = {}
    for which in ("logp", "ent"):
        xin = x.to(device).clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(xin, t.to(device), backend="triton")
        (lp if which == "logp" else ent).sum().backward()
        ones, zeros = torch.ones(7), torch.zeros(7)
        r_g = _ref(x, t, 1.0, ones if which == "logp" else zeros, zeros if which == "logp" else ones)[2]
        single[which] = float((xin.grad.cpu().double() - r_g).abs().max())
    res["single_output"] = single
    # target ids outside the vocab: named, also on the one-pass path (checked on the device)
    bad_t = t.clone()
    bad_t[3] = 90
    try:
        vocab_parallel_logprobs(x.to(device), bad_t.to(device), backend="triton")
        res["bad_target"] = None
    except ValueError as e:
        res["bad_target"] = str(e)
    # fused linear with the Triton row kernels on recomputed chunks
    from megatron_rl.logprobs import fused_linear_logprobs
    h = torch.randn(9, 8, generator=g) / 2
    w = torch.randn(70, 8, generator=g) / 2
    t = torch.randint(0, 70, (9,), generator=g)
    hin, win = h.to(device).clone().requires_grad_(), w.to(device).clone().requires_grad_()
    lp, ent = fused_linear_logprobs(hin, win, t.to(device), chunk_size=4, backend="triton")
    (lp * 0.5 - ent * 0.25).sum().backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    ls = torch.log_softmax(hd @ wd.t(), -1)
    r_lp, r_ent = ls.gather(-1, t[:, None])[:, 0], -(ls.exp() * ls).sum(-1)
    (r_lp * 0.5 - r_ent * 0.25).sum().backward()
    res["fused"] = dict(logp=float((lp.detach().cpu().double() - r_lp.detach()).abs().max()),
                        ent=float((ent.detach().cpu().double() - r_ent.detach()).abs().max()),
                        dh=float((hin.grad.cpu().double() - hd.grad).abs().max()),
                        dw=float((win.grad.cpu().double() - wd.grad).abs().max()))
    # non-finite logits are detected from the kernel partials
    from megatron_rl.logprobs import vocab_parallel_logprobs
    msgs = {}
    for split in (None, 32):  # one program per row / two column splits (the bad value in the second)
        k.SPLIT_COLS = split
        for label, val in [("nan", float("nan")), ("inf", float("inf")), ("ninf", float("-inf"))]:
            x = torch.randn(4, 50, generator=g)
            x[2, 33] = val
            try:
                vocab_parallel_logprobs(x.to(device), torch.zeros(4, dtype=torch.long, device=device),
                                        backend="triton")
                msgs[f"{label}_split{split}"] = None
            except ValueError as e:
                msgs[f"{label}_split{split}"] = str(e)
    k.SPLIT_COLS = None
    res["nonfinite"] = msgs
    # logits that require grad (a training step): the one-pass forward does not block; the backward raises
    deferred = {}
    for label in ("nan", "target"):
        x = torch.randn(4, 50, generator=g)
        t = torch.zeros(4, dtype=torch.long)
        if label == "nan":
            x[2, 33] = float("nan")
        else:
            t[1] = 50
        xin = x.to(device).requires_grad_()
        lp, ent = vocab_parallel_logprobs(xin, t.to(device), backend="triton")
        try:
            (lp.nan_to_num() + ent.nan_to_num()).sum().backward()
            deferred[label] = None
        except ValueError as e:
            deferred[label] = str(e)
    res["deferred"] = deferred
    # TP=2 over gloo (CPU only: gloo)
    if device == "cpu":
        from megatron_rl.testing.distributed import run_ranks
        x = torch.randn(2, 6, 90, generator=g) * 2  # 45 per rank: not a multiple of the block
        t = torch.randint(0, 90, (2, 6), generator=g)
        out = run_ranks(_tp_rank, 2, x, t, 0.8, timeout=300)
        g_lp, g_ent = torch.full(t.shape, 0.5), torch.full(t.shape, -0.25)
        r_lp, r_ent, r_g = _ref(x, t, 0.8, g_lp, g_ent)
        res["tp2"] = dict(logp=max(float((o[0].double() - r_lp).abs().max()) for o in out),
                          ent=max(float((o[1].double() - r_ent).abs().max()) for o in out),
                          grad=float((torch.cat([o[2] for o in out], -1).double() - r_g).abs().max()))
    return res


def _assert_results(res):
    for name, r in res.items():
        if name in ("fused", "nonfinite", "tp2", "single_output", "bad_target", "deferred"):
            continue
        assert r["logp"] <= TOL_LOGP and r["ent"] <= TOL_ENT, (name, r)
        assert r["grad_excess"] <= TOL_GRAD, (name, r)
        assert r["vs_torch_logp"] <= TOL_LOGP, (name, r)
        assert r["zero_rows_grad"] == 0.0, (name, r)
        assert r["unchanged"], name
        assert r["grad_dtype"] == ("torch.bfloat16" if "bf16" in name else "torch.float32"), (name, r)
    assert len([n for n in res if n.startswith(("chunked_", "onepass_", "split_"))]) == 15
    assert max(res["single_output"].values()) <= TOL_GRAD, res["single_output"]
    assert res["bad_target"] is not None and "target_ids has 1 id(s) outside [0, 90)" in res["bad_target"] \
        and "index (3,): 90" in res["bad_target"], res["bad_target"]
    f = res["fused"]
    assert f["logp"] <= TOL_LOGP and f["ent"] <= TOL_ENT and f["dh"] <= TOL_GRAD and f["dw"] <= TOL_GRAD, f
    assert len(res["nonfinite"]) == 6
    for label, msg in res["nonfinite"].items():
        assert msg is not None and "1 non-finite value(s)" in msg and "local vocab column 33" in msg, (label, msg)
    d = res["deferred"]
    assert d["nan"] is not None and "1 non-finite value(s)" in d["nan"] and "local vocab column 33" in d["nan"], d
    assert d["target"] is not None and "target_ids has 1 id(s) outside [0, 50)" in d["target"], d
    if "tp2" in res:
        t = res["tp2"]
        assert t["logp"] <= TOL_LOGP and t["ent"] <= TOL_ENT and t["grad"] <= TOL_GRAD, t


@pytest.mark.timeout(300)
def test_kernels_under_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, env=env,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    _assert_results(json.loads(line[len("RESULTS "):]))


@pytest.mark.gpu
def test_kernels_on_gpu():
    pytest.importorskip("triton")
    _assert_results(run_checks("cuda"))


@pytest.mark.gpu
def test_past_2_pow_31_elements_on_gpu():
    """16384 x 151936 bf16 logits (2.49e9 elements): first / last rows against float64 (int64 offsets)."""
    pytest.importorskip("triton")
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2 ** 30:
        pytest.skip("needs ~16 GiB of device memory")
    from megatron_rl.logprobs import vocab_parallel_logprobs
    n, v = 16384, 151936
    x = torch.empty(n, v, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(0, n, 2048):
        x[i:i + 2048] = torch.randn(2048, v, device="cuda", generator=g) * 3
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    rows = torch.cat([torch.arange(64), torch.arange(n - 64, n)]).cuda()
    g_lp, g_ent = torch.rand(n, device="cuda") * 2 - 1, torch.rand(n, device="cuda") * 2 - 1
    xin = x.requires_grad_()
    lp, ent = vocab_parallel_logprobs(xin, t, temperature=0.8, backend="triton")
    (lp * g_lp + ent * g_ent).sum().backward()
    r_lp, r_ent, r_g = _ref(x.detach()[rows], t[rows], 0.8, g_lp[rows], g_ent[rows])
    assert (lp.detach()[rows].double() - r_lp).abs().max() <= TOL_LOGP
    assert (ent.detach()[rows].double() - r_ent).abs().max() <= TOL_ENT
    gr = xin.grad[rows].double()
    assert ((gr - r_g).abs() - r_g.abs() * 2 ** -8).max() <= TOL_GRAD


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(), \
        "run with TRITON_INTERPRET=1 on CPU"
    torch.set_num_threads(1)
    print("RESULTS " + json.dumps(run_checks("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")))

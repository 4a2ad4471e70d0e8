"""Single-process tests of megatron_rl.logprobs against an independent float64 torch reference.

Reference: float64 log_softmax(logits / T) + gather, entropy -sum p log p, gradients by float64 autograd.
Covers fp32 and bf16 inputs, temperature, chunking, losses on log-probs / entropy / both, the fused
linear version, inputs left unchanged, and bad inputs (clear ValueErrors).
Run: OMP_NUM_THREADS=1 pytest tests/unit/test_logprobs.py -q
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron_rl.logprobs import fused_linear_logprobs, vocab_parallel_logprobs

TOL_LOGP = 1e-5
TOL_ENT = 1e-5
TOL_GRAD = 1e-6


def ref64(logits, targets, temperature=1.0):
    """float64 (logp, entropy) of softmax(logits / T) for the full vocab; differentiable."""
    ls = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = ls.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    return logp, ent


def ref_grad(logits, targets, g_logp, g_ent, temperature=1.0):
    """float64 d(sum g_logp*logp + g_ent*ent)/d logits."""
    x = logits.detach().double().requires_grad_()
    logp, ent = ref64(x, targets, temperature)
    loss = 0.0
    if g_logp is not None:
        loss = loss + (logp * g_logp.double()).sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent.double()).sum()
    loss.backward()
    return x.grad


def make(shape, vocab, dtype=torch.float32, scale=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, vocab, generator=g) * scale).to(dtype)
    t = torch.randint(0, vocab, shape, generator=g)
    return x, t


def upstream(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) * 2 - 1, torch.rand(*shape, generator=g) * 2 - 1


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_size", [None, 1, 7])
def test_fp32_matches_float64_reference(temperature, chunk_size):
    x, t = make((3, 17), 1531)
    g_lp, g_ent = upstream((3, 17))
    xin = x.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(xin, t, temperature=temperature, chunk_size=chunk_size)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32 and logp.shape == (3, 17)
    r_lp, r_ent = ref64(x, t, temperature)
    assert (logp.double() - r_lp).abs().max() <= TOL_LOGP
    assert (ent.double() - r_ent).abs().max() <= TOL_ENT
    (logp * g_lp + ent * g_ent).sum().backward()
    r_g = ref_grad(x, t, g_lp, g_ent, temperature)
    assert xin.grad.dtype == torch.float32
    assert (xin.grad.double() - r_g).abs().max() <= TOL_GRAD


@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_loss_on_one_output_only(which):
    x, t = make((40,), 999, scale=3.0)
    g_lp, g_ent = upstream((40,))
    xin = x.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(xin, t, chunk_size=9)
    out, g = (logp, g_lp) if which == "logp" else (ent, g_ent)
    (out * g).sum().backward()
    r_g = ref_grad(x, t, g_lp if which == "logp" else None, g_ent if which == "entropy" else None)
    assert (xin.grad.double() - r_g).abs().max() <= TOL_GRAD


def test_compute_entropy_false_returns_none_and_same_logp():
    x, t = make((20,), 300)
    lp1, ent = vocab_parallel_logprobs(x, t, compute_entropy=False)
    assert ent is None
    r_lp, _ = ref64(x, t)
    assert (lp1.double() - r_lp).abs().max() <= TOL_LOGP


def test_bf16_exact_on_its_values_and_within_bf16_rounding_of_fp32():
    x32, t = make((2, 33), 2003, scale=3.0)
    x16 = x32.to(torch.bfloat16)
    g_lp, g_ent = upstream((2, 33))
    xin = x16.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(xin, t, chunk_size=5, temperature=0.9)
    assert logp.dtype == torch.float32
    # exact on the bf16 values (upcast is exact): same fp32 tolerances
    r_lp, r_ent = ref64(x16, t, 0.9)
    assert (logp.double() - r_lp).abs().max() <= TOL_LOGP
    assert (ent.double() - r_ent).abs().max() <= TOL_ENT
    # within bf16 rounding of the fp32 answer: |d logp| <= 2 max|dx| / T, |d H| <= 2 |dx|_max / T * (1 + max|log p|)
    dx = (x16.double() - x32.double()).abs().max() / 0.9
    f_lp, f_ent = ref64(x32, t, 0.9)
    assert (logp.double() - f_lp).abs().max() <= 2 * dx + TOL_LOGP
    assert (ent.double() - f_ent).abs().max() <= 2 * dx * (1 + f_lp.abs().max()) + TOL_ENT
    (logp * g_lp + ent * g_ent).sum().backward()
    assert xin.grad.dtype == torch.bfloat16
    r_g = ref_grad(x16, t, g_lp, g_ent, 0.9)
    # the gradient is computed in fp32 and rounded once to bf16 (relative 2**-8)
    assert ((xin.grad.double() - r_g).abs() <= r_g.abs() * 2 ** -8 + TOL_GRAD).all()


def test_inputs_unchanged():
    for dtype in (torch.float32, torch.bfloat16):
        x, t = make((5, 6), 257, dtype=dtype)
        x0, t0 = x.clone(), t.clone()
        xin = x.clone().requires_grad_()
        logp, ent = vocab_parallel_logprobs(xin, t, temperature=0.5, chunk_size=4)
        (logp.sum() + ent.sum()).backward()
        assert torch.equal(xin.detach(), x0) and torch.equal(t, t0)


def test_targets_any_int_dtype_and_shape_1d_0d():
    x, t = make((11,), 100)
    lp64, _ = vocab_parallel_logprobs(x, t)
    lp32, _ = vocab_parallel_logprobs(x, t.to(torch.int32))
    assert torch.equal(lp64, lp32)
    lp0, e0 = vocab_parallel_logprobs(x[3], t[3])
    assert lp0.shape == () and abs(float(lp0) - float(ref64(x[3], t[3])[0])) <= TOL_LOGP


def test_empty_token_batch():
    x = torch.randn(0, 50, requires_grad=True)
    lp, ent = vocab_parallel_logprobs(x, torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert x.grad.shape == (0, 50)


def test_noncontiguous_logits_warn_and_stay_correct():
    x, t = make((6, 4), 77)
    xt = x.transpose(0, 1)  # [4, 6, V], not viewable as [24, V]
    with pytest.warns(UserWarning, match="contiguous copy"):
        lp, _ = vocab_parallel_logprobs(xt, t.t())
    assert (lp.double() - ref64(xt, t.t())[0]).abs().max() <= TOL_LOGP


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=0.0), "temperature must be finite and > 0"),
    (dict(temperature=-1.0), "temperature must be finite and > 0"),
    (dict(temperature=float("nan")), "temperature must be finite and > 0"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(backend="cuda"), "backend must be one of"),
])
def test_bad_options(kwargs, match):
    x, t = make((4,), 10)
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs(x, t, **kwargs)


def test_bad_targets_and_shapes():
    x, t = make((2, 5), 10)
    bad = t.clone()
    bad[1, 3] = 10
    with pytest.raises(ValueError, match=r"target_ids has 1 id\(s\) outside \[0, 10\).*index \(1, 3\): 10"):
        vocab_parallel_logprobs(x, bad)
    bad[0, 0] = -1
    with pytest.raises(ValueError, match=r"2 id\(s\) outside.*index \(0, 0\): -1"):
        vocab_parallel_logprobs(x, bad)
    with pytest.raises(ValueError, match=r"target_ids has shape \(2, 4\) but the logits' leading dims are \(2, 5\)"):
        vocab_parallel_logprobs(x, t[:, :4])
    with pytest.raises(ValueError, match="integer tensor"):
        vocab_parallel_logprobs(x, t.float())
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        vocab_parallel_logprobs(x.double(), t)
    with pytest.raises(ValueError, match="empty last dimension"):
        vocab_parallel_logprobs(torch.zeros(2, 0), t[0, :2])
    with pytest.raises(ValueError, match="logits_shard must be a torch.Tensor"):
        vocab_parallel_logprobs([1.0], t)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        vocab_parallel_logprobs(x, t, tp_group=object())


@pytest.mark.parametrize("value,dtype", [(float("nan"), torch.float32), (float("inf"), torch.float32),
                                         (float("-inf"), torch.float32), (float("nan"), torch.bfloat16)])
def test_nonfinite_logits_named_with_count_and_position(value, dtype):
    x, t = make((3, 4), 64, dtype=dtype)
    x[2, 1, 7] = value
    x[2, 3, 0] = value
    with pytest.raises(ValueError, match=r"2 non-finite value\(s\) .* in 2 token\(s\); first at token index "
                                         r"\(2, 1\), local vocab column 7"):
        vocab_parallel_logprobs(x, t, chunk_size=5, compute_entropy=False)


@pytest.mark.parametrize("case", ["nan", "target"])
def test_training_forward_defers_the_check_to_backward(case):
    """Logits that require grad: the forward does not block on its error flags; the backward raises the same
    named error before returning a gradient. Without grad (no_grad or plain tensors) the forward raises."""
    x, t = make((2, 5), 40)
    if case == "nan":
        x[1, 2, 7] = float("nan")
        match = r"1 non-finite value\(s\) .* in 1 token\(s\); first at token index \(1, 2\), local vocab column 7"
    else:
        t = t.clone()
        t[1, 3] = 40
        match = r"target_ids has 1 id\(s\) outside \[0, 40\).*index \(1, 3\): 40"
    for chunk in (None, 3):  # one chunk / several chunks
        xin = x.clone().requires_grad_()
        logp, ent = vocab_parallel_logprobs(xin, t, chunk_size=chunk)  # no raise: checked in backward
        with pytest.raises(ValueError, match=match):
            (logp.nan_to_num() + ent.nan_to_num()).sum().backward()
        assert xin.grad is None
        with torch.no_grad(), pytest.raises(ValueError, match=match):
            vocab_parallel_logprobs(xin, t, chunk_size=chunk)
        with pytest.raises(ValueError, match=match):
            vocab_parallel_logprobs(x, t, chunk_size=chunk)


def test_training_forward_gradient_unchanged_by_deferred_check():
    """The deferred path returns the float64 reference values and gradient (finite inputs)."""
    x, t = make((3, 4), 50, scale=3.0)
    g_lp, g_ent = upstream((3, 4))
    xin = x.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(xin, t, temperature=0.8, chunk_size=5)
    ((logp * g_lp).sum() + (ent * g_ent).sum()).backward()
    r_lp, r_ent = ref64(x, t, 0.8)
    assert (logp.double() - r_lp).abs().max() <= TOL_LOGP and (ent.double() - r_ent).abs().max() <= TOL_ENT
    assert (xin.grad.double() - ref_grad(x, t, g_lp, g_ent, 0.8)).abs().max() <= TOL_GRAD


# ---------------------------------------------------------------- fused linear
def fused_ref(h, w, t, g_lp, g_ent, temperature=1.0):
    hd = h.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    logp, ent = ref64(hd @ wd.t(), t, temperature)
    ((logp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    return logp.detach(), ent.detach(), hd.grad, wd.grad


@pytest.mark.parametrize("chunk_size,temperature", [(None, 1.0), (3, 0.8), (50, 1.0)])
def test_fused_linear_fp32_matches_float64(chunk_size, temperature):
    g = torch.Generator().manual_seed(3)
    n, hdim, vocab = 21, 24, 517
    h = torch.randn(n, hdim, generator=g) / 2
    w = torch.randn(vocab, hdim, generator=g) / 2
    t = torch.randint(0, vocab, (n,), generator=g)
    g_lp, g_ent = upstream((n,))
    hin, win = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = fused_linear_logprobs(hin, win, t, temperature=temperature, chunk_size=chunk_size)
    (logp * g_lp + ent * g_ent).sum().backward()
    r_lp, r_ent, r_dh, r_dw = fused_ref(h, w, t, g_lp, g_ent, temperature)
    assert (logp.double() - r_lp).abs().max() <= TOL_LOGP
    assert (ent.double() - r_ent).abs().max() <= TOL_ENT
    assert (hin.grad.double() - r_dh).abs().max() <= TOL_GRAD
    assert (win.grad.double() - r_dw).abs().max() <= TOL_GRAD
    assert torch.equal(hin.detach(), h) and torch.equal(win.detach(), w)


def test_fused_linear_equals_unfused_on_same_logits_bf16():
    g = torch.Generator().manual_seed(4)
    h = (torch.randn(2, 9, 32, generator=g)).to(torch.bfloat16)
    w = (torch.randn(301, 32, generator=g) / 4).to(torch.bfloat16)
    t = torch.randint(0, 301, (2, 9), generator=g)
    g_lp, g_ent = upstream((2, 9))
    hin, win = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = fused_linear_logprobs(hin, win, t, chunk_size=4)
    (logp * g_lp + ent * g_ent).sum().backward()
    # independent: float64 math on the bf16 logits the unfused output layer would produce
    logits = (h @ w.t())
    r_lp, r_ent = ref64(logits, t)
    assert (logp.double() - r_lp).abs().max() <= TOL_LOGP
    assert (ent.double() - r_ent).abs().max() <= TOL_ENT
    r_dl = ref_grad(logits, t, g_lp, g_ent).to(torch.bfloat16)  # autograd's bf16 dlogits
    r_dh = r_dl.double() @ w.double()
    r_dw = r_dl.double().reshape(-1, 301).t() @ h.double().reshape(-1, 32)
    assert ((hin.grad.double() - r_dh).abs() <= r_dh.abs() * 2 ** -7 + 1e-3).all()
    assert ((win.grad.double() - r_dw).abs() <= r_dw.abs() * 2 ** -7 + 1e-3).all()


def test_fused_linear_only_hidden_grad_and_bad_inputs():
    h = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(30, 8)
    t = torch.randint(0, 30, (5,))
    logp, _ = fused_linear_logprobs(h, w, t, compute_entropy=False)
    logp.sum().backward()
    r = h.detach().double().requires_grad_()
    ref64(r @ w.double().t(), t)[0].sum().backward()
    assert (h.grad.double() - r.grad).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="hidden size mismatch"):
        fused_linear_logprobs(h, torch.randn(30, 7), t)
    with pytest.raises(ValueError, match="must share dtype"):
        fused_linear_logprobs(h, w.bfloat16(), t)
    with pytest.raises(ValueError, match="must be 2-D"):
        fused_linear_logprobs(h, w.unsqueeze(0), t)
    hn = h.detach().clone()
    hn[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite logits .* 1 token\(s\), first at token index \(2,\): "
                                         r"hidden has 1 NaN/inf"):
        fused_linear_logprobs(hn, w, t)


# ---------------------------------------------------------------- property test
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), vocab=st.integers(1, 300), chunk=st.integers(1, 13),
       temperature=st.floats(0.25, 4.0), scale=st.floats(0.0, 8.0), seed=st.integers(0, 2 ** 16))
def test_property_matches_reference(n, vocab, chunk, temperature, scale, seed):
    x, t = make((n,), vocab, scale=scale, seed=seed)
    g_lp, g_ent = upstream((n,), seed=seed + 1)
    xin = x.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(xin, t, temperature=temperature, chunk_size=chunk)
    r_lp, r_ent = ref64(x, t, temperature)
    big = max(1.0, scale / temperature)  # errors scale with the logit range in fp32
    assert (logp.double() - r_lp).abs().max() <= TOL_LOGP * big
    assert (ent.double() - r_ent).abs().max() <= TOL_ENT * big
    (logp * g_lp + ent * g_ent).sum().backward()
    assert (xin.grad.double() - ref_grad(x, t, g_lp, g_ent, temperature)).abs().max() <= TOL_GRAD * big * 2


# ---------------------------------------------------------------- the CUDA variant of the torch path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("which", ["both", "logp", "entropy"])
def test_fewer_passes_torch_primitives_match_float64(dtype, temperature, which):
    """The CUDA torch primitives (mixed-dtype ops, folded coefficients), run here on CPU tensors."""
    from megatron_rl.logprobs import torch_path
    from megatron_rl.logprobs.combine import combine_partials
    x, t = make((29,), 1001, dtype=dtype, scale=3.0)
    t[3] = 1000  # last column
    g_lp, g_ent = upstream((29,))
    g_lp = None if which == "entropy" else g_lp
    g_ent = None if which == "logp" else g_ent
    ws = torch_path.Workspace(x.device)
    inv = 1.0 / temperature
    m, s, tgt, spz = torch_path.chunk_partials_fewer_passes(x, t, inv, ws)
    logp, ent, mx, log_s, bad = combine_partials(m, s, tgt, spz, inv, None, 1)
    r_lp, r_ent = ref64(x, t, temperature)
    assert not bad.any()
    assert (logp.double() - r_lp).abs().max() <= TOL_LOGP
    assert (ent.double() - r_ent).abs().max() <= TOL_ENT
    out = torch.empty_like(x)
    torch_path.chunk_grad_fewer_passes(x, t, inv, mx, log_s, ent, g_logp=g_lp, g_ent=g_ent, out=out, ws=ws)
    r_g = ref_grad(x, t, g_lp, g_ent, temperature)
    rel = 2 ** -8 if dtype == torch.bfloat16 else 0.0
    assert out.dtype == dtype
    assert ((out.double() - r_g).abs() <= r_g.abs() * rel + TOL_GRAD).all()
    # out-of-shard targets (TP): no one-hot term, tgt 0
    m2, s2, tgt2, spz2 = torch_path.chunk_partials_fewer_passes(x, t + 1001, inv, ws)
    assert torch.equal(tgt2, torch.zeros_like(tgt2)) and torch.equal(m2, m)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_passes_partials_flag_nonfinite_rows(value, dtype):
    """A NaN / +inf / -inf logit makes exactly its row's combined statistics non-finite (CUDA variant)."""
    from megatron_rl.logprobs import torch_path
    from megatron_rl.logprobs.combine import combine_partials
    x, t = make((6,), 300, dtype=dtype)
    x[4, 17] = value
    m, s, tgt, spz = torch_path.chunk_partials_fewer_passes(x, t, 1.0 / 0.9, torch_path.Workspace(x.device))
    bad = combine_partials(m, s, tgt, spz, 1.0 / 0.9, None, 1)[4]
    assert bad.tolist() == [False, False, False, False, True, False]


# ---------------------------------------------------------------- kernel configuration tuner
def test_tuner_picks_fastest_caches_and_skips_failures():
    k = pytest.importorskip("megatron_rl_kernels.logprob_kernels")
    fake_ms = {"a": 3.0, "b": 1.0, "c": 2.0}
    calls = []

    def launch(cfg):
        calls.append(cfg)
        if cfg == "bad":
            raise RuntimeError("out of resources")

    tuner = k.Tuner(timer=lambda fn: (fn(), fake_ms[calls[-1]])[1])
    assert tuner.pick("fwd", ("bf16", 100), ["a", "bad", "b", "c"], launch) == "b"
    assert tuner.pick("fwd", ("bf16", 100), ["a", "b", "c"], launch) == "b"  # cached: no new launches
    assert calls == ["a", "bad", "b", "c"]
    assert tuner.log[0]["skipped"] == "bad" and "out of resources" in tuner.log[0]["error"]
    assert tuner.log[1]["best"] == "b" and tuner.log[1]["times_ms"] == {"a": 3.0, "b": 1.0, "c": 2.0}
    assert tuner.pick("grad", ("bf16", 100), ["c", "a"], launch) == "c"  # another kind: tuned on its own
    with pytest.raises(RuntimeError, match="no fwd kernel configuration runs on this device.*out of resources"):
        tuner.pick("fwd", ("fp32", 7), ["bad"], launch)
    assert not tuner.enabled(torch.device("cpu"), 1 << 30)  # only CUDA tensors are tuned

"""Tensor-parallel tests of megatron_rl.logprobs over gloo: TP=1, 2, 4 against megatron-core's
``vocab_parallel_cross_entropy`` (same process group, same shards) and a single-process float64 reference.

Each rank initialises megatron's parallel_state (tensor_model_parallel_size=TP), takes its vocab slice
(megatron VocabUtility ranges), runs both implementations and returns results to the parent.
Run: OMP_NUM_THREADS=1 pytest tests/integration/test_logprobs_tp.py -q
"""
import pytest
import torch

# imported in the parent so that forked ranks do not pay megatron's ~3 s import each
from megatron.core import parallel_state  # noqa: F401
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: F401

from megatron_rl.logprobs import fused_linear_logprobs, vocab_parallel_logprobs  # noqa: F401
from megatron_rl.testing.distributed import run_ranks

TOL_LOGP = 1e-5
TOL_ENT = 1e-5
TOL_GRAD = 1e-6
TIMEOUT = 120


def ref64(logits, targets, temperature=1.0):
    ls = torch.log_softmax(logits.double() / temperature, dim=-1)
    return ls.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(ls.exp() * ls).sum(-1)


def data(n_tok=(3, 7), vocab=1024, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*n_tok, vocab, generator=g) * 2).to(dtype)
    t = torch.randint(0, vocab, n_tok, generator=g)
    g_lp = torch.rand(*n_tok, generator=g) * 2 - 1
    g_ent = torch.rand(*n_tok, generator=g) * 2 - 1
    return x, t, g_lp, g_ent


def _init_tp(world):
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()


def _shard(x, rank, world):
    from megatron.core.tensor_parallel.utils import VocabUtility
    vp = x.shape[-1] // world
    lo, hi = VocabUtility.vocab_range_from_per_partition_vocab_size(vp, rank, world)
    return x[..., lo:hi].contiguous()


def _vs_megatron(rank, world, x, t, g_lp, g_ent, temperature, chunk_size):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron_rl.logprobs import vocab_parallel_logprobs
    group, tp_rank = _init_tp(world)
    shard = _shard(x, tp_rank, world)
    shard0 = shard.clone()
    # ours: loss on log-probs only (to compare grads with megatron), then on both outputs
    xin = shard.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(xin, t, tp_group=group, temperature=temperature, chunk_size=chunk_size)
    (logp * g_lp).sum().backward()
    grad_lp = xin.grad.clone()
    xin2 = shard.clone().requires_grad_()
    logp2, ent2 = vocab_parallel_logprobs(xin2, t, tp_group=group, temperature=temperature, chunk_size=chunk_size)
    (logp2 * g_lp + ent2 * g_ent).sum().backward()
    # megatron: -loss = logp; it overwrites fp32 logits in place -> pass a clone (of the scaled logits)
    mx = (shard.float() / temperature).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mx.clone(), t)
    (-loss * g_lp).sum().backward()
    return dict(logp=logp.detach(), ent=ent.detach(), grad_lp=grad_lp, grad_both=xin2.grad,
                mlogp=-loss.detach(), mgrad=mx.grad / temperature, unchanged=torch.equal(shard, shard0))


def _gather_vocab(parts):
    return torch.cat(parts, dim=-1)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tp_fp32_vs_megatron_and_float64(world, temperature):
    x, t, g_lp, g_ent = data()
    res = run_ranks(_vs_megatron, world, x, t, g_lp, g_ent, temperature, 5, timeout=TIMEOUT)
    r_lp, r_ent = ref64(x, t, temperature)
    xd = x.double().requires_grad_()
    lp_d, ent_d = ref64(xd, t, temperature)
    (lp_d * g_lp.double() + ent_d * g_ent.double()).sum().backward()
    for r in res:
        assert r["unchanged"]
        assert (r["logp"].double() - r_lp).abs().max() <= TOL_LOGP
        assert (r["ent"].double() - r_ent).abs().max() <= TOL_ENT
        assert (r["logp"] - r["mlogp"]).abs().max() <= TOL_LOGP  # megatron-core on the same shards
        assert torch.equal(r["logp"], res[0]["logp"]) and torch.equal(r["ent"], res[0]["ent"])
    grad_ours = _gather_vocab([r["grad_lp"] for r in res])
    grad_meg = _gather_vocab([r["mgrad"] for r in res])
    assert (grad_ours - grad_meg).abs().max() <= TOL_GRAD
    assert (_gather_vocab([r["grad_both"] for r in res]).double() - xd.grad).abs().max() <= TOL_GRAD


def test_tp2_bf16_vs_megatron_on_same_values():
    x, t, g_lp, g_ent = data(dtype=torch.bfloat16, seed=5, vocab=2002)  # 1001 per rank: odd widths
    res = run_ranks(_vs_megatron, 2, x, t, g_lp, g_ent, 1.0, None, timeout=TIMEOUT)
    r_lp, r_ent = ref64(x, t)
    xd = x.double().requires_grad_()
    lp_d, ent_d = ref64(xd, t)
    (lp_d * g_lp.double() + ent_d * g_ent.double()).sum().backward()
    for r in res:
        assert r["unchanged"]
        assert (r["logp"].double() - r_lp).abs().max() <= TOL_LOGP
        assert (r["ent"].double() - r_ent).abs().max() <= TOL_ENT
        assert (r["logp"] - r["mlogp"]).abs().max() <= TOL_LOGP
    g = _gather_vocab([r["grad_both"] for r in res])
    assert g.dtype == torch.bfloat16
    assert ((g.double() - xd.grad).abs() <= xd.grad.abs() * 2 ** -8 + TOL_GRAD).all()


def _fused(rank, world, h, w, t, g_lp, g_ent, reduce_hidden_grad):
    from megatron_rl.logprobs import fused_linear_logprobs
    group, tp_rank = _init_tp(world)
    w_r = _shard(w.t(), tp_rank, world).t().contiguous()  # rows of W for this vocab slice
    hin, win = h.clone().requires_grad_(), w_r.clone().requires_grad_()
    logp, ent = fused_linear_logprobs(hin, win, t, tp_group=group, chunk_size=4,
                                      reduce_hidden_grad=reduce_hidden_grad)
    (logp * g_lp + ent * g_ent).sum().backward()
    return dict(logp=logp.detach(), ent=ent.detach(), dh=hin.grad, dw=win.grad)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_fused_linear_full_gradients(world):
    g = torch.Generator().manual_seed(7)
    n, hdim, vocab = 10, 16, 400
    h = torch.randn(n, hdim, generator=g) / 2
    w = torch.randn(vocab, hdim, generator=g) / 2
    t = torch.randint(0, vocab, (n,), generator=g)
    g_lp, g_ent = torch.rand(n, generator=g) * 2 - 1, torch.rand(n, generator=g) * 2 - 1
    res = run_ranks(_fused, world, h, w, t, g_lp, g_ent, True, timeout=TIMEOUT)
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lp, ent = ref64(hd @ wd.t(), t)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    for r in res:
        assert (r["logp"].double() - lp).abs().max() <= TOL_LOGP
        assert (r["ent"].double() - ent).abs().max() <= TOL_ENT
        # the FULL hidden gradient (sum over vocab slices) on every rank
        assert (r["dh"].double() - hd.grad).abs().max() <= TOL_GRAD
    assert (torch.cat([r["dw"] for r in res]).double() - wd.grad).abs().max() <= TOL_GRAD
    # without the internal reduction each rank holds only its slice's contribution; they sum to the full one
    part = run_ranks(_fused, world, h, w, t, g_lp, g_ent, False, timeout=TIMEOUT)
    assert (sum(r["dh"].double() for r in part) - hd.grad).abs().max() <= TOL_GRAD
    assert (part[0]["dh"].double() - hd.grad).abs().max() > 1e-3


# ---------------------------------------------------------------- bad input raised on every rank
def _bad(rank, world, case):
    import torch.distributed as dist
    from megatron_rl.logprobs import vocab_parallel_logprobs
    x, t, _, _ = data(vocab=64)
    vp = 32
    shard = x[..., rank * vp:(rank + 1) * vp].clone()
    if case == "partition" and rank == 1:
        shard = shard[..., :31]
    if case == "tokens" and rank == 1:
        shard, t = shard[:2], t[:2]
    if case == "targets" and rank == 1:
        t = t.clone()
        t[0, 0] = (t[0, 0] + 1) % 64
    if case == "range":
        t = t.clone()
        t[1, 2] = 64
    if case == "nan" and rank == 1:
        shard[2, 3, 5] = float("nan")
    try:
        vocab_parallel_logprobs(shard, t, tp_group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case,match", [
    ("partition", "vocab partition of logits_shard differs across TP ranks"),
    ("tokens", "number of tokens differs across TP ranks"),
    ("targets", "target_ids differ across TP ranks"),
    ("range", r"outside \[0, 64\)"),
    ("nan", "non-finite"),
])
def test_tp_bad_input_raises_on_every_rank(case, match):
    import re
    msgs = run_ranks(_bad, 2, case, timeout=TIMEOUT)
    assert all(m is not None and re.search(match, m) for m in msgs), msgs
    if case == "nan":
        assert "on TP rank 1 has 1 non-finite value(s)" in msgs[1] and "(2, 3)" in msgs[1]
        assert "on another TP rank" in msgs[0]

"""sum_j p_j^2 per token from ``vocab_parallel_logprobs(..., compute_sum_pi_squared=True)`` (verl's
``actor.calculate_sum_pi_squared``) against single-process float64 torch ``softmax(logits / T) ** 2`` summed over
the vocabulary: fp32 / bf16, temperatures, chunked, a near-one-hot and a uniform row, no tokens; at TP1, TP2 and
TP4 over gloo (each rank holds its vocab slice) with exactly one more all-reduce, of [tokens]; the log-probs,
entropy and gradient unchanged by it; the fused linear path (hidden @ W^T never stored) the same way; the Triton
kernels' statistics under the Triton interpreter.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_sum_pi_squared.py -q``
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.logprobs import fused_linear_logprobs, vocab_parallel_logprobs
from megatron_rl.testing.distributed import run_ranks

TOL = 2e-6


def _data(n=(3, 7), vocab=96, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*n, vocab, generator=g) * 3
    x[0, 0, 5] = 40.0          # near one-hot: sum p^2 ~ 1
    x[1, 2] = 0.5              # uniform: sum p^2 = 1 / V
    return x.to(dtype), torch.randint(0, vocab, n, generator=g)


def _ref(x, temperature):
    return (torch.softmax(x.double() / temperature, dim=-1) ** 2).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,chunk", [(1.0, None), (0.6, 4), (1.7, 1)])
def test_single_process_vs_torch_softmax(dtype, temperature, chunk):
    x, t = _data(dtype=dtype)
    x0 = x.clone()
    lp, ent, spp = vocab_parallel_logprobs(x, t, temperature=temperature, chunk_size=chunk,
                                           compute_sum_pi_squared=True)
    assert spp.dtype == torch.float32 and spp.shape == t.shape and not spp.requires_grad
    assert (spp.double() - _ref(x, temperature)).abs().max() <= TOL
    assert spp[1, 2].item() == pytest.approx(1 / 96, rel=1e-5) and spp[0, 0].item() == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(x, x0)   # the logits are not modified
    lp0, ent0 = vocab_parallel_logprobs(x, t, temperature=temperature, chunk_size=chunk)
    assert torch.equal(lp, lp0) and torch.equal(ent, ent0)


def test_no_tokens_and_gradient_unchanged():
    _, _, spp = vocab_parallel_logprobs(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long),
                                        compute_sum_pi_squared=True)
    assert spp.shape == (0,)
    x, t = _data()
    grads = []
    for flag in (False, True):
        xin = x.clone().requires_grad_()
        out = vocab_parallel_logprobs(xin, t, temperature=0.8, compute_sum_pi_squared=flag)
        (out[0].sum() + 0.5 * out[1].sum()).backward()
        grads.append(xin.grad)
    assert torch.equal(grads[0], grads[1])


def _fused_data(n=(3, 5), hidden=16, vocab=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(4)
    h = (torch.randn(*n, hidden, generator=g) * 2).to(dtype)
    w = torch.randn(vocab, hidden, generator=g).to(dtype)
    return h, w, torch.randint(0, vocab, n, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_vs_torch_softmax(dtype):
    h, w, t = _fused_data(dtype=dtype)
    ref = _ref((h @ w.t()), 0.7)   # the logits in the inputs' dtype, as the fused path computes them
    hin = h.clone().requires_grad_()
    lp, ent, spp = fused_linear_logprobs(hin, w, t, temperature=0.7, chunk_size=4, compute_sum_pi_squared=True)
    assert (spp.double() - ref).abs().max() <= TOL and not spp.requires_grad
    lp.sum().backward()
    h0 = h.clone().requires_grad_()
    lp0, _ = fused_linear_logprobs(h0, w, t, temperature=0.7, chunk_size=4)
    lp0.sum().backward()
    assert torch.equal(lp, lp0) and torch.equal(hin.grad, h0.grad)


def _fused_rank(rank, world, h, w, t):
    import torch.distributed as dist

    vp = w.shape[0] // world
    _, _, spp = fused_linear_logprobs(h, w[rank * vp:(rank + 1) * vp].contiguous(), t, tp_group=dist.group.WORLD,
                                      temperature=0.7, chunk_size=4, compute_sum_pi_squared=True)
    return spp


def test_fused_linear_tensor_parallel():
    h, w, t = _fused_data()
    ref = _ref(h @ w.t(), 0.7)
    for spp in run_ranks(_fused_rank, 2, h, w, t, timeout=120):
        assert (spp.double() - ref).abs().max() <= TOL


def _rank(rank, world, x, t, temperature, chunk):
    import torch.distributed as dist

    vp = x.shape[-1] // world
    shard = x[..., rank * vp:(rank + 1) * vp].contiguous()
    calls, inner = [], dist.all_reduce

    def counting(tensor, *a, **k):
        calls.append(tensor.numel())
        return inner(tensor, *a, **k)

    dist.all_reduce = counting
    try:
        _, _ = vocab_parallel_logprobs(shard, t, tp_group=dist.group.WORLD, temperature=temperature, chunk_size=chunk)
        without = list(calls)
        calls.clear()
        lp, _, spp = vocab_parallel_logprobs(shard, t, tp_group=dist.group.WORLD, temperature=temperature,
                                             chunk_size=chunk, compute_sum_pi_squared=True)
    finally:
        dist.all_reduce = inner
    return spp, lp, without, list(calls)


@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (2, torch.bfloat16), (4, torch.float32)])
def test_tensor_parallel_vs_torch_softmax(world, dtype):
    x, t = _data(vocab=128, dtype=dtype)
    res = run_ranks(_rank, world, x, t, 0.7, 5, timeout=120)
    ref = _ref(x, 0.7)
    lp1, _ = vocab_parallel_logprobs(x, t, temperature=0.7)
    for spp, lp, without, with_spp in res:
        assert (spp.double() - ref).abs().max() <= TOL
        assert (lp - lp1).abs().max() <= 1e-5
        assert with_spp == without + [t.numel()], (without, with_spp)   # one more all-reduce, of [tokens]


def _triton_checks():
    from megatron_rl.logprobs import vocab_parallel_logprobs as f
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, t = _data(n=(2, 5), vocab=80, dtype=dtype)
        for chunk in (None, 3):   # None: the one-pass kernel (statistics finished on the device); 3: partials
            _, _, spp = f(x, t, temperature=0.9, chunk_size=chunk, backend="triton", compute_sum_pi_squared=True)
            out[f"{dtype}-{chunk}"] = float((spp.double() - _ref(x, 0.9)).abs().max())
    return out


def test_triton_kernels_statistics_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, env=env,
                          timeout=200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1][8:])
    assert len(res) == 4 and max(res.values()) <= TOL, res


@pytest.mark.gpu
def test_on_gpu_triton_and_torch():
    """On CUDA (the Triton kernels and the torch path's fewer-passes variant), bf16 logits."""
    x, t = _data(n=(4, 33), vocab=5000, dtype=torch.bfloat16)
    for backend in ("triton", "torch"):
        for chunk in (None, 7):
            _, _, spp = vocab_parallel_logprobs(x.cuda(), t.cuda(), temperature=0.9, chunk_size=chunk,
                                                backend=backend, compute_sum_pi_squared=True)
            assert spp.device.type == "cuda"
            assert (spp.double().cpu() - _ref(x, 0.9)).abs().max() <= TOL, (backend, chunk)


if __name__ == "__main__":
    print("RESULTS " + json.dumps(_triton_checks()))

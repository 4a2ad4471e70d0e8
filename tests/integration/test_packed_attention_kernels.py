"""The packed-attention kernels megatron's local attention runs without Transformer Engine
(``platform.packed_attention``: SDPA per segment, FlexAttention with a document-causal mask).

Kernel level: both kernels against an independent float64 reference (an explicit masked softmax over each
segment alone), for multi-head, grouped-query and a value head dim different from the key's (MLA), with empty
segments; gradients against the reference's (SDPA; with CUDA also compiled FlexAttention). FlexAttention has
no backward on CPU (torch raises): stated, so the claim in the module docstring fails if torch changes. With
CUDA the kernel tests run on the GPU as well.

Model level: a packed micro-batch through megatron's ``GPTModel`` (local spec) with each kernel equals HF
transformers run on each row alone (fp32 logits, atol 1e-4) for Qwen2 (GQA) and DeepSeek-V3 (multi-latent
attention, MoE), and equals megatron's own padded forward of each row (the per-segment path).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_packed_attention_kernels.py -q``
"""
from __future__ import annotations

import math

import pytest
import torch

import megatron.core  # noqa: F401  (imported once in the parent: forked ranks start fast)
from megatron_rl.platform.packed_attention import (PACKED_ATTENTION_KERNELS, flex_document_causal,
                                                   packed_causal_attention, sdpa_per_segment, varlen_causal,
                                                   varlen_eligible, varlen_supported)
from megatron_rl.testing.distributed import run_ranks

#: the kernels run on every device here; with CUDA also on the GPU (flash / memory-efficient SDPA, compiled flex)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ATOL = {"cpu": 2e-6, "cuda": 1e-4}

CU = torch.tensor([0, 5, 6, 6, 15, 19], dtype=torch.int32)  # segments of 5, 1, (empty), 9, 4 tokens

#: the kernels that take fp32 tensors on every device ("varlen" is CUDA bf16 / fp16 only: its own tests)
FP32_KERNELS = sorted(k for k in PACKED_ATTENTION_KERNELS if k != "varlen")


def _reference(q, k, v, cu, scale):
    """Float64: every segment alone, scores = scale * q k^T, future masked to -inf, softmax, times v."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.size(1) // k.size(1)
    out = torch.zeros(q.size(0), q.size(1), v.size(-1), dtype=torch.float64)
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        if b == a:
            continue
        for h in range(q.size(1)):
            s = scale * q[a:b, h] @ k[a:b, h // rep].T
            s = s.masked_fill(torch.triu(torch.ones(b - a, b - a, dtype=torch.bool), 1), -math.inf)
            out[a:b, h] = torch.softmax(s, dim=-1) @ v[a:b, h // rep]
    return out


def _qkv(heads, groups, d, dv, seed=0, grad=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = int(CU[-1])
    return [torch.randn(t, n, dim, generator=g).to(device).requires_grad_(grad)
            for n, dim in ((heads, d), (groups, d), (groups, dv))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", FP32_KERNELS)
@pytest.mark.parametrize("heads,groups,d,dv", [(4, 4, 8, 8), (4, 2, 8, 8), (6, 2, 16, 12)],
                         ids=["mha", "gqa", "v-dim"])
def test_kernel_equals_per_segment_reference(kernel, heads, groups, d, dv, device):
    q, k, v = _qkv(heads, groups, d, dv, device=device)
    scale = 0.7 / math.sqrt(d)
    out = packed_causal_attention(q, k, v, CU.to(device), scale, kernel=kernel)
    q, k, v = (x.cpu() for x in (q, k, v))
    ref = _reference(q, k, v, CU, scale)
    assert out.shape == (int(CU[-1]), heads, dv)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=0, atol=ATOL[device])
    # non-vacuity: one causal sequence over all tokens (segments ignored) is far from the reference
    whole = _reference(q, k, v, torch.tensor([0, int(CU[-1])]), scale)
    assert (whole - ref).abs().max() > 1e-2


@pytest.mark.parametrize("kernel,device", [("sdpa", d) for d in DEVICES] + [("flex", "cuda")] * ("cuda" in DEVICES))
def test_gradients_equal_the_reference(kernel, device):
    q, k, v = _qkv(4, 2, 8, 8, seed=1, grad=True, device=device)
    w = torch.randn(int(CU[-1]), 4, 8, generator=torch.Generator().manual_seed(2))
    (packed_causal_attention(q, k, v, CU.to(device), 0.3, kernel=kernel) * w.to(device)).sum().backward()
    got = [x.grad.cpu() for x in (q, k, v)]
    leaves = [x.detach().cpu().requires_grad_(True) for x in (q, k, v)]
    (_reference(*leaves, CU, 0.3) * w.double()).sum().backward()
    for a, b in zip(got, leaves):
        torch.testing.assert_close(a, b.grad, rtol=0, atol=5e-6 if device == "cpu" else 1e-4)


def test_auto_is_sdpa_where_varlen_cannot_run_and_varlen_refuses_by_name():
    """On CPU (and for fp32, or MLA's unequal head dims, on CUDA) "auto" is exactly the per-segment SDPA path;
    "varlen" asked for there raises naming what it needs."""
    q, k, v = _qkv(4, 2, 8, 8)
    assert not varlen_supported(q, v)
    torch.testing.assert_close(packed_causal_attention(q, k, v, CU, 0.3, kernel="auto"),
                               sdpa_per_segment(q, k, v, CU, 0.3), rtol=0, atol=0)
    with pytest.raises(ValueError, match="'varlen' needs CUDA bf16/fp16"):
        varlen_causal(q, k, v, CU, 0.3)


def test_varlen_eligibility_follows_flash_attention_limits():
    """"auto" takes varlen flash attention only where flash attention runs: CUDA, bf16 / fp16, equal head dims
    that are multiples of 8 up to 256, compute capability 8.0+ (an sm75 T4 or sm70 V100 gets SDPA per segment),
    and a torch that has it."""
    ok = dict(device_type="cuda", dtype=torch.bfloat16, qk_dim=128, v_dim=128, capability=(9, 0), available=True)
    assert varlen_eligible(**ok) and varlen_eligible(**{**ok, "dtype": torch.float16, "capability": (8, 0)})
    for bad in ({"device_type": "cpu", "capability": None}, {"dtype": torch.float32}, {"v_dim": 64},
                {"qk_dim": 512, "v_dim": 512}, {"qk_dim": 100, "v_dim": 100}, {"capability": (7, 5)},
                {"capability": (7, 0)}, {"available": False}):
        assert not varlen_eligible(**{**ok, **bad}), bad


@pytest.mark.gpu
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_varlen_on_cuda_bf16_equals_the_reference_with_gradients(heads, groups):
    """torch's varlen flash attention (one call over cu_seqlens): output and gradients against the float64
    per-segment reference at bf16 tolerance; "auto" picks it for CUDA bf16."""
    q, k, v = (x.to("cuda", torch.bfloat16).requires_grad_(True) for x in _qkv(heads, groups, 64, 64, seed=3))
    assert varlen_supported(q, v)
    w = torch.randn(int(CU[-1]), heads, 64, generator=torch.Generator().manual_seed(4))
    out = packed_causal_attention(q, k, v, CU.cuda(), 0.125, kernel="auto")
    (out.float() * w.cuda()).sum().backward()
    leaves = [x.detach().double().cpu().requires_grad_(True) for x in (q, k, v)]
    ref = _reference(*leaves, CU, 0.125)
    (ref * w.double()).sum().backward()
    torch.testing.assert_close(out.double().cpu(), ref, rtol=0, atol=2e-2)
    for a, b in zip((q, k, v), leaves):
        torch.testing.assert_close(a.grad.double().cpu(), b.grad, rtol=0, atol=5e-2 * max(1.0, b.grad.abs().max()))
    whole = _reference(*[x.detach() for x in leaves], torch.tensor([0, int(CU[-1])]), 0.125)
    assert (whole - ref).abs().max() > 5e-2  # segments matter at this tolerance


def test_flex_has_no_backward_on_cpu():
    q, k, v = _qkv(4, 4, 8, 8, grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_document_causal(q, k, v, CU, 0.3)


def test_bad_inputs_are_named():
    q, k, v = _qkv(4, 2, 8, 8)
    with pytest.raises(ValueError, match="not one of"):
        packed_causal_attention(q, k, v, CU, 0.3, kernel="flash")
    with pytest.raises(ValueError, match=r"q \[t, heads, d\]"):
        sdpa_per_segment(q[:, :3], k, v, CU, 0.3)  # 3 heads over 2 groups
    with pytest.raises(ValueError, match="cu_seqlens"):
        sdpa_per_segment(q, k, v, torch.tensor([0, 4]), 0.3)


# ----------------------------------------------------------------------------- model level, against HF per row

ROWS = (7, 3, 11, 5)


def _rank_packed_vs_hf(rank, world, hf_dir, kernels):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.convert.live import load_checkpoint_into_model
    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import ParallelConfig, initialize_model_parallel
    from megatron_rl.parallel.groups import ActorGroups
    from megatron_rl.platform.local_layers import set_packed_attention_kernel
    from megatron_rl.testing.actor_reference import hf_model_config, load_hf_reference

    mcfg = hf_model_config(hf_dir)
    pcfg = ParallelConfig()
    initialize_model_parallel(pcfg, seed=3, model=mcfg)
    chunks = build_gpt_model(mcfg, pcfg)
    load_checkpoint_into_model(chunks, hf_dir, mcfg, ActorGroups.from_parallel_state(sequence_parallel=False))
    model = chunks[0].eval()
    hf = load_hf_reference(hf_dir).eval()
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, vocab, (n,), generator=g) for n in ROWS]
    cu = torch.tensor([0] + torch.tensor(ROWS).cumsum(0).tolist(), dtype=torch.int32)
    tokens = torch.cat(rows).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in ROWS]).unsqueeze(0)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(ROWS),
                             max_seqlen_kv=max(ROWS))
    out = {"packed": {}, "hf": [], "mcore_rows": []}
    with torch.no_grad():
        for kernel in kernels:
            set_packed_attention_kernel(kernel)
            out["packed"][kernel] = model(tokens, positions, attention_mask=None,
                                          packed_seq_params=params)[0, :, :vocab]
        for r in rows:
            out["hf"].append(hf(input_ids=r.unsqueeze(0)).logits[0])
            out["mcore_rows"].append(model(r.unsqueeze(0), torch.arange(len(r)).unsqueeze(0),
                                           attention_mask=None)[0, :, :vocab])
    out["cu"] = cu.tolist()
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the model-level check runs megatron on CPU ranks (gloo)")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["qwen2", "deepseek_v3"])
def test_packed_kernels_equal_hf_per_row(tiny_hf_model, arch):
    hf_dir = tiny_hf_model(arch, seed=11)
    kernels = FP32_KERNELS
    (out,) = run_ranks(_rank_packed_vs_hf, 1, hf_dir, kernels, timeout=280)
    cu = out["cu"]
    for kernel in kernels:
        for i, (a, b) in enumerate(zip(cu, cu[1:])):
            got = out["packed"][kernel][a:b]
            torch.testing.assert_close(got, out["hf"][i], rtol=0, atol=1e-4, msg=f"{kernel} row {i} vs HF")
            torch.testing.assert_close(got, out["mcore_rows"][i], rtol=0, atol=1e-5,
                                       msg=f"{kernel} row {i} vs megatron's padded path")
    assert out["hf"][2].std() > 0.1  # non-trivial logits

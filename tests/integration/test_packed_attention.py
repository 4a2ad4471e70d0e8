"""Packed (THD) sequences through megatron's local attention on CPU (``platform.local_layers``'s
``DotProductAttention.forward`` patch, default SDPA kernel) against each row run alone through the same megatron ``GPTModel``.

A packed micro-batch is one sequence ``[1, t]``: the rows concatenated (each optionally padded to a multiple
of ``align``) plus a trailing padding segment, passed with ``PackedSeqParams(qkv_format="thd", ...)``. The
independent reference is megatron's ordinary (unpacked, causal) forward of each row alone ``[1, len_i]``:
fp32 logits must agree at every real position (atol 1e-5), for MHA, GQA, a small MoE and multi-latent
attention with YaRN RoPE (0.19 pads MLA's THD values to the query head dim), at TP1 and at TP2 with sequence
parallelism (2 gloo ranks). RoPE positions restarting at each segment is checked directly: the
post-RoPE query/key that megatron hands to core attention in layer 0 for a packed row equals the one of
the row run alone (a position offset would rotate it). Non-vacuity: the same tokens as one plain causal
sequence (no segments) differ from the per-row logits by far more than the tolerance, and changing row 0's
tokens changes row 0's logits but not (bit for bit up to 1e-6) any other row's.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_packed_attention.py -q``
"""
import copy

import pytest
import torch

from megatron_rl.platform.select import apply_cpu_patches
from megatron_rl.platform.packed_attention import packed_segments

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU attention patch is inactive with CUDA")

apply_cpu_patches()

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402

from megatron_rl.models import ModelConfig, build_gpt_model  # noqa: E402
from megatron_rl.parallel import ParallelConfig, initialize_model_parallel  # noqa: E402
from megatron_rl.testing.distributed import run_ranks  # noqa: E402

ROW_LENGTHS = (5, 1, 9, 3)
VOCAB = 64
ATOL = 1e-5

DENSE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, ffn_hidden_size=48,
                    max_position_embeddings=64, init_method_std=0.2)
GQA = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                  ffn_hidden_size=48, max_position_embeddings=64, init_method_std=0.2, add_qkv_bias=True)
MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                  ffn_hidden_size=48, max_position_embeddings=64, init_method_std=0.2, qk_layernorm=True,
                  kv_channels=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
MLA = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, ffn_hidden_size=48,
                  max_position_embeddings=64, init_method_std=0.2, multi_latent_attention=True, q_lora_rank=24,
                  kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, rope_type="yarn",
                  rotary_scaling_factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0)


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in ROW_LENGTHS]


def _pad_to(n, multiple):
    return -(-n // multiple) * multiple


def _pack(rows, align, total_align, pad_id=0):
    """(tokens [1, t], position_ids [1, t], PackedSeqParams, starts): each row padded to a multiple of ``align``,
    then a trailing padding segment up to a multiple of ``total_align``."""
    real, padded = [len(r) for r in rows], [_pad_to(len(r), align) for r in rows]
    tail = _pad_to(sum(padded), total_align) - sum(padded)
    real, padded = real + [0], padded + [tail]
    cu = torch.tensor([0] + torch.tensor(real).cumsum(0).tolist(), dtype=torch.int32)
    cu_pad = torch.tensor([0] + torch.tensor(padded).cumsum(0).tolist(), dtype=torch.int32)
    tokens = torch.full((int(cu_pad[-1]),), pad_id, dtype=torch.long)
    positions = torch.zeros_like(tokens)
    for i, r in enumerate(rows):
        tokens[cu_pad[i]:cu_pad[i] + len(r)] = r
    for i, n in enumerate(padded):
        positions[cu_pad[i]:cu_pad[i] + n] = torch.arange(n)
    m = max(padded)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                             cu_seqlens_kv_padded=cu_pad, max_seqlen_q=m, max_seqlen_kv=m)
    return tokens.unsqueeze(0), positions.unsqueeze(0), params, cu_pad[:-1].tolist()


def _capture_qk(model):
    """Forward pre-hook on layer 0's core attention: records the (post-RoPE) query and key it receives."""
    seen = {}

    def hook(module, args, kwargs):
        seen["q"], seen["k"] = args[0].detach().clone(), args[1].detach().clone()

    model.decoder.layers[0].self_attention.core_attention.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _rank_forwards(rank, world, mc, pc, rows, align, total_align):
    """Packed, per-row, plain-causal and row-0-perturbed forwards of this rank's GPTModel (logits are this rank's
    vocab shard)."""
    initialize_model_parallel(pc, seed=7, model=mc)
    (model,) = build_gpt_model(mc, pc)
    model.eval()
    seen = _capture_qk(model)
    tp = pc.tensor_model_parallel_size
    out = {"rows": [], "q_rows": [], "k_rows": []}
    with torch.no_grad():
        tokens, positions, params, starts = _pack(rows, align, total_align)
        out["packed"] = model(tokens, positions, attention_mask=None, packed_seq_params=params)[0]
        out["q_packed"], out["k_packed"], out["starts"] = seen["q"], seen["k"], starts
        for r in rows:  # each row alone, padded at its end to a multiple of TP (sequence parallel needs it)
            ids = torch.zeros(1, _pad_to(len(r), tp), dtype=torch.long)
            ids[0, :len(r)] = r
            pos = torch.arange(ids.shape[1]).unsqueeze(0)
            out["rows"].append(model(ids, pos, attention_mask=None)[0, :len(r)])
            out["q_rows"].append(seen["q"][:len(r), 0])
            out["k_rows"].append(seen["k"][:len(r), 0])
        out["plain"] = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), attention_mask=None)[0]
        changed = [(rows[0] + 1 + torch.arange(len(rows[0]))) % VOCAB] + list(rows[1:])
        tokens2, positions2, params2, _ = _pack(changed, align, total_align)
        out["perturbed"] = model(tokens2, positions2, attention_mask=None, packed_seq_params=params2)[0]
    return out


def _check(out, rows):
    starts = out["starts"]
    gap = 0.0
    for i, r in enumerate(rows):
        sl = slice(starts[i], starts[i] + len(r))
        torch.testing.assert_close(out["packed"][sl], out["rows"][i], rtol=0, atol=ATOL)
        # RoPE restarts per segment: layer 0's post-RoPE q / k of the packed row == those of the row alone
        torch.testing.assert_close(out["q_packed"][sl], out["q_rows"][i], rtol=0, atol=ATOL)
        torch.testing.assert_close(out["k_packed"][sl], out["k_rows"][i], rtol=0, atol=ATOL)
        if i > 0:
            gap = max(gap, (out["plain"][sl] - out["rows"][i]).abs().max().item())
            torch.testing.assert_close(out["perturbed"][sl], out["packed"][sl], rtol=0, atol=1e-6)
    assert out["rows"][2].std() > 0.3  # non-trivial logits
    assert gap > 100 * ATOL, f"plain causal forward is as close as packed ({gap:.2e}): the test is vacuous"
    sl0 = slice(starts[0], starts[0] + len(rows[0]))
    assert (out["perturbed"][sl0] - out["packed"][sl0]).abs().max() > 100 * ATOL


# ----------------------------------------------------------------------------- segments


def test_packed_segments_are_the_non_empty_spans_of_cu_seqlens():
    cu = torch.tensor([0, 3, 4, 4, 8], dtype=torch.int32)
    assert packed_segments(cu, 8) == [(0, 3), (3, 4), (4, 8)]  # the empty segment [4, 4) is skipped
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_segments(cu, 9)
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_segments(torch.tensor([0, 5, 3, 8]), 8)


# ----------------------------------------------------------------------------- packed vs per row


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mc,align,total_align",
                         [(DENSE, 1, 8), (DENSE, 4, 8), (GQA, 1, 8), (MOE, 2, 8), (MLA, 1, 8)],
                         ids=["dense", "dense-rows-padded", "gqa", "moe", "mla-yarn"])
def test_packed_forward_matches_each_row_alone(mc, align, total_align):
    rows = _rows()
    (out,) = run_ranks(_rank_forwards, 1, mc, ParallelConfig(), rows, align, total_align, timeout=150)
    assert out["packed"].shape[0] == _pad_to(sum(_pad_to(n, align) for n in ROW_LENGTHS), total_align)
    _check(out, rows)


@pytest.mark.timeout(240)
def test_packed_forward_tp2_sequence_parallel():
    rows = _rows(seed=1)
    pc = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    for out in run_ranks(_rank_forwards, 2, GQA, pc, rows, 1, 4, timeout=200):
        assert out["packed"].shape[-1] == VOCAB // 2  # this rank's vocab shard
        _check(out, rows)


# ----------------------------------------------------------------------------- refusals


def _rank_refusals(rank, world, mc):
    from megatron.core.transformer.enums import AttnMaskType

    initialize_model_parallel(ParallelConfig(), seed=7, model=mc)
    (model,) = build_gpt_model(mc, ParallelConfig())
    attn = model.decoder.layers[0].self_attention.core_attention
    q = torch.randn(6, mc.num_attention_heads, mc.hidden_size // mc.num_attention_heads)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
    errors = []
    cp2 = copy.copy(attn.config)
    cp2.context_parallel_size = 2
    for change in ("cp", "format", "mask_type"):
        a = copy.copy(attn)
        p = copy.copy(params)
        kw = {}
        if change == "cp":
            a.config = cp2
        elif change == "format":
            p.qkv_format = "sbhd"
        else:
            kw["attn_mask_type"] = AttnMaskType.no_mask
        try:
            a(q, q, q, None, packed_seq_params=p, **kw)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_packed_refusals_are_clear():
    (errors,) = run_ranks(_rank_refusals, 1, DENSE, timeout=60)
    assert "context_parallel_size=1" in errors[0]
    assert "'thd'" in errors[1]
    assert "causal" in errors[2]

"""LoRA merge (``lora.merge``) and the adapters' TP layout (``convert.partition.param_kind``): the merged shard
equals a single-process fp32 reference W + (alpha/r)·B·A cast once, bit for bit, and shard-local merges of TP
shards are the shards of the full merge."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.convert.partition import merge_tensors, param_kind, split_tensor
from megatron_rl.lora.merge import adapted_modules, adapter_items, lora_scale, merged_items, merged_weight

P = "decoder.layers.0.self_attention.linear_qkv"


def _adapter(out, inn, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inn, generator=g).bfloat16(), torch.randn(r, inn, generator=g),
            torch.randn(out, r, generator=g))


def _reference(w, a, b, scale):
    """Single process, fp32: W + scale * sum_k B[:, k] A[k, :] (k in order), then one cast to W's dtype."""
    delta = torch.zeros(w.shape, dtype=torch.float32)
    for k in range(a.shape[0]):
        delta = delta + torch.outer(b[:, k].float(), a[k].float())
    return (w.float() + scale * delta).to(w.dtype)


def test_merged_equals_fp32_reference_cast_once():
    w, a, b = _adapter(24, 16, 4)
    ref = _reference(w, a, b, 8 / 4)
    exact = (w.double() + 2.0 * (b.double() @ a.double())).to(torch.bfloat16)  # the formula itself
    assert (ref.float() - exact.float()).abs().max() <= 2 ** -7 * exact.float().abs().max()
    sd = {P + ".weight": w, P + ".lora_A.weight": a, P + ".lora_B.weight": b, "x.bias": torch.ones(3)}
    out = dict(merged_items(sd, lora_scale(4, 8), torch.bfloat16))
    assert set(out) == {P + ".weight", "x.bias"}
    assert out[P + ".weight"].dtype == torch.bfloat16 and torch.equal(out[P + ".weight"], ref)
    assert out["x.bias"] is sd["x.bias"]
    fp32 = dict(merged_items(sd, 2.0))[P + ".weight"]
    assert fp32.dtype == torch.float32 and torch.equal(fp32.to(torch.bfloat16), ref)
    # a bf16 product (the cast before the merge) differs: the check above can fail
    wrong = (w + 2.0 * (b.bfloat16() @ a.bfloat16()))
    assert not torch.equal(wrong, ref)


@pytest.mark.parametrize("base,tp", [("self_attention.linear_qkv", 2), ("mlp.linear_fc1", 2),
                                     ("self_attention.linear_proj", 2), ("mlp.linear_fc2", 4),
                                     ("mlp.experts.local_experts.1.linear_fc1", 2),
                                     ("mlp.shared_experts.linear_fc2", 2)])
def test_shard_local_merge_is_the_shard_of_the_full_merge(base, tp):
    w, a, b = _adapter(32, 16, 4, seed=tp)
    w = w.float()
    full = merged_weight(w, a, b, 0.5)
    kind = param_kind(base + ".weight")
    ka, kb = param_kind(base + ".lora_A.weight"), param_kind(base + ".lora_B.weight")
    column = kind in ("column", "glu_column", "expert_glu_column")
    assert (ka == "replicated") == column and (kb == "replicated") == (not column)
    shards = [merged_weight(split_tensor(w, kind, r, tp, "w"), split_tensor(a, ka, r, tp, "a"),
                            split_tensor(b, kb, r, tp, "b"), 0.5) for r in range(tp)]
    assert torch.equal(merge_tensors(shards, kind, "w"), full)


def test_errors_name_the_tensor():
    w, a, b = _adapter(8, 6, 2)
    with pytest.raises(ValueError, match="lora_A .* lora_B .*do not fit"):
        merged_weight(w, a, b.t(), 1.0, "x.weight")
    with pytest.raises(ValueError, match=r"'m\.lora_A\.weight' has no 'm\.lora_B\.weight'"):
        adapted_modules(["m.weight", "m.lora_A.weight"])
    with pytest.raises(ValueError, match="no 'm.weight' to merge"):
        list(merged_items({"m.lora_A.weight": a, "m.lora_B.weight": b}, 1.0))
    with pytest.raises(ValueError, match="actor.lora.rank"):
        lora_scale(0, 16)
    sd = {"m.weight": w, "m.lora_A.weight": a, "m.lora_B.weight": b}
    assert [n for n, _ in adapter_items(sd)] == ["m.lora_A.weight", "m.lora_B.weight"]

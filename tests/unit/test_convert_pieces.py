"""``convert.pieces``: a Megatron tensor left in TP / ETP pieces (or whole), mapped to HF without copies, equals
``mapping.hf_tensors`` of the tensor merged by ``partition.merge_tensors`` -- for every tensor of a dense and a MoE
model (fused qkv with bias, GLU, row splits, the padded vocab), 1, 2 and 4 pieces; written into a bf16 destination
(the engine's cast) it equals the reference cast."""
import pytest
import torch

from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.mapping import hf_tensors, param_rules
from megatron_rl.convert.partition import expert_index, merge_tensors, param_kind, split_layer_name, split_tensor
from megatron_rl.convert.pieces import FENCE, Pieces, from_parts, hf_pieces, materialize
from megatron_rl.convert.tiny_hf import tiny_config

pytest.importorskip("transformers")

VOCAB, PADDED = 100, 104  # the live model's vocab is padded (a multiple of the TP size)


def _geometry(arch):
    extra = {"num_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False} if arch == "qwen3_moe" else {}
    cfg = tiny_config(arch, VOCAB, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, **extra)
    return HFGeometry.from_hf_config(cfg.to_dict())


def _kind(name):
    layer = split_layer_name(name)
    return param_kind(name if layer is None else layer[1])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_pieces_map_to_the_hf_tensors_of_the_merged_tensor(arch, size):
    g = _geometry(arch)
    gen = torch.Generator().manual_seed(size)
    seen = set()
    for rule in param_rules(g):
        vocab = rule.mcore_name in ("embedding.word_embeddings.weight", "output_layer.weight")
        shape = (PADDED,) + tuple(rule.mcore_shape[1:]) if vocab else tuple(rule.mcore_shape)
        full = torch.randn(shape, generator=gen)
        kind = _kind(rule.mcore_name)
        ref = dict(hf_tensors(rule, full[:VOCAB] if vocab else full, g))
        if kind == "replicated" or size == 1:
            t = full
        else:
            parts = [split_tensor(full, kind, r, size, rule.mcore_name) for r in range(size)]
            assert torch.equal(merge_tensors(parts, kind, rule.mcore_name), full)
            t = from_parts(parts, kind, full.shape, full.dtype)
            seen.add(kind)
        got = dict(hf_pieces(rule, t, g, VOCAB if vocab else None))
        assert list(got) == list(ref), rule.mcore_name
        for name, r in ref.items():
            assert torch.equal(materialize(got[name]), r), name
            if isinstance(got[name], Pieces):  # the engine's path: copied (and cast) straight into its weight
                dst = torch.empty(r.shape, dtype=torch.bfloat16)
                assert torch.equal(got[name].copy_into(dst), r.to(torch.bfloat16)), name
    if size > 1:
        want = {"vocab", "column", "row"} | ({"expert_glu_column", "expert_row"} if arch == "qwen3_moe"
                                             else {"glu_column"})
        assert want <= seen, seen


def test_a_fused_qkv_is_left_as_strided_views_of_the_parameter():
    g = _geometry("qwen2")
    rule = next(r for r in param_rules(g) if r.combine == "qkv")
    full = torch.randn(rule.mcore_shape)
    for _, t in hf_pieces(rule, full, g):
        assert isinstance(t, Pieces) and all(src.data_ptr() >= full.data_ptr() and
                                             src.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
                                             for src, _, _ in t.blocks)
    assert FENCE not in {r.mcore_name for r in param_rules(g)}
    with pytest.raises(ValueError, match="destination shape"):
        next(iter(hf_pieces(rule, full, g)))[1].copy_into(torch.empty(3))
    assert expert_index("mlp.router.weight") is None

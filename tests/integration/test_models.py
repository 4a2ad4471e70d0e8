"""Model config, HF config mapping, builder checks, and the built GPTModel against HF transformers.

The strongest check: for Llama, Qwen2 (QKV bias, tied) and Qwen3-MoE (qk-norm, experts, both router
normalisations) a HF model with random weights (norm weights too) is mapped weight-by-weight (the
test's own mapping) into the megatron model built from ``model_config_from_hf(config.json)``; fp32
logits must match HF's. This proves the architecture choices (RMSNorm, SwiGLU, RoPE, GQA, router
semantics, qk-norm) and the config mapping independently of the project's converter.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_models.py -q``
"""
import dataclasses

import pytest
import torch

from megatron_rl.platform.select import apply_cpu_patches

apply_cpu_patches()

from megatron_rl.models import ModelConfig, ModelConfigError, build_gpt_model, model_config_from_dict  # noqa: E402
from megatron_rl.convert.checks import UnsupportedCheckpointError  # noqa: E402
from megatron_rl.convert.hf_config import megatron_to_hf_config, model_config_from_hf  # noqa: E402
from megatron_rl.convert.partition import RankCoords, cut_state_dict, merge_state_dicts, param_kind  # noqa: E402
from megatron_rl.parallel import ParallelConfig, destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megatron_rl.testing.distributed import run_ranks  # noqa: E402

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, rms_norm_eps=1e-6)


def _hf_model(model_type, **over):
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}[model_type]
    kw = dict(TINY, **over)
    if model_type == "qwen3_moe":
        kw = dict(dict(head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       mlp_only_layers=[0]), **kw)
    cfg = cls[0](**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls[1](cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return cfg.to_dict(), model


def _hf_to_megatron(hf_sd, cfg):
    """Test-local reference mapping (HF names -> megatron TP1 names), per megatron's documented layout."""
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    qpg = heads // groups
    out = {"embedding.word_embeddings.weight": hf_sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_sd["model.norm.weight"]}
    if not cfg.get("tie_word_embeddings"):
        out["output_layer.weight"] = hf_sd["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf_sd[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf_sd[h + "post_attention_layernorm.weight"]
        for suffix in ("weight", "bias"):
            q = hf_sd.get(h + f"self_attn.q_proj.{suffix}")
            if q is None:
                continue
            k, v = hf_sd[h + f"self_attn.k_proj.{suffix}"], hf_sd[h + f"self_attn.v_proj.{suffix}"]
            parts = []
            for gi in range(groups):
                parts += [q[gi * qpg * d:(gi + 1) * qpg * d], k[gi * d:(gi + 1) * d], v[gi * d:(gi + 1) * d]]
            out[m + f"self_attention.linear_qkv.{suffix}"] = torch.cat(parts, 0)
        out[m + "self_attention.linear_proj.weight"] = hf_sd[h + "self_attn.o_proj.weight"]
        if h + "self_attn.q_norm.weight" in hf_sd:
            out[m + "self_attention.q_layernorm.weight"] = hf_sd[h + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf_sd[h + "self_attn.k_norm.weight"]
        if h + "mlp.gate.weight" in hf_sd:
            out[m + "mlp.router.weight"] = hf_sd[h + "mlp.gate.weight"]
            gate_up, down = hf_sd[h + "mlp.experts.gate_up_proj"], hf_sd[h + "mlp.experts.down_proj"]
            for e in range(gate_up.shape[0]):
                out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
                out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([hf_sd[h + "mlp.gate_proj.weight"],
                                                          hf_sd[h + "mlp.up_proj.weight"]], 0)
            out[m + "mlp.linear_fc2.weight"] = hf_sd[h + "mlp.down_proj.weight"]
    return {k: v.detach().clone() for k, v in out.items()}


def _megatron_logits(rank, world, mc, full, ids):
    initialize_model_parallel(ParallelConfig(), seed=3, model=mc)
    (model,) = build_gpt_model(mc, ParallelConfig())
    own = model.state_dict()
    missing = sorted(set(k for k in own if not k.endswith("_extra_state")) - set(full))
    assert not missing and not set(full) - set(own), (missing, sorted(set(full) - set(own)))
    model.load_state_dict(full, strict=False)
    model.eval()
    with torch.no_grad():
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        out = model(ids, pos, attention_mask=None)
    destroy_model_parallel()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_type,over", [
    ("llama", dict(tie_word_embeddings=False, rope_theta=500000.0)),
    ("qwen2", dict(tie_word_embeddings=True)),
    ("qwen3_moe", dict(norm_topk_prob=True)),
    ("qwen3_moe", dict(norm_topk_prob=False, tie_word_embeddings=True)),
])
def test_megatron_model_matches_hf_transformers(model_type, over):
    cfg, hf = _hf_model(model_type, **over)
    mc = model_config_from_hf(cfg)
    full = _hf_to_megatron(hf.state_dict(), cfg)
    ids = torch.randint(0, cfg["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits
    (got,) = run_ranks(_megatron_logits, 1, mc, full, ids, timeout=90)
    assert got.shape == ref.shape
    assert ref.std() > 0.5  # non-trivial logits
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)


# ----------------------------------------------------------------------------- HF config mapping


def test_hf_mapping_fields():
    cfg, _ = _hf_model("qwen3_moe", norm_topk_prob=True, mlp_only_layers=[0], rope_theta=1e6)
    mc = model_config_from_hf(cfg, padded_vocab_size=128)
    assert (mc.num_layers, mc.hidden_size, mc.num_attention_heads, mc.num_query_groups, mc.kv_channels) == \
        (2, 32, 4, 2, 8)
    assert (mc.vocab_size, mc.num_moe_experts, mc.moe_router_topk, mc.moe_ffn_hidden_size) == (128, 4, 2, 16)
    assert mc.moe_router_pre_softmax is False and mc.qk_layernorm and not mc.add_qkv_bias
    assert mc.moe_layer_pattern() == [0, 1] and mc.rotary_base == 1e6
    q2, _ = _hf_model("qwen2", tie_word_embeddings=True)
    m2 = model_config_from_hf(q2)
    assert m2.add_qkv_bias and not m2.untie_embeddings_and_output_weights and not m2.is_moe


@pytest.mark.parametrize("model_type,over", [("llama", {}), ("qwen2", dict(tie_word_embeddings=True)),
                                             ("qwen3_moe", dict(norm_topk_prob=True))])
def test_hf_config_round_trip_loads_in_transformers(model_type, over):
    cfg, _ = _hf_model(model_type, **over)
    mc = model_config_from_hf(cfg)
    back = megatron_to_hf_config(mc, model_type)
    assert model_config_from_hf(back) == mc
    reloaded = transformers.AutoConfig.for_model(**back)
    assert reloaded.num_hidden_layers == cfg["num_hidden_layers"]


@pytest.mark.parametrize("change,key", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_type"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
])
def test_hf_mapping_refuses_unsupported(change, key):
    cfg, _ = _hf_model("llama")
    cfg.update(change)
    cfg.pop("rope_parameters", None) if "rope_scaling" in change else None
    with pytest.raises(UnsupportedCheckpointError, match=key):
        model_config_from_hf(cfg)


def test_hf_mapping_refuses_small_padded_vocab():
    cfg, _ = _hf_model("qwen2")
    with pytest.raises(UnsupportedCheckpointError, match="padded_vocab_size"):
        model_config_from_hf(cfg, padded_vocab_size=10)


# ----------------------------------------------------------------------------- ModelConfig


def test_model_config_validation_lists_every_problem():
    mc = ModelConfig(num_layers=2, hidden_size=30, num_attention_heads=4, num_query_groups=3, vocab_size=10,
                     num_moe_experts=2, moe_router_topk=3, moe_router_score_function="relu")
    with pytest.raises(ModelConfigError) as e:
        mc.validate()
    msg = str(e.value)
    for needle in ("num_query_groups=3", "hidden_size=30", "moe_router_topk=3", "moe_router_score_function"):
        assert needle in msg


def test_model_config_from_dict_errors_and_pattern():
    with pytest.raises(ModelConfigError, match="num_layer"):
        model_config_from_dict(dict(num_layer=2, hidden_size=8, num_attention_heads=2, vocab_size=8))
    with pytest.raises(ModelConfigError, match="missing"):
        model_config_from_dict(dict(hidden_size=8, num_attention_heads=2, vocab_size=8))
    mc = model_config_from_dict(dict(num_layers=6, hidden_size=8, num_attention_heads=2, vocab_size=8,
                                     num_moe_experts=4, moe_layer_freq=2, first_k_dense_replace=1))
    assert mc.moe_layer_pattern() == [0, 0, 1, 0, 1, 0]


# ----------------------------------------------------------------------------- sharding helpers


def shard_state_dict(full, mc, coords):
    return cut_state_dict(full, coords, mc.num_layers, not mc.untie_embeddings_and_output_weights,
                          mc.num_moe_experts or 0)


def unshard_state_dicts(shards, mc, pc):
    return merge_state_dicts(shards, mc.num_layers, not mc.untie_embeddings_and_output_weights,
                             pc.tensor_model_parallel_size, pc.etp, mc.num_moe_experts or 0)


def test_param_kind_rules_and_unknown_name():
    assert param_kind("self_attention.linear_qkv.weight") == "column"
    assert param_kind("mlp.linear_fc1.weight") == "glu_column"
    assert param_kind("mlp.experts.local_experts.3.linear_fc2.weight") == "expert_row"
    assert param_kind("mlp.experts.linear_fc1.weight7") == "expert_glu_column"
    assert param_kind("self_attention.linear_qkv.layer_norm_weight") == "replicated"
    with pytest.raises(KeyError, match="mystery"):
        param_kind("mystery.weight")


def test_shard_unshard_round_trip_is_exact():
    mc = ModelConfig(num_layers=4, hidden_size=8, num_attention_heads=4, num_query_groups=2, vocab_size=16,
                     ffn_hidden_size=12, num_moe_experts=4, moe_ffn_hidden_size=6, moe_layer_freq=[0, 1, 1, 0],
                     untie_embeddings_and_output_weights=False)
    g = torch.Generator().manual_seed(0)
    full = {"embedding.word_embeddings.weight": torch.randn(16, 8, generator=g),
            "decoder.final_layernorm.weight": torch.randn(8, generator=g)}
    for i in range(4):
        p = f"decoder.layers.{i}."
        full[p + "input_layernorm.weight"] = torch.randn(8, generator=g)
        full[p + "self_attention.linear_qkv.weight"] = torch.randn(16, 8, generator=g)
        full[p + "self_attention.linear_proj.weight"] = torch.randn(8, 8, generator=g)
        if mc.moe_layer_pattern()[i]:
            full[p + "mlp.router.weight"] = torch.randn(4, 8, generator=g)
            for e in range(4):
                full[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.randn(12, 8, generator=g)
                full[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = torch.randn(8, 6, generator=g)
        else:
            full[p + "mlp.linear_fc1.weight"] = torch.randn(24, 8, generator=g)
            full[p + "mlp.linear_fc2.weight"] = torch.randn(8, 12, generator=g)
    pc = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                        expert_tensor_parallel_size=2, sequence_parallel=True)
    shards = {}
    for tp in range(2):
        for pp in range(2):
            for ep in range(2):
                c = RankCoords(tp_rank=tp, tp_size=2, pp_rank=pp, pp_size=2, ep_rank=ep, ep_size=2,
                               etp_rank=tp, etp_size=2)
                shards[c] = shard_state_dict(full, mc, c)
    last = shards[RankCoords(0, 2, 1, 2, 0, 2, 0, 2)]
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last  # tied copy
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight" in last  # layer 2, expert 1
    # gated fc1 shard = [gate block; up block], not a contiguous block of the full matrix
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    tp1 = shards[RankCoords(1, 2, 0, 2, 0, 2, 1, 2)]["decoder.layers.0.mlp.linear_fc1.weight"]
    torch.testing.assert_close(tp1, torch.cat([fc1[6:12], fc1[18:24]]))
    back = unshard_state_dicts(shards, mc, pc)
    assert sorted(back) == sorted(full)
    for k in full:
        assert torch.equal(back[k], full[k]), k
    bad = dict(shards)
    c0 = RankCoords(0, 2, 0, 2, 0, 2, 0, 2)
    bad[c0] = dict(bad[c0])
    bad[c0]["decoder.layers.0.input_layernorm.weight"] = bad[c0]["decoder.layers.0.input_layernorm.weight"] + 1
    with pytest.raises(ValueError, match="input_layernorm"):
        unshard_state_dicts(bad, mc, pc)


def _build_error(mc, pc):
    """The ValueError message ``build_gpt_model`` raises (None if it builds); the model-parallel state is torn
    down either way."""
    try:
        build_gpt_model(mc, pc)
    except ValueError as e:
        return str(e)
    finally:
        destroy_model_parallel()


def _mismatch_body(rank, world):
    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=2))
    mc = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=16)
    return _build_error(mc, ParallelConfig())


@pytest.mark.timeout(60)
def test_builder_rejects_config_that_disagrees_with_parallel_state():
    for msg in run_ranks(_mismatch_body, 2, timeout=45):
        assert "tensor_model_parallel_size: config 1 vs initialised 2" in msg


def _vpp_body(rank, world):
    pc = ParallelConfig(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    mc = ModelConfig(num_layers=8, hidden_size=16, num_attention_heads=2, vocab_size=16, ffn_hidden_size=32)
    initialize_model_parallel(pc, model=mc)
    chunks = build_gpt_model(mc, pc)
    out = [(c.pre_process, c.post_process, len(c.decoder.layers), c.config.variable_seq_lengths) for c in chunks]
    destroy_model_parallel()
    return out


@pytest.mark.timeout(60)
def test_vpp_builds_one_chunk_per_virtual_stage_with_stage_flags():
    res = run_ranks(_vpp_body, 4, timeout=45)
    assert res[0] == [(True, False, 1, False), (False, False, 1, False)]
    assert res[3] == [(False, False, 1, False), (False, True, 1, False)]
    assert res[1] == res[2] == [(False, False, 1, False)] * 2


def test_transformer_config_choices():
    from megatron_rl.models import make_transformer_config

    mc = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=16, num_moe_experts=2,
                     moe_ffn_hidden_size=8, add_qkv_bias=True)
    t = make_transformer_config(mc, ParallelConfig())
    assert t.params_dtype == torch.float32 and t.gated_linear_unit and t.normalization == "RMSNorm"
    assert t.add_qkv_bias and not t.add_bias_linear and t.variable_seq_lengths
    assert t.moe_token_dispatcher_type == "alltoall" and t.hidden_dropout == 0 and t.attention_dropout == 0
    t2 = make_transformer_config(dataclasses.replace(mc, moe_token_dispatcher_type="allgather"), ParallelConfig())
    assert t2.variable_seq_lengths is False


def test_te_and_grouped_gemm_names_are_canonicalised():
    from megatron_rl.convert.model_state import canonical_name

    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    assert canonical_name("decoder.layers.1.mlp.experts.linear_fc2.weight12") == \
        "decoder.layers.1.mlp.experts.local_experts.12.linear_fc2.weight"
    assert canonical_name("decoder.layers.1.mlp.linear_fc1.weight") == "decoder.layers.1.mlp.linear_fc1.weight"
    mc = ModelConfig(num_layers=1, hidden_size=4, num_attention_heads=2, vocab_size=8, ffn_hidden_size=4,
                     num_moe_experts=2, moe_ffn_hidden_size=2)
    g = torch.Generator().manual_seed(0)
    te = {"embedding.word_embeddings.weight": torch.randn(8, 4, generator=g),
          "output_layer.weight": torch.randn(8, 4, generator=g),
          "decoder.final_layernorm.weight": torch.randn(4, generator=g),
          "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": torch.randn(4, generator=g),
          "decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(12, 4, generator=g),
          "decoder.layers.0.self_attention.linear_qkv._extra_state": None,
          "decoder.layers.0.self_attention.linear_proj.weight": torch.randn(4, 4, generator=g),
          "decoder.layers.0.pre_mlp_layernorm.weight": torch.randn(4, generator=g),
          "decoder.layers.0.mlp.router.weight": torch.randn(2, 4, generator=g),
          "decoder.layers.0.mlp.experts.linear_fc1.weight0": torch.randn(4, 4, generator=g),
          "decoder.layers.0.mlp.experts.linear_fc1.weight1": torch.randn(4, 4, generator=g),
          "decoder.layers.0.mlp.experts.linear_fc2.weight0": torch.randn(4, 2, generator=g),
          "decoder.layers.0.mlp.experts.linear_fc2.weight1": torch.randn(4, 2, generator=g)}
    local = shard_state_dict(te, dataclasses.replace(mc, untie_embeddings_and_output_weights=True),
                             RankCoords(ep_rank=1, ep_size=2))
    assert torch.equal(local["decoder.layers.0.input_layernorm.weight"],
                       te["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"])
    assert torch.equal(local["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"],
                       te["decoder.layers.0.mlp.experts.linear_fc2.weight1"])
    assert not any(k.endswith("_extra_state") for k in local)


def _cp_body(rank, world):
    pc = ParallelConfig(context_parallel_size=2)
    mc = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=16)
    initialize_model_parallel(pc, model=mc)
    return _build_error(mc, pc)


@pytest.mark.timeout(60)
def test_context_parallel_without_te_is_refused_clearly():
    for msg in run_ranks(_cp_body, 2, timeout=45):
        assert "context_parallel_size=2 needs Transformer Engine" in msg

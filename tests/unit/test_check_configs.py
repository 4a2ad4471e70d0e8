"""Shipped configs: each loads and validates at its intended world size, and the real-model configs carry
the published shapes (numbers copied from the HF config.json files, written here independently of the YAML).

    pytest tests/unit/test_check_configs.py
"""
import glob
import os

import pytest
import yaml

from megatron_rl.plan import load_job_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")

# config file -> intended world size (nodes x GPUs per node)
WORLD = {
    "qwen2.5_7b_1x8.yaml": 1 * 8,
    "qwen3_30b_a3b_2x8.yaml": 2 * 8,
    "qwen3_30b_a3b_tools_2x8.yaml": 2 * 8,  # multi-turn tool calling (docs/multi_turn.md)
    "deepseek_v3_scale_64x8.yaml": 64 * 8,
    "deepseek_v3_671b_64x8.yaml": 64 * 8,
    "tiny_cpu.yaml": None,  # the lead's config: its own world size (read from its header or default 1..4)
    "math_tiny_cpu.yaml": None,  # the math-task CPU config: its model is built first (tests/integration/test_data_math_e2e.py)
    "tiny_moe_cpu.yaml": None,  # MoE routing replay default; its model is built first (tests/unit/test_routing_config.py)
    "tool_tiny_cpu.yaml": None,  # the multi-turn tool task; its model is built first (tests/integration/test_tool_task_learns.py)
    "tiny_lora_cpu.yaml": None,  # LoRA on the quickstart's model; its base is trained first (test_readme_rows.py)
    "tiny_moe_lora_cpu.yaml": None,  # LoRA + r3 on EP2; its model is built first (test_readme_rows.py)
}

# Published HF config.json values.
QWEN25_7B = dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, rope_theta=1e6, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)
QWEN3_30B_A3B = dict(num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     vocab_size=151936, rope_theta=1e6, norm_topk_prob=True, tie_word_embeddings=False)
DEEPSEEK_V3 = dict(num_hidden_layers=61, first_k_dense_replace=3, hidden_size=7168, intermediate_size=18432,
                   num_attention_heads=128, n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
                   num_experts_per_tok=8, scoring_func="sigmoid", routed_scaling_factor=2.5, vocab_size=129280,
                   rope_theta=10000.0, tie_word_embeddings=False)


def _yaml(name):
    with open(os.path.join(CONFIGS, name)) as fh:
        return yaml.safe_load(fh)


def test_every_shipped_config_is_listed():
    shipped = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CONFIGS, "*.yaml")))
    assert shipped, "no configs shipped"
    missing = [s for s in shipped if s not in WORLD]
    assert not missing, f"add {missing} with their intended world size to WORLD"


@pytest.mark.parametrize("name", sorted(k for k, v in WORLD.items() if v is not None))
def test_config_validates_at_intended_world(name):
    cfg = load_job_config(os.path.join(CONFIGS, name), world_size=WORLD[name])
    assert cfg.model is not None


def test_tiny_cpu_validates_at_four_ranks(task_model, tiny_job):
    """The embedded default (TP2 x PP2) validates at world 4 once its model is built (the quickstart builds
    it into actor.load_hf first), and is rejected at other world sizes."""
    from megatron_rl.config import ConfigError

    model = task_model(task="copy", seed=0, hidden_size=128, num_layers=2)
    cfg = tiny_job(model=model, world_size=4)
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.pipeline_model_parallel_size == 2
    assert cfg.model.vocab_size % 8 == 0
    with pytest.raises(ConfigError):
        tiny_job(model=model, world_size=2)


@pytest.mark.parametrize("name", sorted(k for k, v in WORLD.items() if v is not None))
def test_config_fails_at_wrong_world(name):
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError, match="world size|data-parallel"):
        load_job_config(os.path.join(CONFIGS, name), world_size=WORLD[name] + 1)


def test_qwen25_7b_shapes():
    m = _yaml("qwen2.5_7b_1x8.yaml")["model"]
    p = QWEN25_7B
    assert m["num_layers"] == p["num_hidden_layers"]
    assert m["hidden_size"] == p["hidden_size"]
    assert m["ffn_hidden_size"] == p["intermediate_size"]
    assert m["num_attention_heads"] == p["num_attention_heads"]
    assert m["num_query_groups"] == p["num_key_value_heads"]
    assert m.get("kv_channels", p["hidden_size"] // p["num_attention_heads"]) == 128
    assert m["vocab_size"] == p["vocab_size"]
    assert float(m["rotary_base"]) == p["rope_theta"]
    assert float(m["norm_epsilon"]) == p["rms_norm_eps"]
    assert m["add_qkv_bias"] is True and m.get("qk_layernorm", False) is False
    assert m["untie_embeddings_and_output_weights"] is (not p["tie_word_embeddings"])
    assert "num_moe_experts" not in m


@pytest.mark.parametrize("name", ["qwen3_30b_a3b_2x8.yaml", "qwen3_30b_a3b_tools_2x8.yaml"])
def test_qwen3_30b_a3b_shapes(name):
    m = _yaml(name)["model"]
    p = QWEN3_30B_A3B
    assert m["num_layers"] == p["num_hidden_layers"]
    assert m["hidden_size"] == p["hidden_size"]
    assert m["num_attention_heads"] == p["num_attention_heads"]
    assert m["num_query_groups"] == p["num_key_value_heads"]
    assert m["kv_channels"] == p["head_dim"]
    assert m["num_moe_experts"] == p["num_experts"]
    assert m["moe_router_topk"] == p["num_experts_per_tok"]
    assert m["moe_ffn_hidden_size"] == p["moe_intermediate_size"]
    assert m["vocab_size"] == p["vocab_size"]
    assert float(m["rotary_base"]) == p["rope_theta"]
    assert m["qk_layernorm"] is True and m.get("add_qkv_bias", False) is False
    # HF norm_topk_prob=True <=> megatron moe_router_pre_softmax=False
    assert m["moe_router_pre_softmax"] is (not p["norm_topk_prob"])
    assert m["untie_embeddings_and_output_weights"] is (not p["tie_word_embeddings"])
    assert m.get("moe_layer_freq", 1) == 1 and m.get("first_k_dense_replace", 0) == 0


def test_deepseek_v3_scale_shapes():
    m = _yaml("deepseek_v3_scale_64x8.yaml")["model"]
    p = DEEPSEEK_V3
    # documented deviation: 3 extra MoE layers so that PP x VPP divides the layers (61 is prime)
    assert m["num_layers"] == p["num_hidden_layers"] + 3
    assert m["num_layers"] % (8 * 4) == 0
    assert m["first_k_dense_replace"] == p["first_k_dense_replace"]
    assert m["hidden_size"] == p["hidden_size"]
    assert m["ffn_hidden_size"] == p["intermediate_size"]
    assert m["num_attention_heads"] == p["num_attention_heads"]
    assert m["num_moe_experts"] == p["n_routed_experts"]
    assert m["moe_shared_expert_intermediate_size"] == p["n_shared_experts"] * p["moe_intermediate_size"]
    assert m["moe_ffn_hidden_size"] == p["moe_intermediate_size"]
    assert m["moe_router_topk"] == p["num_experts_per_tok"]
    assert m["moe_router_score_function"] == p["scoring_func"]
    assert m["moe_router_topk_scaling_factor"] == p["routed_scaling_factor"]
    assert m["vocab_size"] == p["vocab_size"]
    assert float(m["rotary_base"]) == p["rope_theta"]
    assert m["untie_embeddings_and_output_weights"] is (not p["tie_word_embeddings"])
    par = _yaml("deepseek_v3_scale_64x8.yaml")["parallel"]
    assert par["pipeline_model_parallel_size"] > 1 and par["virtual_pipeline_model_parallel_size"] > 1
    assert par["expert_model_parallel_size"] > 1


def test_real_configs_use_verl_correction_keys():
    from megatron_rl.correction.migration import LEGACY_KEYS

    for name in ("qwen2.5_7b_1x8.yaml", "qwen3_30b_a3b_2x8.yaml", "deepseek_v3_scale_64x8.yaml"):
        rc = _yaml(name)["algorithm"]["rollout_correction"]
        assert not set(rc) & set(LEGACY_KEYS), f"{name} uses seed-era keys {set(rc) & set(LEGACY_KEYS)}"


@pytest.mark.parametrize("name,overrides", [
    ("qwen2.5_7b_1x8.yaml", []),
    ("qwen3_30b_a3b_2x8.yaml", []),
    ("deepseek_v3_scale_64x8.yaml", []),
    # the 32-node variant documented in the config header
    ("deepseek_v3_scale_64x8.yaml", ["parallel.expert_model_parallel_size=32", "parallel.tensor_model_parallel_size=4",
                                     "actor.recompute_granularity=full", "actor.recompute_method=uniform",
                                     "actor.recompute_num_layers=1"]),
])
def test_megatron_accepts_the_transformer_config(name, overrides):
    """megatron-core's own TransformerConfig validation (an independent check of the model + layout)."""
    import torch

    from megatron_rl.models.builder import make_transformer_config

    world = WORLD[name] if not overrides else 32 * 8
    cfg = load_job_config(os.path.join(CONFIGS, name), overrides, world_size=world)
    tc = make_transformer_config(cfg.model, cfg.parallel, params_dtype=torch.bfloat16)
    assert tc.num_layers == cfg.model.num_layers
    assert tc.tensor_model_parallel_size == cfg.parallel.tensor_model_parallel_size
    if cfg.model.is_moe:
        assert tc.num_moe_experts == cfg.model.num_moe_experts
        assert sum(tc.moe_layer_freq) == sum(cfg.model.moe_layer_pattern())

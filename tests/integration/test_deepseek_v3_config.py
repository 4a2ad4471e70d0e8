"""configs/deepseek_v3_671b_64x8.yaml is DeepSeek-V3 as published.

* its ``model:`` section is exactly what the project's config.json reader makes of DeepSeek-V3's published
  config.json (written out below from the HF repository deepseek-ai/DeepSeek-V3);
* the memory plan's parameter count: 671B total within 0.5 % (the published total excludes the 14B MTP
  module, which is dropped on import); active per token within 1.5 % of the published "37B", a number given
  to two significant digits (the plan counts 37.55B: routed top-8 + shared expert + router, attention, dense
  layers, input embedding and output layer);
* the counting formula (MLA, shared experts, expert bias) equals transformers' own parameter count of the
  tiny DeepseekV3ForCausalLM;
* ``megatron-rl check`` plans it with no flags (uneven stages 7 + 8 x 6 + 6, per-stage table, fits 80 GB).

Run: ``pytest tests/integration/test_deepseek_v3_config.py``
"""
import os

import pytest

from megatron_rl.plan import load_job_config
from megatron_rl.convert.hf_config import model_config_from_hf
from megatron_rl.ops.memory import active_parameters, total_parameters
from megatron_rl.testing.actor_reference import hf_model_config
from megatron_rl.testing.cli import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "deepseek_v3_671b_64x8.yaml")

# deepseek-ai/DeepSeek-V3 config.json (the published values; FP8 quantization_config left out: the
# project loads the bf16-dequantized checkpoint)
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False, "rope_theta": 10000, "attention_bias": False, "attention_dropout": 0.0,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


@pytest.fixture(scope="module")
def cfg():
    return load_job_config(CONFIG, world_size=512)


def test_model_section_is_the_published_config(cfg):
    published = model_config_from_hf(DEEPSEEK_V3_CONFIG)
    mine = cfg.model
    # init_method_std / moe_grouped_gemm are not part of config.json's shape
    diffs = {k: (getattr(mine, k), v) for k, v in vars(published).items()
             if k not in ("moe_grouped_gemm",) and getattr(mine, k) != v}
    assert not diffs, diffs
    assert cfg.parallel.stage_layer_counts(61) == [7, 8, 8, 8, 8, 8, 8, 6]
    assert cfg.actor.routing_replay == "r3"


def test_parameter_totals_match_published(cfg):
    total, active = total_parameters(cfg.model), active_parameters(cfg.model)
    assert abs(total / 671e9 - 1) < 0.005, total
    assert abs(active / 37e9 - 1) < 0.015, active


def test_parameter_formula_matches_transformers(tiny_hf_model):
    import torch
    import transformers

    path = tiny_hf_model("deepseek_v3", seed=0, num_hidden_layers=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    mc = hf_model_config(path)
    assert total_parameters(mc) == hf


def test_check_plans_it_with_no_flags():
    out = run_cli("check", CONFIG, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "layout: world=512 TP=8 PP=8 VPP=1 CP=1 DP=8 EP=64 ETP=1 expert-DP=1" in text
    assert "671.03 B parameters (37.55 B active per token)" in text
    rows = [line.split() for line in text.splitlines() if line[:5].strip().isdigit()]
    assert [int(r[1]) for r in rows] == [7, 8, 8, 8, 8, 8, 8, 6]
    assert "fits:" in text

"""``actor.lora``: the section's validation (each message names its key), its loading from YAML, and the job plan's
refusals of combinations the adapters are not built for (before any process group or model)."""
import pytest

from megatron_rl.config import ConfigError
from megatron_rl.config.load import apply_overrides, job_config_from_dict
from megatron_rl.lora.config import LoraConfig
from megatron_rl.plan import JobPlan

DENSE = {"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                   "vocab_size": 64, "ffn_hidden_size": 48, "max_position_embeddings": 64},
         "cluster": {"device": "cpu", "gpus_per_node": 1}}
MOE = {**DENSE, "model": {**DENSE["model"], "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16}}


@pytest.mark.parametrize("kwargs,key", [
    ({"rank": -1}, "actor.lora.rank"), ({"rank": 4, "alpha": 0}, "actor.lora.alpha"),
    ({"rank": 4, "dropout": 1.0}, "actor.lora.dropout"), ({"rank": 4, "init": "xavier"}, "actor.lora.init"),
    ({"rank": 4, "target_modules": ["qkv"]}, "actor.lora.target_modules: unknown 'qkv'"),
    ({"rank": 4, "target_modules": "all-linear"}, "actor.lora.target_modules: must be a list"),
    ({"rank": 4, "target_modules": ["q_proj", "v_proj"]}, "q_proj, v_proj without k_proj"),
    ({"rank": 4, "target_modules": ["gate_proj", "down_proj"]}, "gate_proj without up_proj"),
    ({"rank": 4, "target_modules": []}, "actor.lora.target_modules: empty"),
])
def test_bad_values_name_their_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace("(", r"\(")):
        LoraConfig(**kwargs)


def test_names_map_to_megatron_core_modules():
    cfg = LoraConfig(rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    assert [m for _, m in cfg.mcore_targets()] == ["linear_qkv"] * 3 + ["linear_proj", "linear_fc2"]
    assert cfg.scaling == 16.0 / 8 and cfg.enabled and not LoraConfig().enabled


def load_job_config(tree, overrides):
    """The typed config of ``tree`` with ``overrides`` (each key's own checks; no world-size checks)."""
    return job_config_from_dict(apply_overrides(tree, overrides))


def test_yaml_section_and_unknown_key():
    cfg = load_job_config(DENSE, ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.target_modules=[linear_qkv]"])
    assert cfg.actor.lora == LoraConfig(rank=8, alpha=16.0, target_modules=["linear_qkv"])
    with pytest.raises(ConfigError, match=r"actor\.lora\.lora_rank"):
        load_job_config(DENSE, ["actor.lora.lora_rank=8"])
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank: must be an integer >= 0"):
        load_job_config(DENSE, ["actor.lora.rank=-2"])


def _problems(path, *overrides):
    cfg = load_job_config(path, list(overrides))
    return JobPlan.collect(cfg, 1)[1]


def test_plan_refuses_what_is_not_built():
    on = ["actor.lora.rank=4"]
    probs = _problems(DENSE, *on, "actor.lora.target_modules=[linear_q_proj]")
    assert any("actor.lora.target_modules: 'linear_q_proj' matches no module" in p for p in probs), probs
    assert any("actor.lora: needs actor.load_hf" in p for p in probs), probs
    probs = _problems(MOE, *on, "model.moe_grouped_gemm=true")
    assert any("model.moe_grouped_gemm" in p for p in probs), probs
    probs = _problems(DENSE, *on, "actor.ref_param_offload=true")
    assert any(p.startswith("actor.ref_param_offload") for p in probs), probs
    assert not [p for p in _problems(DENSE) if "lora" in p]  # off: nothing said

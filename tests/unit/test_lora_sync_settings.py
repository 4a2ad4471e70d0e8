"""``rollout.lora_sync`` is built once with the job's weight-sync settings: merged LoRA jobs read the model through
the merged view (every weight_sync mode, delta included), adapter-only jobs are refused -- naming the key -- with
delta sync, without adapters, or (SGLang) with a target SGLang cannot serve; a job without adapters is unchanged."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.config.sections import RolloutConfig
from megatron_rl.lora.config import LoraConfig
from megatron_rl.plan.checks import Unbuilt
from megatron_rl.trainer.sync_settings import settings_of as weight_sync_settings

LORA = LoraConfig(rank=8, alpha=32)


def _r(**kw):
    return dataclasses.replace(RolloutConfig(), **kw)


def test_merged_is_the_default_and_reads_through_the_merged_view():
    s = weight_sync_settings(_r(), "/tmp/run", LORA)
    assert s.lora.mode == "merged" and s.lora.scale == 4.0 and s.view is not None
    assert s.view.keywords == {"scale": 4.0, "dtype": None}  # fp32 merge, cast once by the path
    s = weight_sync_settings(_r(weight_sync_delta=True), "/tmp/run", LORA)
    assert s.delta and s.view is not None


def test_without_adapters_nothing_changes():
    for lora in (None, LoraConfig()):
        s = weight_sync_settings(_r(), "/tmp/run", lora)
        assert s.lora is None and s.view is None


@pytest.mark.parametrize("kw,lora,needle", [
    (dict(lora_sync="both"), LORA, "rollout.lora_sync: 'both' is not one of merged, adapter"),
    (dict(lora_sync="adapter"), None, "rollout.lora_sync: 'adapter' needs actor.lora"),
    (dict(lora_sync="adapter", weight_sync_delta=True), LORA, "rollout.weight_sync_delta: true with rollout.lora_sync"),
    (dict(lora_sync="adapter", engine="sglang", sglang_urls=["http://x:1"]),
     LoraConfig(rank=8, target_modules=["linear_qkv", "linear_kv_down_proj"]),
     "actor.lora.target_modules: 'linear_kv_down_proj' (linear_kv_down_proj) has no SGLang LoRA module"),
])
def test_refused_combinations_name_the_key(kw, lora, needle):
    with pytest.raises(Unbuilt) as exc:
        weight_sync_settings(_r(**kw), "/tmp/run", lora)
    assert any(needle in p for p in exc.value.problems), exc.value.problems


def test_adapter_mode_on_the_embedded_engine():
    s = weight_sync_settings(_r(lora_sync="adapter"), "/tmp/run", LORA)
    assert s.lora.mode == "adapter" and s.view is None


def test_adapter_mode_on_sglang_servers():
    s = weight_sync_settings(_r(lora_sync="adapter", engine="sglang", sglang_urls=["http://x:1"]), "/tmp/run", LORA)
    assert s.lora.mode == "adapter" and s.view is None


def test_adapter_sync_of_expert_adapters_is_refused():
    from megatron_rl.config import job_config_from_dict
    from megatron_rl.plan.checks import lora_adapter_expert_errors

    model = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64, "vocab_size": 64,
             "num_moe_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 2}

    def job(targets, sync, experts=4):
        return job_config_from_dict({"model": {**model, "num_moe_experts": experts},
                                     "actor": {"lora": {"rank": 4, "target_modules": targets}},
                                     "rollout": {"lora_sync": sync}})

    [p] = lora_adapter_expert_errors(job(["linear_fc1", "linear_qkv"], "adapter"))
    assert "rollout.lora_sync: 'adapter' with actor.lora.target_modules ['linear_fc1'] on a MoE model" in p
    assert lora_adapter_expert_errors(job(["linear_fc1"], "merged")) == []
    assert lora_adapter_expert_errors(job(["linear_qkv"], "adapter")) == []
    assert lora_adapter_expert_errors(job(["linear_fc1"], "adapter", experts=None)) == []

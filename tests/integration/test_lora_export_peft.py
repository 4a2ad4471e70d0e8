"""PEFT export of LoRA adapters (``convert.lora_export``) against PEFT itself: PEFT loads the exported adapter
(PEFT's key names, HF module names; qkv's B split to q / k / v and fc1's to gate / up, A shared) on the HF model
and gives the adapted megatron-core model's logits (``lora.layers``, one rank); the merged export equals PEFT's
``merge_and_unload()`` of that adapter within fp32 rounding."""
from __future__ import annotations

import json

import pytest
import torch

import megatron.core  # noqa: F401  (import once in the parent: forked ranks start fast)
from megatron_rl.convert import storage
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.lora_export import merged_hf_state_dict, split_adapters, write_peft_adapter
from megatron_rl.convert.mapping import hf_to_mcore
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.lora_sync_reference import ALPHA, RANK, adapted_model_outputs, full_adapters

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def test_peft_loads_the_export_and_gives_the_mcore_logits(tiny_hf_model, tmp_path):
    hf_dir = tiny_hf_model("qwen2", seed=23)
    geom = HFGeometry.from_hf_config(storage.read_hf_config(hf_dir))
    base = {n: t.float() for n, t in hf_to_mcore(storage.read_hf_state_dict(hf_dir), geom).items()}
    full = {**base, **full_adapters(geom, seed=9)}
    tokens = torch.randint(0, geom.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    [(_, _, mcore_logits)] = run_ranks(adapted_model_outputs, 1, hf_dir, full, {}, tokens, timeout=180)

    _, adapters = split_adapters(full)
    lora = {"rank": RANK, "alpha": ALPHA, "dropout": 0.0}
    write_peft_adapter(str(tmp_path / "adapter"), adapters, geom, lora)
    cfg = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert sorted(cfg["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                             "v_proj"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter"))
    pm.eval()
    with torch.no_grad():
        peft_logits = pm(input_ids=tokens).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(input_ids=tokens).logits
    assert (peft_logits - plain).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(peft_logits, mcore_logits, atol=2e-4, rtol=1e-4)

    merged = merged_hf_state_dict(full, geom, lora)
    ref = pm.merge_and_unload().state_dict()
    assert set(merged) <= set(ref)
    for name, t in merged.items():
        torch.testing.assert_close(t, ref[name], atol=1e-6, rtol=1e-6, msg=name)


def test_peft_loads_the_moe_export_with_fused_experts(tiny_hf_model, tmp_path):
    """Qwen3-MoE, attention and every routed expert adapted: the experts go to PEFT's ``target_parameters``
    adapters on transformers' fused ``gate_up_proj`` / ``down_proj``; PEFT gives the mcore model's logits."""
    hf_dir = tiny_hf_model("qwen3_moe", seed=29)
    geom = HFGeometry.from_hf_config(storage.read_hf_config(hf_dir))
    base = {n: t.float() for n, t in hf_to_mcore(storage.read_hf_state_dict(hf_dir), geom).items()}
    full = {**base, **full_adapters(geom, seed=11)}
    tokens = torch.randint(0, geom.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    [(_, _, mcore_logits)] = run_ranks(adapted_model_outputs, 1, hf_dir, full, {}, tokens, timeout=180)
    _, adapters = split_adapters(full)
    write_peft_adapter(str(tmp_path / "adapter"), adapters, geom, {"rank": RANK, "alpha": ALPHA, "dropout": 0.0})
    cfg = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        peft_logits = pm(input_ids=tokens).logits
    torch.testing.assert_close(peft_logits, mcore_logits, atol=2e-4, rtol=1e-4)

"""Merged LoRA sync on a live parallel model: the sender's owned HF tensors (``iter_hf_tensors`` with the merged
view, gathered in the engine dtype as the weight sync does) equal, bit for bit, a single-process reference --
the full fp32 weights + (alpha/r)·B·A cast once to bf16 and mapped to HF by ``convert.mapping`` -- at TP2 (dense)
and TP2 x EP2 (MoE, every routed expert adapted); and the HF model holding the merged fp32 weights gives the live
adapted model's logits (the adapters' forward, ``lora.layers``). Adapter A/B shards are cut from full tensors by
``convert.partition`` (the layout of docs/lora.md)."""
from __future__ import annotations

import pytest
import torch

import megatron.core  # noqa: F401  (import once in the parent: forked ranks start fast)
from megatron_rl.convert import storage
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.mapping import hf_to_mcore, mcore_to_hf
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.lora_sync_reference import ALPHA, RANK, adapted_model_outputs, full_adapters, reference_merge

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch,pcfg", [
    ("qwen2", dict(tensor_model_parallel_size=2)),
    ("qwen3_moe", dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                       sequence_parallel=True)),
])
def test_merged_sync_is_base_plus_delta_bit_for_bit(tiny_hf_model, tmp_path, arch, pcfg):
    import transformers

    hf_dir = tiny_hf_model(arch, seed=21)
    geom = HFGeometry.from_hf_config(storage.read_hf_config(hf_dir))
    base = {n: t.float() for n, t in hf_to_mcore(storage.read_hf_state_dict(hf_dir), geom).items()}
    adapters = full_adapters(geom, seed=5)
    assert any(".experts.local_experts.1.linear_fc1.lora_B" in n for n in adapters) == (arch == "qwen3_moe")
    tokens = torch.randint(0, geom.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    results = run_ranks(adapted_model_outputs, 2, hf_dir, {**base, **adapters}, pcfg, tokens, timeout=240)
    merged = reference_merge(base, adapters, ALPHA / RANK)
    ref = mcore_to_hf({n: t.to(torch.bfloat16) for n, t in merged.items()}, geom)
    owned = {}
    for r, (mine, _, _) in enumerate(results):
        assert not set(mine) & set(owned), f"rank {r} sends a tensor another rank sends"
        owned.update(mine)
    assert set(owned) == set(ref)
    unequal = [n for n in ref if not torch.equal(owned[n], ref[n])]
    assert not unequal, f"merged sync differs from base + delta (bf16) in {unequal[:5]}"
    changed = [n for n in ref if not torch.equal(ref[n], mcore_to_hf(base, geom)[n].to(torch.bfloat16))]
    assert any("q_proj" in n for n in changed) and any("down_proj" in n for n in changed)
    # the HF model holding the merged fp32 weights (the embedded engine's model) gives the adapted model's logits
    storage.write_hf_model_dir(str(tmp_path / "merged"), results[0][1], hf_dir, None)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():
        hf_logits = model(input_ids=tokens).logits
    for r, (_, _, logits) in enumerate(results):
        torch.testing.assert_close(logits, hf_logits, atol=2e-4, rtol=1e-4, msg=f"rank {r}")

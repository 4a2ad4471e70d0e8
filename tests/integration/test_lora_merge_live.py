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
from megatron_rl.convert.mapping import hf_to_mcore, mcore_to_hf, param_rules
from megatron_rl.testing.distributed import run_ranks

pytest.importorskip("transformers")

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
RANK, ALPHA = 4, 8.0


def full_adapters(geom: HFGeometry, seed: int) -> dict:
    """Random full (TP1 / EP1) A and B of every targeted module of ``geom`` (B non-zero)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for r in param_rules(geom):
        name = r.mcore_name
        if name.endswith(".weight") and name[:-len(".weight")].rsplit(".", 1)[-1] in TARGETS:
            o, i = r.mcore_shape
            out[name[:-len(".weight")] + ".lora_A.weight"] = torch.randn(RANK, i, generator=g) / i ** 0.5
            out[name[:-len(".weight")] + ".lora_B.weight"] = torch.randn(o, RANK, generator=g) * 0.2
    return out


def reference_merge(full: dict, adapters: dict, scale: float) -> dict:
    """Single process, fp32: W + scale * sum_k B[:, k] A[k, :] in k order for every adapted W."""
    out = dict(full)
    for name, a in adapters.items():
        if name.endswith(".lora_A.weight"):
            p = name[:-len(".lora_A.weight")]
            b = adapters[p + ".lora_B.weight"]
            delta = torch.zeros(b.shape[0], a.shape[1])
            for k in range(a.shape[0]):
                delta = delta + torch.outer(b[:, k], a[k])
            out[p + ".weight"] = full[p + ".weight"].float() + scale * delta
    return out


def _rank(rank, world, hf_dir, full, pcfg_kw, tokens):
    from megatron_rl.convert.live import iter_hf_tensors, load_full_state_dict_into_model
    from megatron_rl.lora.layers import COLUMN, ROW, lora_class
    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import ParallelConfig, initialize_model_parallel
    from megatron_rl.parallel.groups import ActorGroups
    from megatron_rl.testing.actor_reference import hf_model_config
    from megatron_rl.weight_sync.lora_sync import LoraSync

    pcfg = ParallelConfig(**pcfg_kw)
    mcfg = hf_model_config(hf_dir)
    initialize_model_parallel(pcfg, seed=3, model=mcfg)
    chunks = build_gpt_model(mcfg, pcfg)
    groups = ActorGroups.from_parallel_state(sequence_parallel=pcfg.sequence_parallel)
    for name, m in chunks[0].named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            kind = ROW if name.endswith(("linear_proj", "linear_fc2")) else COLUMN
            tp = 1 if m.tp_group is None else torch.distributed.get_world_size(m.tp_group)
            o, i = m.weight.shape
            m.__class__ = lora_class(type(m), kind)
            m.attach(RANK, ALPHA / RANK, 0.0, torch.zeros(RANK, i * (tp if kind == ROW else 1)), 0)
    load_full_state_dict_into_model(chunks, full, mcfg, groups)  # cuts A / B like their base (param_kind)
    geom = HFGeometry.from_hf_config(storage.read_hf_config(hf_dir))
    view = LoraSync("merged", RANK, ALPHA).view()
    owned = {n: t.to(torch.bfloat16) for n, t in iter_hf_tensors(chunks, mcfg, geom, groups, owner_only=True,
                                                                  gather_dtype=torch.bfloat16, view=view)}
    fp32 = {n: t.clone() for n, t in iter_hf_tensors(chunks, mcfg, geom, groups, view=view)}
    with torch.no_grad():
        chunks[0].eval()
        pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        logits = chunks[0](tokens, pos, None)
        if groups.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(groups.tp_size)]
            torch.distributed.all_gather(parts, logits.contiguous(), group=groups.tp_group)
            logits = torch.cat(parts, -1)
    return owned, (fp32 if rank == 0 else None), logits[..., :geom.vocab_size]


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
    results = run_ranks(_rank, 2, hf_dir, {**base, **adapters}, pcfg, tokens, timeout=240)
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

"""LoRA adapters on megatron-core layers == PEFT's LoRA on the HF model: logits and dA / dB, every layout.

The same layout-free adapters (random A and B, B non-zero) are put into megatron-core's adapted modules at
TP1, TP2, TP2+SP, PP2, and into PEFT's LoRA on the HF model (``testing.lora_reference``: one A shared by q / k / v
and gate / up, B split like the weight's rows; routed experts through PEFT's ``target_parameters``). PEFT is the
independent reference: its forward logits and the gradients of a CE-sum loss must match ours within fp32
tolerance, on a dense model (attention + dense MLP) and on MoE models (Qwen3-MoE routed experts at EP2; DeepSeek-V3
routed + shared experts at EP2 and TP2). The base gets no gradient at all.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_lora_peft.py -q``
"""
import functools

import pytest
import torch

import megatron.core  # noqa: F401  (imported once in the parent: forked ranks start fast)
from megatron_rl.platform.select import apply_cpu_patches

apply_cpu_patches()

from megatron_rl.testing.distributed import run_ranks  # noqa: E402

pytest.importorskip("peft")
RANK, ALPHA = 4, 8.0
DENSE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
MLP_TARGETS = ("linear_fc1", "linear_fc2")


def _tokens(vocab, dp, seed=0, b=2, s=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (b, s + 1), generator=g) for _ in range(dp)]


def _forward_step(with_labels, data_iterator, model):
    ids = next(data_iterator)
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens).contiguous()
    out = model(tokens, pos, attention_mask=None, labels=labels if with_labels else None)

    def loss_func(output):
        if with_labels:
            return output.float().sum(), {}
        return output.sum() * 0.0, {"logits": output.detach().clone()}

    return out, loss_func


def _rank(rank, world, pc_kwargs, hf_dir, targets, full, batches):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.convert import load_checkpoint_into_model
    from megatron_rl.lora.apply import LoraSpec, apply_lora
    from megatron_rl.lora.config import LoraConfig
    from megatron_rl.convert.lora_layout import adapter_key, adapter_kinds, set_full_adapters, tp_coords
    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import ParallelConfig, destroy_model_parallel, initialize_model_parallel
    from megatron_rl.parallel.groups import ActorGroups
    from megatron_rl.testing.actor_reference import hf_model_config

    mc = hf_model_config(hf_dir)
    pc = ParallelConfig(**pc_kwargs)
    initialize_model_parallel(pc, seed=1, model=mc)
    groups = ActorGroups.from_parallel_state(sequence_parallel=pc.sequence_parallel)
    chunks = build_gpt_model(mc, pc)
    load_checkpoint_into_model(chunks, hf_dir, mc, groups)
    lt = apply_lora(chunks, LoraSpec(LoraConfig(rank=RANK, alpha=ALPHA, target_modules=list(targets)), seed=3))
    set_full_adapters(lt, full)
    dp_rank = ps.get_data_parallel_rank()
    mine = batches[dp_rank]
    fb = get_forward_backward_func()
    common = dict(model=chunks, num_microbatches=1, seq_length=mine.shape[1] - 1, micro_batch_size=mine.shape[0])
    out = fb(forward_step_func=functools.partial(_forward_step, False), data_iterator=iter([mine]),
             forward_only=True, **common)
    logits = out[0]["logits"] if ps.is_pipeline_last_stage() else None
    fb(forward_step_func=functools.partial(_forward_step, True), data_iterator=iter([mine]),
       forward_only=False, **common)
    adapters = {id(t.module.lora_A.weight) for t in lt} | {id(t.module.lora_B.weight) for t in lt}
    base_grads = [n for c in chunks for n, p in c.named_parameters() if id(p) not in adapters and
                  (p.requires_grad or p.grad is not None)]
    grads = {}
    for t in lt:
        tp_rank, _ = tp_coords(t)
        for which, kind in zip("AB", adapter_kinds(t)):
            p = getattr(t.module, f"lora_{which}").weight
            grads[adapter_key(t, which)] = (tp_rank, kind, p.grad.detach().clone())
    res = {"dp_rank": dp_rank, "tp_rank": ps.get_tensor_model_parallel_rank(), "logits": logits, "grads": grads,
           "base_grads": base_grads}
    destroy_model_parallel()
    return res


def _merge_grads(results):
    """{key: unsharded grad}: each TP shard summed over its data-parallel replicas (ranks with different rows)."""
    from megatron_rl.convert.lora_layout import merge_adapter_shards

    parts, kinds = {}, {}
    for r in results:
        for key, (tp_rank, kind, g) in r["grads"].items():
            slot = parts.setdefault(key, {})
            slot[tp_rank] = slot[tp_rank] + g if tp_rank in slot else g
            kinds[key] = kind
    return merge_adapter_shards(parts, kinds)


def _merge_logits(results, dp):
    per_dp = {}
    for r in results:
        if r["logits"] is not None:
            per_dp.setdefault(r["dp_rank"], {})[r["tp_rank"]] = r["logits"]
    return [torch.cat([per_dp[d][t] for t in sorted(per_dp[d])], dim=-1) for d in range(dp)]


@functools.lru_cache(maxsize=None)
def _case(hf_dir, targets, dp):
    """(adapters, batches, PEFT logits per DP batch, PEFT grads of the CE sum over all batches)."""
    from megatron_rl.testing.actor_reference import load_hf_reference
    from megatron_rl.testing.lora_reference import adapted_rules, peft_grads, peft_model, random_full_adapters

    g, rules = adapted_rules(hf_dir, targets)
    full = random_full_adapters(rules, RANK, seed=7)
    hf = load_hf_reference(hf_dir)
    batches = _tokens(hf.config.vocab_size, dp)
    model = peft_model(hf, rules, g, full, RANK, ALPHA)
    logits, loss = [], 0.0
    for ids in batches:
        lg = model(input_ids=ids[:, :-1]).logits
        logits.append(lg.detach())
        loss = loss + torch.nn.functional.cross_entropy(lg.flatten(0, 1).float(), ids[:, 1:].flatten(),
                                                        reduction="sum")
    loss.backward()
    return full, batches, logits, peft_grads(model, rules, g, RANK)


def _check(hf_dir, targets, pc_kwargs, world, dp):
    full, batches, ref_logits, ref_grads = _case(hf_dir, targets, dp)
    results = run_ranks(_rank, world, pc_kwargs, hf_dir, targets, full, batches, timeout=150)
    for r in results:
        assert r["base_grads"] == [], f"base parameters with gradients: {r['base_grads'][:5]}"
    logits = _merge_logits(results, dp)
    for d, (a, b) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=lambda m: f"logits of DP batch {d}: {m}")
    grads = _merge_grads(results)
    assert sorted(grads) == sorted(ref_grads)
    live = {k for k in ref_grads if ref_grads[k].abs().max() > 0}
    # an expert no token was routed to has no gradient (on both sides); every other adapter must have one
    assert not [k for k in set(ref_grads) - live if ".local_experts." not in k], "PEFT grads zero (vacuous)"
    assert any(".local_experts." in k for k in live) or not any(".local_experts." in k for k in ref_grads)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {k}: {m}")


@pytest.fixture(scope="module")
def dense_dir(tiny_hf_model):
    return tiny_hf_model("qwen2", seed=3, num_hidden_layers=2)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name,pc,world,dp", [
    ("tp1", {}, 1, 1),
    ("tp2", {"tensor_model_parallel_size": 2}, 2, 1),
    ("tp2_sp", {"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2, 1),
    ("pp2", {"pipeline_model_parallel_size": 2}, 2, 1),
])
def test_dense_matches_peft(dense_dir, name, pc, world, dp):
    _check(dense_dir, DENSE_TARGETS, pc, world, dp)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tiny_hf_model):
    return tiny_hf_model("qwen3_moe", seed=5)


@pytest.fixture(scope="module")
def deepseek_dir(tiny_hf_model):
    return tiny_hf_model("deepseek_v3", seed=11)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name,pc,world,dp", [
    ("ep2", {"expert_model_parallel_size": 2}, 2, 2),
    ("tp2_sp_ep2", {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
                    "expert_tensor_parallel_size": 1}, 2, 1),
])
def test_qwen3_moe_experts_match_peft(qwen3_moe_dir, name, pc, world, dp):
    """Attention and every routed expert (PEFT's per-expert adapters on the fused expert weights)."""
    _check(qwen3_moe_dir, DENSE_TARGETS, pc, world, dp)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name,pc,world,dp", [
    ("ep2", {"expert_model_parallel_size": 2}, 2, 2),
    ("tp2_sp_ep2", {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
                    "expert_tensor_parallel_size": 1}, 2, 1),
])
def test_deepseek_shared_experts_match_peft(deepseek_dir, name, pc, world, dp):
    """Dense MLP (layer 0), routed experts and the shared expert (TP-sharded: its delta reduced once), MLA's
    up-projections and output projection."""
    _check(deepseek_dir, ("linear_q_up_proj", "linear_kv_up_proj", "linear_proj") + MLP_TARGETS, pc, world, dp)

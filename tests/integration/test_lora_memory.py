"""``check``'s memory plan of a LoRA actor: adapter parameters counted as megatron-core builds them (a real model
with the adapters attached, counted here), gradients and Adam state for them only, no second reference model.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_lora_memory.py -q``
"""
import dataclasses

import pytest

import megatron.core  # noqa: F401
from megatron_rl.ops.memory import MemoryOptions, memory_plan
from megatron_rl.plan.sizing import memory_job
from megatron_rl.testing.actor_reference import actor_job
from megatron_rl.testing.distributed import run_ranks

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"]}


def _built_counts(rank, world, job):
    """(adapter elements, base elements) of the model megatron-core builds with the adapters attached."""
    from megatron_rl.lora.apply import LoraSpec, apply_lora
    from megatron_rl.lora.checkpoint import is_adapter_key
    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import initialize_model_parallel

    initialize_model_parallel(job.parallel, seed=1, model=job.model)
    chunks = build_gpt_model(job.model, job.parallel, use_transformer_engine=False)
    apply_lora(chunks, LoraSpec(job.actor.lora, 1))
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    return (sum(p.numel() for n, p in named if is_adapter_key(n)),
            sum(p.numel() for n, p in named if not is_adapter_key(n)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch,kw", [("qwen2", {"num_hidden_layers": 2}), ("qwen3_moe", {})])
def test_plan_counts_adapters_only_for_grads_and_adam(tiny_hf_model, arch, kw):
    hf_dir = tiny_hf_model(arch, seed=5, **kw)
    job = actor_job(hf_dir, {"lora": LORA, "policy_loss": {"kl_loss_coef": 0.01}})
    (adapters, base), = run_ranks(_built_counts, 1, job, timeout=100)
    opts = MemoryOptions(params_bytes=4, distributed_optimizer=False)
    (st,) = memory_plan(memory_job(job, 1), opts).stages
    assert st.adapter_params == adapters
    assert st.params == 4 * (base + adapters)
    assert st.grads == 4 * adapters
    assert st.optimizer == 8 * adapters  # fp32: Adam's two moments, no main copy
    assert st.reference == 0  # the reference is the policy with its adapters off
    full = dataclasses.replace(job, actor=dataclasses.replace(job.actor, lora=dataclasses.replace(job.actor.lora,
                                                                                                   rank=0)))
    (fst,) = memory_plan(memory_job(full, 1), opts).stages
    assert fst.grads == 4 * base and fst.reference == 4 * base and fst.adapter_params == 0


def _apply_unmatched(rank, world, job):
    from megatron_rl.lora.apply import LoraSpec, apply_lora
    from megatron_rl.lora.config import LoraConfig
    from megatron_rl.lora.names import LoraTargetError
    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import initialize_model_parallel

    initialize_model_parallel(job.parallel, seed=1, model=job.model)
    chunks = build_gpt_model(job.model, job.parallel, use_transformer_engine=False)
    try:
        apply_lora(chunks, LoraSpec(LoraConfig(rank=2, target_modules=["linear_fc1", "linear_q_proj"]), 1))
    except LoraTargetError as exc:
        return str(exc), [n for c in chunks for n, _ in c.named_parameters() if "lora_" in n]
    return None, []


@pytest.mark.timeout(60)
def test_a_target_that_matches_nothing_is_an_error_naming_it(tiny_hf_model):
    job = actor_job(tiny_hf_model("qwen2", seed=5, num_hidden_layers=2), {})
    (msg, attached), = run_ranks(_apply_unmatched, 1, job, timeout=50)
    assert msg is not None and "'linear_q_proj' matches no module" in msg, msg
    assert attached == []  # refused before any adapter was attached

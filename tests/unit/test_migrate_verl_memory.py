"""``migrate verl`` and the memory keys of verl jobs: megatron's optimizer CPU offload carried over (and planned on the
host), verl's reference offload mapped, its between-phase actor offloads reported with why, and a stated
``cluster.gpu_memory_gb`` default so ``check`` always gives a fit verdict.

Sources: tests/data/verl/grpo_qwen3moe_30b_megatron.yaml (verl's Qwen3-30B-A3B recipe, cited in its header) and the
offload keys of verl's examples/grpo_trainer/run_deepseek671b_math_megatron_80gb.sh at commit
b178a3cd56f58b2d502255daba591e92833930a7 (ALL_OFFLOAD=True: actor param / grad / optimizer and ref param offload).

    pytest tests/unit/test_migrate_verl_memory.py
"""
import os

import yaml

from megatron_rl.plan import collect_job_config
from megatron_rl.cli.migrate import merge_overrides
from megatron_rl.config.load import yaml_load
from megatron_rl.config.migrate_verl import migrate_verl
from megatron_rl.config.verl_keys import MAPPED, NO_MEANING
from megatron_rl.ops.memory import MemoryOptions, memory_plan
from megatron_rl.plan.sizing import memory_job

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "verl")
QWEN3_MOE = dict(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4,
                 kv_channels=128, vocab_size=151936, qk_layernorm=True, num_moe_experts=128, moe_router_topk=8,
                 moe_ffn_hidden_size=768, untie_embeddings_and_output_weights=True)
#: the DeepSeek-V3 80 GB script's offload overrides (ALL_OFFLOAD=True)
DSV3_OFFLOAD = {"actor_rollout_ref": {"actor": {"strategy": "megatron", "megatron": {
    "param_offload": True, "optimizer_offload": True, "grad_offload": True}}, "ref": {"megatron": {
        "param_offload": True}}}}


def _entry(m, key):
    [e] = [e for e in m.entries if e.key == key]
    return e


def test_the_qwen3_moe_recipe_keeps_megatrons_optimizer_offload_and_plans_it_on_the_host(tmp_path):
    with open(os.path.join(DATA, "grpo_qwen3moe_30b_megatron.yaml")) as fh, \
            open(os.path.join(DATA, "ppo_megatron_trainer.yaml")) as base:  # the config its run script overrides
        m = migrate_verl(merge_overrides(yaml_load(base), yaml_load(fh)))
    assert m.tree["actor"]["optimizer_cpu_offload"] is True and m.tree["actor"]["optimizer_offload_fraction"] == 1.0
    assert _entry(m, "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload").kind == MAPPED
    assert m.tree["cluster"]["gpu_memory_gb"] == 80.0
    assert any(line.startswith("default: cluster.gpu_memory_gb = 80 (verl has no GPU memory key") for line in m.report())
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(m.tree))
    local = ["actor.load_hf=null", "data.path=examples/math_tiny/train.jsonl", "data.val_files=null",
             "trainer.epochs=null"]  # the stand-in file is smaller than one of verl's batches
    local += [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in QWEN3_MOE.items()]
    cfg, problems = collect_job_config(str(path), local, world_size="cluster")
    assert problems == [], problems
    assert cfg.actor.bf16 and cfg.actor.use_distributed_optimizer  # what megatron's offload needs
    on = memory_plan(memory_job(cfg, 8), MemoryOptions(prompt_length=2048, params_bytes=2, optimizer_offload_fraction=1.0))
    off = memory_plan(memory_job(cfg, 8), MemoryOptions(prompt_length=2048, params_bytes=2))
    for a, b in zip(on.stages, off.stages):
        # megatron's HybridDeviceOptimizer: fp32 main + 2 moments (12 B) leave the GPU; the host holds them and an
        # fp32 gradient copy (16 B) per optimizer element
        assert a.optimizer == 0 and b.optimizer > 0 and a.host == b.optimizer * 16 / 12
        assert a.total("none", False) == b.total("none", False) - b.optimizer


def test_verls_offload_flags_of_the_deepseek_v3_job():
    m = migrate_verl(DSV3_OFFLOAD)
    assert m.tree["actor"] == {"ref_param_offload": True}
    for what in ("param", "grad", "optimizer"):
        e = _entry(m, f"actor_rollout_ref.actor.megatron.{what}_offload")
        assert e.kind == NO_MEANING and "train step's peak is the same" in e.detail and "docs/memory.md" in e.detail
        assert e.detail in "\n".join(m.report())


def test_offload_without_a_fraction_offloads_nothing_in_megatron():
    """megatron's optimizer_offload_fraction defaults to 0: verl's optimizer_cpu_offload alone moves nothing."""
    tree = {"actor_rollout_ref": {"actor": {"strategy": "megatron", "optim": {
        "override_optimizer_config": {"optimizer_cpu_offload": True}}}}}
    assert migrate_verl(tree).tree["actor"] == {"optimizer_cpu_offload": False}

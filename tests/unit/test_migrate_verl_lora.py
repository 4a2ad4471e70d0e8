"""``migrate verl`` of verl's LoRA keys (verl 0.9.1's hf_model.yaml: the FSDP keys ``model.lora_rank`` /
``lora_alpha`` / ``target_modules``, and the Megatron actor's ``model.lora.*``): each maps to ``actor.lora`` /
``rollout.lora_sync`` as verl means it, read off verl's config comments by hand (``lora.merge: false`` loads
separate adapters; rank 0 is off; ``all-linear`` is PEFT's every linear layer); settings without a counterpart
are reported (Megatron-Bridge's xavier init of A, DoRA)."""
from __future__ import annotations

import copy
import os

from megatron_rl.config.load import yaml_load
from megatron_rl.config.migrate_verl import UNCHANGED, migrate_verl
from megatron_rl.config.verl_keys import MAPPED, UNSUPPORTED
from megatron_rl.lora.config import LoraConfig

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "verl")
M = "actor_rollout_ref.model"


def _load(name):
    with open(os.path.join(DATA, name)) as fh:
        return yaml_load(fh)


def _entry(m, key):
    [e] = [e for e in m.entries if e.key == key]
    return e


def test_megatron_lora_keys_map():
    verl = copy.deepcopy(_load("grpo_qwen2_7b_math_megatron.yaml"))
    lora = verl["actor_rollout_ref"].setdefault("model", {}).setdefault("lora", {})
    lora.update(rank=16, alpha=32, dropout=0.05, target_modules=["linear_qkv", "linear_fc2"], merge=False,
                lora_A_init_method="kaiming", type="lora")
    m = migrate_verl(verl)
    assert m.tree["actor"]["lora"] == {"rank": 16, "alpha": 32, "dropout": 0.05,
                                       "target_modules": ["linear_qkv", "linear_fc2"]}
    assert m.tree["rollout"]["lora_sync"] == "adapter"  # merge: false -> separate adapters
    assert LoraConfig.from_dict(m.tree["actor"]["lora"]).mcore_targets()  # a valid actor.lora section
    assert _entry(m, f"{M}.lora.type").kind == UNCHANGED and _entry(m, f"{M}.lora.lora_A_init_method").kind == UNCHANGED
    lora.update(merge=True, lora_A_init_method="xavier", type="dora")
    m = migrate_verl(verl)
    assert m.tree["rollout"]["lora_sync"] == "merged"
    assert _entry(m, f"{M}.lora.lora_A_init_method").kind == UNSUPPORTED
    assert _entry(m, f"{M}.lora.type").kind == UNSUPPORTED


def test_fsdp_lora_keys_map():
    verl = copy.deepcopy(_load("dapo_minimal.yaml"))
    verl["actor_rollout_ref"].setdefault("model", {}).update(lora_rank=8, lora_alpha=16, target_modules="all-linear")
    m = migrate_verl(verl)
    assert m.tree["actor"]["lora"] == {"rank": 8, "alpha": 16, "target_modules": ["all-linear"]}
    assert _entry(m, f"{M}.lora_rank").kind == MAPPED
    verl["actor_rollout_ref"]["model"].update(exclude_modules=["o_proj"])
    assert _entry(migrate_verl(verl), f"{M}.exclude_modules").kind == UNSUPPORTED


def test_rank_zero_sets_nothing():
    m = migrate_verl(_load("ppo_megatron_trainer.yaml"))  # verl's generated defaults: rank 0, alpha, merge ...
    assert "lora" not in m.tree.get("actor", {}) and "lora_sync" not in m.tree.get("rollout", {})
    assert _entry(m, f"{M}.lora_alpha").kind == UNCHANGED and _entry(m, f"{M}.lora.merge").kind == UNCHANGED


def test_verl_megatron_lora_example_migrates_to_a_config_the_plan_takes():
    """verl's own Megatron LoRA example (lora.merge left at verl's default, false; the reference offloaded): the
    migrated LoRA and sync settings are ones the plan takes (adapter-only sync to SGLang; the routed experts it
    adapts are refused there, naming the key to change), and with LoRA verl's reference offload has no meaning (the
    reference is the policy itself) instead of becoming a refused actor.ref_param_offload."""
    from megatron_rl.config.load import build_job_config
    from megatron_rl.config.migrate_verl import with_verl_defaults
    from megatron_rl.plan.lora import lora_errors
    from megatron_rl.trainer.sync_settings import settings_of

    tree, _ = with_verl_defaults(_load("grpo_qwen3moe_30b_megatron_lora.yaml"))
    m = migrate_verl(tree)
    assert m.tree["actor"]["lora"]["rank"] == 32 and m.tree["actor"]["lora"]["alpha"] == 64
    assert m.tree["rollout"]["lora_sync"] == "adapter" and m.tree["rollout"]["engine"] == "sglang"
    job, _ = build_job_config(m.tree)
    assert settings_of(job.rollout, job.trainer.run_dir, job.actor.lora).lora.mode == "adapter"  # no problem
    assert not job.actor.ref_param_offload
    assert not any("ref_param_offload" in e for e in lora_errors(job)), lora_errors(job)
    ref = _entry(m, "actor_rollout_ref.ref.megatron.param_offload")
    assert ref.kind != MAPPED and "adapters off" in ref.detail and "ref_param_offload" not in m.tree["actor"]


def test_verl_lora_freeze_defaults_migrate_and_unfreezing_is_refused():
    """verl's Megatron-Bridge LoRA defaults (freeze_language_model / freeze_vision_model / freeze_vision_projection:
    true) are what a LoRA job here does -- the base frozen, no vision tower -- so verl's own LoRA example migrates
    without a refusal on them; false (training the base or a vision tower beside the adapters) is refused."""
    from megatron_rl.config.migrate_verl import with_verl_defaults

    tree, _ = with_verl_defaults(_load("grpo_qwen3moe_30b_megatron_lora.yaml"))
    keys = [f"{M}.lora.freeze_language_model", f"{M}.lora.freeze_vision_model", f"{M}.lora.freeze_vision_projection"]
    m = migrate_verl(tree)
    for key in keys:
        assert _entry(m, key).kind == UNCHANGED, (key, _entry(m, key))
    for key in keys:
        bad = copy.deepcopy(tree)
        bad["actor_rollout_ref"]["model"]["lora"][key.rsplit(".", 1)[1]] = False
        assert _entry(migrate_verl(bad), key).kind == UNSUPPORTED, key


def test_an_unknown_fsdp_lora_key_is_refused_without_saying_lora_is_unsupported():
    verl = copy.deepcopy(_load("dapo_minimal.yaml"))
    verl["actor_rollout_ref"].setdefault("model", {}).update(lora_rank=8, lora_alpha=16, lora_unknown_option=1)
    e = _entry(migrate_verl(verl), f"{M}.lora_unknown_option")
    assert e.kind == UNSUPPORTED and "not supported" not in e.detail and "without a counterpart" in e.detail, e

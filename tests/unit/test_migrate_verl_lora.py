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

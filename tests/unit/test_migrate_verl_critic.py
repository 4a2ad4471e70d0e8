"""``migrate verl`` of verl's own PPO run scripts (examples/ppo_trainer/run_qwen2-7b_rm.sh,
run_deepseek7b_llm.sh at verl 0.9.1): the critic keys that change what a step does are carried or said, never
dropped as "worker settings" -- the critic's mini-batches (verl's critic.ppo_mini_batch_size defaults to the
actor's), its learning-rate warm-up and schedule; a critic model other than the actor's is critic.load_hf."""
from __future__ import annotations

import pytest

from megatron_rl.config.migrate_verl import UNCHANGED, migrate_verl, with_verl_defaults
from megatron_rl.config.verl_keys import MAPPED, UNSUPPORTED

#: the overrides of verl's examples/ppo_trainer/run_qwen2-7b_rm.sh that concern the critic (copied by hand)
QWEN2_RM = {
    "algorithm": {"adv_estimator": "gae", "use_kl_in_reward": False},
    "data": {"train_batch_size": 1024, "max_prompt_length": 1024, "max_response_length": 512},
    "actor_rollout_ref": {"model": {"path": "Qwen/Qwen2-7B-Instruct"},
                          "actor": {"optim": {"lr": 1e-6, "lr_warmup_steps_ratio": 0.1},
                                    "ppo_mini_batch_size": 256, "ppo_micro_batch_size_per_gpu": 16}},
    "critic": {"optim": {"lr": 1e-5, "lr_warmup_steps_ratio": 0.05},
               "model": {"path": "Qwen/Qwen2-7B-Instruct", "use_remove_padding": True},
               "ppo_micro_batch_size_per_gpu": 32},
    "trainer": {"critic_warmup": 0},
}


def _entry(m, key):
    [e] = [e for e in m.entries if e.key == key]
    return e


def _migrate(cfg):
    return migrate_verl(with_verl_defaults(cfg, "0.9.1")[0], version="0.9.1")


def _with(**critic):
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in QWEN2_RM.items()}
    cfg["critic"] = {**QWEN2_RM["critic"], **critic}
    return cfg


def test_critic_mini_batches_follow_verls_default_the_actors():
    """verl: critic.ppo_mini_batch_size = ${actor.ppo_mini_batch_size} -> 1024 / 256 = 4 critic optimizer steps."""
    m = _migrate(QWEN2_RM)
    assert m.tree["critic"]["ppo_mini_batches"] == 4
    assert _entry(m, "critic.ppo_mini_batch_size").kind == MAPPED


def test_critic_own_mini_batch_size():
    m = _migrate(_with(ppo_mini_batch_size=512))
    assert m.tree["critic"]["ppo_mini_batches"] == 2


def test_critic_warmup_ratio_and_schedule_are_carried():
    m = _migrate(_with(optim={"lr": 1e-5, "lr_warmup_steps_ratio": 0.05, "betas": [0.9, 0.95],
                                  "min_lr_ratio": 0.1, "lr_scheduler_type": "cosine"}))
    c = m.tree["critic"]
    assert c["lr_warmup_fraction"] == 0.05
    assert (c["adam_beta1"], c["adam_beta2"]) == (0.9, 0.95)
    assert c["min_lr"] == pytest.approx(1e-6) and c["lr_decay_style"] == "cosine"
    assert "lr_warmup_fraction" not in m.tree.get("actor", {}) or m.tree["actor"]["lr_warmup_fraction"] == 0.1


def test_critic_model_path_same_as_actor_is_unchanged_other_is_critic_load_hf():
    same = _migrate(QWEN2_RM)
    assert _entry(same, "critic.model.path").kind == UNCHANGED
    assert "load_hf" not in same.tree.get("critic", {})
    other = _migrate(_with(model={"path": "/models/qwen2-rm-value"}))
    assert _entry(other, "critic.model.path").kind == MAPPED
    assert other.tree["critic"]["load_hf"] == "/models/qwen2-rm-value"


@pytest.mark.parametrize("critic,key", [({"model": {"path": "Qwen/Qwen2-7B-Instruct", "lora_rank": 8}},
                                         "critic.model.lora_rank"),
                                        ({"shuffle": True}, "critic.shuffle")])
def test_critic_keys_that_change_its_training_are_said(critic, key):
    """A LoRA critic and shuffled critic mini-batches are not built: said (not carried), never dropped."""
    m = _migrate(_with(**critic))
    assert _entry(m, key).kind == UNSUPPORTED


def test_critic_keys_without_a_critic_say_nothing():
    """A GRPO recipe's critic block (verl's defaults, e.g. shuffle = the actor's) trains nothing in verl either."""
    grpo = _with(shuffle=True, model={"path": "other/model", "lora_rank": 8})
    grpo["algorithm"] = {"adv_estimator": "grpo"}
    m = _migrate(grpo)
    for key in ("critic.shuffle", "critic.model.lora_rank", "critic.model.path"):
        assert _entry(m, key).kind == UNCHANGED, key

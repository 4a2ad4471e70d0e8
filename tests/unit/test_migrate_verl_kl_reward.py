"""``megatron-rl migrate verl`` maps verl's KL in the reward (``algorithm.use_kl_in_reward``, ``kl_penalty``,
``kl_ctrl.*``) instead of refusing it; the migrated job's plan holds the controller verl would build.

The expected values are verl 0.9.1's semantics read off its config (``algorithm.kl_ctrl`` is
``verl.trainer.config.KLControlConfig``: type, kl_coef, horizon, target_kl; ``kl_penalty`` names the estimator
of ``core_algos.kl_penalty``; all of it has no effect while ``use_kl_in_reward`` is false).
"""
from __future__ import annotations

import os

import yaml

from megatron_rl.plan import collect_job_config
from megatron_rl.config.load import yaml_load
from megatron_rl.config.migrate_verl import UNCHANGED, merge_overrides, migrate_verl
from megatron_rl.config.verl_keys import MAPPED, UNSUPPORTED
from megatron_rl.plan import JobPlan

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "verl")


def _entry(m, key):
    [e] = [e for e in m.entries if e.key == key]
    return e


def _load(name):
    with open(os.path.join(DATA, name)) as fh:
        return yaml_load(fh)


def _algo(**kw):
    return {"algorithm": {"adv_estimator": "grpo", **kw}}


def test_kl_in_reward_keys_map():
    m = migrate_verl(_algo(use_kl_in_reward=True, kl_penalty="low_var_kl",
                           kl_ctrl={"_target_": "verl.trainer.config.KLControlConfig", "type": "adaptive",
                                    "kl_coef": 0.02, "horizon": 500, "target_kl": 0.05}))
    a = m.tree["algorithm"]
    assert a["use_kl_in_reward"] is True and a["kl_penalty"] == "low_var_kl"
    assert a["kl_ctrl"] == {"type": "adaptive", "kl_coef": 0.02, "horizon": 500, "target_kl": 0.05}
    for k in ("algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl.type",
              "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.target_kl"):
        assert _entry(m, k).kind == MAPPED, k


def test_off_carries_nothing_and_full_is_refused():
    m = migrate_verl(_algo(use_kl_in_reward=False, kl_penalty="full", kl_ctrl={"type": "adaptive", "kl_coef": 0.3}))
    assert "use_kl_in_reward" not in m.tree.get("algorithm", {}) and "kl_ctrl" not in m.tree.get("algorithm", {})
    assert all(_entry(m, k).kind == UNCHANGED for k in ("algorithm.use_kl_in_reward", "algorithm.kl_penalty",
                                                        "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef"))
    m = migrate_verl(_algo(use_kl_in_reward=True, kl_penalty="full"))
    e = _entry(m, "algorithm.kl_penalty")
    assert e.kind == UNSUPPORTED and "NotImplementedError" in e.detail


def test_migrated_recipe_plans_verls_controller(tmp_path):
    """A verl Megatron recipe turned to KL in the reward with an adaptive controller, over verl's generated trainer
    config: the migrated job passes check and its plan's controller is verl's (type, initial beta, target,
    horizon; the estimator)."""
    verl = merge_overrides(_load("ppo_megatron_trainer.yaml"), _load("grpo_qwen2_7b_math_megatron.yaml"))
    verl = merge_overrides(verl, _algo(use_kl_in_reward=True, kl_penalty="mse",
                                       kl_ctrl={"type": "adaptive", "kl_coef": 0.01, "target_kl": 0.2}))
    m = migrate_verl(verl)
    out = tmp_path / "job.yaml"
    out.write_text(yaml.safe_dump(m.tree))
    local = ["actor.load_hf=null", "data.path=examples/math_tiny/train.jsonl", "trainer.epochs=null",
             "data.val_files=examples/math_tiny/train.jsonl", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
             "model.num_attention_heads=4", "model.vocab_size=256"]
    cfg, problems = collect_job_config(str(out), local, world_size="cluster")
    assert problems == [], problems
    plan = JobPlan.build(cfg, cfg.cluster.world_size)
    k = plan.kl_in_reward
    assert k.kl_penalty == "mse" and k.controller.type == "adaptive"
    assert (k.controller.value, k.controller.target, k.controller.horizon) == (0.01, 0.2, 10000)  # verl's horizon
    assert any(line.startswith("KL in the reward: mse, adaptive from beta 0.01") for line in plan.describe())

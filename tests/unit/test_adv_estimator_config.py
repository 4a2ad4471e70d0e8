"""``algorithm.adv_estimator`` in a job: verl's spellings beside the project's (a conflict is an error naming both),
``gamma`` / ``lam``, the estimators the trainer refuses (named key and reason), ``migrate verl``'s mapping, and the
trainer's ``Estimator`` against verl 0.9.1's own function on the token-level rewards verl's reward manager builds
(the score on the last response token).

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_adv_estimator_config.py -q``
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.algo.estimator import AlgoParams, Estimator
from megatron_rl.config import ConfigError
from megatron_rl.plan import load_job_config
from megatron_rl.config.migrate_verl import UNCHANGED, migrate_verl
from megatron_rl.config.verl_keys import MAPPED, UNSUPPORTED
from tests.verl_core_algos import AlgoCfg, verl_core_algos

MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.vocab_size=64"]


def _cfg(*overrides):
    return load_job_config(None, MODEL + list(overrides), world_size=1)


def test_verl_spellings_and_gamma_lam():
    cfg = _cfg("algorithm.adv_estimator=reinforce_plus_plus", "algorithm.norm_adv_by_std_in_grpo=false",
               "algorithm.gamma=0.9", "algorithm.lam=0.5")
    a = cfg.algorithm
    assert (a.advantage_estimator, a.norm_adv_by_std, a.gamma, a.lam) == ("reinforce_plus_plus", False, 0.9, 0.5)
    # both spellings, same value: fine
    assert _cfg("algorithm.adv_estimator=rloo", "algorithm.advantage_estimator=rloo").algorithm.advantage_estimator \
        == "rloo"


@pytest.mark.parametrize("overrides, match", [
    (["algorithm.adv_estimator=rloo", "algorithm.advantage_estimator=grpo"],
     r"algorithm\.adv_estimator: 'rloo' conflicts with algorithm\.advantage_estimator: 'grpo'"),
    (["algorithm.norm_adv_by_std_in_grpo=false", "algorithm.norm_adv_by_std=true"],
     r"algorithm\.norm_adv_by_std_in_grpo: False conflicts with algorithm\.norm_adv_by_std: True"),
    (["algorithm.adv_estimator=gae", "critic.enable=false"],
     r"critic\.enable: false, but algorithm\.advantage_estimator: gae needs the critic's values"),
    (["algorithm.adv_estimator=remax", "multi_turn.env=megatron_rl.envs.tool_env:ToolEnvironment"],
     r"algorithm\.adv_estimator: 'remax' with multi_turn\.env"),
    (["algorithm.adv_estimator=gdpo"], r"algorithm\.gdpo_reward_keys: required with adv_estimator gdpo"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a, b]", "algorithm.gdpo_reward_weights=[1.0]"],
     r"algorithm\.gdpo_reward_weights: 1 weights for 2 gdpo_reward_keys"),
    (["algorithm.gdpo_reward_keys=[a]"], r"algorithm\.gdpo_reward_keys / gdpo_reward_weights: read by adv_estimator "
                                         r"gdpo only, not 'grpo'"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a]", "algorithm.norm_adv_by_std_in_grpo=false"],
     r"false has no effect on 'gdpo'"),
    (["algorithm.adv_estimator=ppo"], r"algorithm\.adv_estimator: 'ppo' is not one of gae, grpo"),
    (["algorithm.adv_estimator=grpo_vectorized", "algorithm.norm_adv_by_std_in_grpo=false"],
     r"algorithm\.norm_adv_by_std_in_grpo: false has no effect on 'grpo_vectorized'"),
    (["algorithm.adv_estimator=opo", "rollout.n_samples_per_prompt=1"], r"opo needs >= 2 samples per prompt"),
    (["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.filter_groups.enable=true"],
     r"algorithm\.filter_groups\.on_exhausted: 'train' .* whitens over the batch"),
    (["algorithm.adv_estimator=remax", "algorithm.filter_groups.enable=true"],
     r"algorithm\.filter_groups\.on_exhausted: 'train' .*='remax' subtracts the greedy response's reward"),
    (["algorithm.gamma=1.5"], r"algorithm\.gamma: must be in \[0, 1\]"),
])
def test_refused_before_any_process_group(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(*overrides)


def test_reinforce_plus_plus_needs_one_sample_only():
    assert _cfg("algorithm.adv_estimator=reinforce_plus_plus",
                "rollout.n_samples_per_prompt=1").algorithm.advantage_estimator == "reinforce_plus_plus"


def _verl_job(algorithm):
    return {"actor_rollout_ref": {"actor": {}, "rollout": {"n": 4}}, "algorithm": algorithm}


def _entry(m, key):
    [e] = [e for e in m.entries if e.key == key]
    return e


def test_migrate_maps_estimators_and_parameters():
    m = migrate_verl(_verl_job({"adv_estimator": "reinforce_plus_plus", "gamma": 0.95, "lam": 0.9,
                                "norm_adv_by_std_in_grpo": False}))
    a = m.tree["algorithm"]
    assert (a["advantage_estimator"], a["gamma"], a["lam"], a["norm_adv_by_std"]) == \
        ("reinforce_plus_plus", 0.95, 0.9, False)
    assert _entry(m, "algorithm.adv_estimator").kind == MAPPED
    assert _entry(migrate_verl(_verl_job({"adv_estimator": "remax"})), "algorithm.adv_estimator").kind == MAPPED
    g = migrate_verl(_verl_job({"adv_estimator": "gdpo", "gdpo_reward_keys": ["fmt", "acc"],
                                "gdpo_reward_weights": [0.5, 1.0]}))
    assert g.tree["algorithm"]["gdpo_reward_keys"] == ["fmt", "acc"]
    assert g.tree["algorithm"]["gdpo_reward_weights"] == [0.5, 1.0]
    cfg = _cfg(*[f"algorithm.{k}={v}" for k, v in g.tree["algorithm"].items() if k != "rollout_correction"])
    assert cfg.algorithm.advantage_estimator == "gdpo"
    assert _entry(migrate_verl(_verl_job({"adv_estimator": "gae"})), "algorithm.adv_estimator").kind == MAPPED
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):   # sum pi^2 from the log-prob pass
        assert _entry(migrate_verl(_verl_job({"adv_estimator": name})), "algorithm.adv_estimator").kind == MAPPED
        assert _cfg(f"algorithm.adv_estimator={name}").algorithm.advantage_estimator == name
    j = _verl_job({"adv_estimator": "optimal_token_baseline"})
    j["actor_rollout_ref"]["actor"]["calculate_sum_pi_squared"] = True   # verl asserts it with these estimators
    e = _entry(migrate_verl(j), "actor_rollout_ref.actor.calculate_sum_pi_squared")
    assert e.kind != UNSUPPORTED and "whenever algorithm.adv_estimator needs it" in e.detail
    e = _entry(migrate_verl(_verl_job({"adv_estimator": "grpo_vectorized", "norm_adv_by_std_in_grpo": False})),
               "algorithm.norm_adv_by_std_in_grpo")
    assert e.kind == UNCHANGED and "always divides by the std" in e.detail   # no meaning in verl: not carried


def _rows(seed, B=8, T=10):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T - 2, (B,), generator=g)
    start = 2   # prompt tokens before the response (mask 0)
    mask = ((torch.arange(T)[None] >= start) & (torch.arange(T)[None] < start + lengths[:, None])).float()
    mask[1, 4] = 0.0   # a rejected token inside a row
    mask[2] = 0.0      # a fully rejected row
    rewards = torch.randint(0, 2, (B,), generator=g).float() + 0.1 * torch.randn(B, generator=g)
    groups = torch.arange(B) // 4
    return rewards, groups, mask


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gpg",
                                  "rloo_vectorized", "grpo_vectorized", "grpo_passk"])
@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_trainer_estimator_is_verls_on_last_token_rewards(name, gamma):
    rewards, groups, mask = _rows(3)
    B, T = mask.shape
    tlr = torch.zeros(B, T)   # verl's reward manager: the score on each row's last response token
    for b in range(B):
        idx = torch.nonzero(mask[b]).flatten()
        if idx.numel():
            tlr[b, idx[-1]] = rewards[b]
    with verl_core_algos() as verl:
        kw = dict(token_level_rewards=tlr, response_mask=mask.clone(), index=groups.numpy(),
                  config=AlgoCfg(gamma=gamma, lam=1.0, norm_adv_by_std_in_grpo=True))
        want, _ = verl.get_adv_estimator_fn(name)(**kw)
    got = Estimator(name, AlgoParams(gamma=gamma)).advantages(rewards, groups, mask)
    assert got.dtype == torch.float32 and got.shape == (B, T)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("with_is", [False, True])
def test_trainer_optimal_token_baseline_is_verls(name, with_is):
    """The step's call (``policy_inputs``: the loss's old log-probs, the pass's sum pi^2, the IS weights) is verl's
    ``compute_advantage`` call of the same estimator."""
    rewards, groups, mask = _rows(5)
    B, T = mask.shape
    g = torch.Generator().manual_seed(7)
    old = -2.0 * torch.rand(B, T, generator=g)
    spp = 0.1 + 0.8 * torch.rand(B, T, generator=g)
    w = 0.5 + torch.rand(B, T, generator=g) if with_is else None
    tlr = torch.zeros(B, T)
    for b in range(B):
        idx = torch.nonzero(mask[b]).flatten()
        if idx.numel():
            tlr[b, idx[-1]] = rewards[b]
    with verl_core_algos() as verl:
        want, _ = verl.get_adv_estimator_fn(name)(
            token_level_rewards=tlr, response_mask=mask.clone(), index=groups.numpy(), config=AlgoCfg(gamma=1.0),
            old_log_probs=old, sum_pi_squared=spp, rollout_is_weights=w)
    est = Estimator(name, AlgoParams())
    assert est.needs_sum_pi_squared and est.reads_token_rewards
    got = est.advantages(rewards, groups, mask, **est.policy_inputs(old, spp, w))
    torch.testing.assert_close(got, (want * mask).float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="compute_sum_pi_squared=True"):
        est.policy_inputs(old, None, w)
    assert Estimator("grpo", AlgoParams()).policy_inputs(old, spp, w) == {}

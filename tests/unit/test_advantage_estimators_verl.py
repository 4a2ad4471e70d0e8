"""Every advantage estimator of ``megatron_rl.algo`` against verl 0.9.1's OWN registered function
(``core_algos.get_adv_estimator_fn(name)``, the unchanged file vendored under ``tests/data/verl/core_algos/`` and run
through ``tests/verl_core_algos.py``) on the same random tensors: uneven lengths, masked (empty) rows, masked tokens
inside a row (multi-turn observations), single-sample groups, all-equal groups. Advantages and returns must agree
within float32 tolerance.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_advantage_estimators_verl.py -q``
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.algo import VERL_ESTIMATORS, advantage_fn
from megatron_rl.algo.gae import compute_gae_advantage_return
from tests.verl_core_algos import AlgoCfg, verl_core_algos


@pytest.fixture(scope="module")
def verl():
    with verl_core_algos() as ca:
        yield ca


def make(seed: int, B: int = 12, T: int = 9, holes: bool = True):
    """Rewards, values and a right-padded mask with uneven lengths, one empty row, and (``holes``) masked tokens
    inside rows (observation spans); the reward sits on each row's last response token, plus dense noise."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[3] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    if holes:
        mask = mask * (torch.rand(B, T, generator=g) > 0.2).float()
        mask[0, :2] = 1.0
    rewards = torch.zeros(B, T)
    last = (lengths - 1).clamp(min=0)
    rewards[torch.arange(B), last] = torch.randint(0, 3, (B,), generator=g).float()
    dense = 0.1 * torch.randn(B, T, generator=g) * mask
    values = torch.randn(B, T, generator=g)
    return rewards, dense, values, mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae(verl, seed, gamma, lam):
    rewards, dense, values, mask = make(seed)
    r = rewards + dense
    want = verl.get_adv_estimator_fn("gae")(token_level_rewards=r.clone(), values=values.clone(),
                                             response_mask=mask.clone(), gamma=gamma, lam=lam)
    got = compute_gae_advantage_return(token_level_rewards=r, values=values, response_mask=mask, gamma=gamma, lam=lam)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def groups_for(B: int, seed: int):
    """uid labels (strings, as verl's ``index``): group sizes 1..4 in shuffled order, incl. single-sample groups."""
    rng = np.random.default_rng(seed)
    labels, g = [], 0
    while len(labels) < B:
        labels += [f"uid-{g}"] * int(rng.integers(1, 5))
        g += 1
    labels = np.array(labels[:B], dtype=object)
    return labels[rng.permutation(B)]


def all_equal_group(rewards, index):
    """Make the first row's group score alike (an all-equal group)."""
    rows = np.nonzero(index == index[0])[0]
    rewards[rows] = 0.0
    rewards[rows, 0] = 1.0
    return rewards


OUTCOME = ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg", "reinforce_plus_plus_baseline",
           "gdpo", "grpo_passk"]


def _case(seed, holes, name):
    rewards, dense, values, mask = make(seed, holes=holes)
    B = rewards.shape[0]
    index = groups_for(B, seed)
    if name == "grpo_passk":   # verl refuses groups of one: pair every row
        index = np.array([f"uid-{i // 3}" for i in range(B)], dtype=object)
    rewards = all_equal_group(rewards, index)
    return rewards, dense, values, mask, index


def _compare(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("name", OUTCOME)
@pytest.mark.parametrize("seed,holes", [(0, False), (1, True), (2, False), (3, True)])
@pytest.mark.parametrize("norm", [True, False])
def test_outcome_estimators(verl, name, seed, holes, norm):
    rewards, _, _, mask, index = _case(seed, holes, name)
    kw = dict(response_mask=mask, index=index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm,
              config=AlgoCfg(gamma=1.0, norm_adv_by_std_in_grpo=norm))
    want = verl.get_adv_estimator_fn(name)(token_level_rewards=rewards.clone(), **{**kw, "response_mask": mask.clone()})
    got = advantage_fn(name)(token_level_rewards=rewards.clone(), **kw)
    _compare(got, want)


def test_gdpo_components(verl):
    """GDPO with per-component rewards (``gdpo_reward_keys`` / weights read from the batch, as verl's trainer
    passes them)."""
    rewards, _, _, mask, index = _case(5, True, "gdpo")
    B, T = mask.shape
    g = torch.Generator().manual_seed(5)
    ntb = {"fmt": torch.randint(0, 2, (B,), generator=g).float().numpy(),
           "acc": torch.randint(0, 3, (B,), generator=g).float().numpy()}
    batch = {"prompts": torch.zeros(B, 4, dtype=torch.long),
             "attention_mask": torch.cat([torch.ones(B, 4), mask], dim=1).long()}
    for weights in (None, [0.3, 2.0]):
        cfg = AlgoCfg(gdpo_reward_keys=["fmt", "acc"], gdpo_reward_weights=weights)
        kw = dict(response_mask=mask, index=index, config=cfg, non_tensor_batch=ntb, batch=batch)
        _compare(advantage_fn("gdpo")(token_level_rewards=rewards.clone(), **kw),
                 verl.get_adv_estimator_fn("gdpo")(token_level_rewards=rewards.clone(), **kw))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(verl, seed, gamma):
    rewards, dense, _, mask = make(seed)
    r = rewards + dense
    kw = dict(response_mask=mask, config=AlgoCfg(gamma=gamma))
    _compare(advantage_fn("reinforce_plus_plus")(token_level_rewards=r.clone(), **kw),
             verl.get_adv_estimator_fn("reinforce_plus_plus")(token_level_rewards=r.clone(), **kw))


@pytest.mark.parametrize("seed", range(3))
def test_remax(verl, seed):
    rewards, dense, _, mask = make(seed)
    base = torch.randint(0, 3, (rewards.shape[0],), generator=torch.Generator().manual_seed(seed)).float()
    kw = dict(response_mask=mask, reward_baselines=base, config=AlgoCfg(gamma=1.0))
    _compare(advantage_fn("remax")(token_level_rewards=rewards + dense, **kw),
             verl.get_adv_estimator_fn("remax")(token_level_rewards=rewards + dense, **kw))


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("seed,holes", [(0, False), (1, True), (2, True)])
@pytest.mark.parametrize("is_w,zero_tail", [(False, True), (True, True), (True, False)])
def test_optimal_token_baseline(verl, name, seed, holes, is_w, zero_tail):
    rewards, dense, _, mask, index = _case(seed, holes, name)
    B, T = mask.shape
    g = torch.Generator().manual_seed(100 + seed)
    old = -3.0 * torch.rand(B, T, generator=g)
    s2 = 0.05 + 0.9 * torch.rand(B, T, generator=g)
    w = 2.0 * torch.rand(B, T, generator=g) if is_w else None
    kw = dict(response_mask=mask, index=index, old_log_probs=old, sum_pi_squared=s2, rollout_is_weights=w,
              handle_zero_tail=zero_tail)
    _compare(advantage_fn(name)(token_level_rewards=rewards + dense, **kw),
             verl.get_adv_estimator_fn(name)(token_level_rewards=rewards + dense, **kw))


def test_every_verl_name_is_served(verl):
    assert sorted(VERL_ESTIMATORS) == sorted(verl.ADV_ESTIMATOR_REGISTRY)

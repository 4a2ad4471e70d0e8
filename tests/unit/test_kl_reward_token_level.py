"""KL in the reward with the estimators that read the rewards token by token (gae, reinforce_plus_plus, remax, the
optimal token baselines): the step's path (``KLInReward.estimator_rewards`` then the plan's ``Estimator``) against
verl 0.9.1 (``apply_kl_penalty``, transcribed in ``test_kl_reward.py`` over verl's own ``kl_penalty`` / controller /
``masked_mean``, then verl's registered estimator from the vendored ``core_algos.py``) over 4 steps of an adaptive
controller, with multi-turn holes in the mask, uneven lengths and an empty row.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_kl_reward_token_level.py -q``
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.algo.estimator import AlgoParams, Estimator
from megatron_rl.algo.kl_reward import KLControlConfig, NoKLInReward
from megatron_rl.config.sections import AlgorithmConfig
from megatron_rl.plan.kl_reward import build_kl_in_reward
from tests.unit.test_kl_reward import _verl_apply_kl_penalty
from tests.verl_core_algos import AlgoCfg, verl_core_algos

B, T, STEPS = 8, 11, 4


def _step(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T - 2, (B,), generator=g)
    lengths[5] = 0
    mask = ((torch.arange(T)[None] >= 2) & (torch.arange(T)[None] < 2 + lengths[:, None])).float()
    mask[1, 4:6] = 0.0   # an observation span (multi-turn) inside a row
    mask[6, 5] = 0.0
    rewards = torch.randint(0, 2, (B,), generator=g).float() + 0.1 * torch.randn(B, generator=g)
    old = -2.0 * torch.rand(B, T, generator=g)
    ref = old + 0.3 * torch.randn(B, T, generator=g)
    extra = dict(values=torch.randn(B, T, generator=g), reward_baselines=torch.rand(B, generator=g),
                 sum_pi_squared=0.1 + 0.8 * torch.rand(B, T, generator=g))
    return rewards, mask, old, ref, extra


def _verl_scores(rewards, mask):
    """verl's reward manager: the score on each row's last response token (index -1 for a row without one)."""
    s = torch.zeros(B, T)
    for b in range(B):
        idx = torch.nonzero(mask[b]).flatten()
        s[b, int(idx[-1]) if idx.numel() else -1] = rewards[b]
    return s


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "remax", "optimal_token_baseline",
                                  "tir_optimal_token_baseline"])
@pytest.mark.parametrize("penalty", ["low_var_kl", "kl"])
def test_token_level_estimators_get_verls_kl_penalised_rewards(name, penalty):
    ctrl = KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.01, horizon=30)
    ours = build_kl_in_reward(AlgorithmConfig(use_kl_in_reward=True, kl_penalty=penalty, kl_ctrl=ctrl,
                                              advantage_estimator=name))
    params = AlgoParams(gamma=0.9, lam=0.8)
    est = Estimator(name, params)
    assert est.reads_token_rewards
    groups = torch.arange(B) // 4
    with verl_core_algos() as ca:
        from verl.utils import torch_functional as verl_F   # the shim's vendored masked_mean
        vctrl = ca.get_kl_controller(AlgoCfg(type="adaptive", kl_coef=0.2, target_kl=0.01, horizon=30))
        betas = []
        for step in range(STEPS):
            rewards, mask, old, ref, extra = _step(10 * step + len(name))
            tlr_v, m_v = _verl_apply_kl_penalty(ca, verl_F.masked_mean, mask, _verl_scores(rewards, mask), old, ref,
                                                vctrl, penalty)
            kw = dict(token_level_rewards=tlr_v, response_mask=mask, index=groups.numpy(),
                      config=AlgoCfg(gamma=0.9, lam=0.8, norm_adv_by_std_in_grpo=True))
            if name == "gae":
                kw = dict(token_level_rewards=tlr_v, values=extra["values"], response_mask=mask, gamma=0.9, lam=0.8)
            elif name == "remax":
                kw["reward_baselines"] = extra["reward_baselines"]
            elif "optimal" in name:
                kw.update(old_log_probs=old, sum_pi_squared=extra["sum_pi_squared"], rollout_is_weights=None)
            want, _ = ca.get_adv_estimator_fn(name)(**kw)

            r, tlr, m = ours.estimator_rewards(rewards, old, ref, mask, mask, est.reads_token_rewards)
            inputs = ({"values": extra["values"]} if name == "gae" else
                      {"reward_baselines": extra["reward_baselines"]} if name == "remax" else
                      est.policy_inputs(old, extra["sum_pi_squared"], None))
            got = est.advantages(r, groups, mask, token_level_rewards=tlr, **inputs)
            torch.testing.assert_close(tlr, tlr_v.float(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got, (want * mask).float(), rtol=1e-5, atol=1e-5)
            assert m == pytest.approx(m_v, rel=1e-6)   # verl averages in float32
            betas.append(m["actor/reward_kl_penalty_coeff"])
    assert len(set(betas)) == STEPS   # the adaptive beta moved every step (the penalty is in the rewards)


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "optimal_token_baseline"])
def test_beta_zero_is_the_run_without_kl(name):
    """With kl_coef 0 the token-level path gives the advantages of the run without KL in the reward, also with a
    rejected last token (the scores sit where the estimator puts them: the loss mask's last token)."""
    rewards, mask, old, ref, extra = _step(3)
    loss_mask = mask.clone()
    loss_mask[0, int(torch.nonzero(mask[0]).flatten()[-1])] = 0.0
    est = Estimator(name, AlgoParams())
    inputs = est.policy_inputs(old, extra["sum_pi_squared"], None)
    k = build_kl_in_reward(AlgorithmConfig(use_kl_in_reward=True, kl_ctrl=KLControlConfig(kl_coef=0.0),
                                           advantage_estimator=name))
    r, tlr, _ = k.estimator_rewards(rewards, old, ref, mask, loss_mask, True)
    r0, none, m0 = NoKLInReward().estimator_rewards(rewards, old, ref, mask, loss_mask, True)
    assert none is None and m0 == {}
    groups = torch.arange(B) // 4
    torch.testing.assert_close(est.advantages(r, groups, loss_mask, token_level_rewards=tlr, **inputs),
                               est.advantages(r0, groups, loss_mask, **inputs), rtol=0, atol=1e-7)


class _Values:
    """A critic whose values are given (the critic's own value pass is tested in the critic's tests)."""

    def __init__(self, values):
        self.values = values

    def compute_values(self, rows):
        return self.values


def test_gae_with_the_critic_gets_verls_kl_penalised_rewards():
    """The critic's GAE (``trainer/critic_step.CriticPhase``) with KL in the reward, as the step wires it: the scores
    where GAE puts them (each row's last token), the penalty over the response mask; vs verl's apply_kl_penalty then
    verl's compute_gae_advantage_return, over 3 steps of an adaptive controller."""
    from types import SimpleNamespace

    from megatron_rl.trainer.critic_step import CriticPhase

    g = torch.Generator().manual_seed(11)
    plen = torch.tensor([2, 3, 1, 4, 2, 3, 2, 1])
    lengths = plen + torch.tensor([5, 2, 7, 3, 6, 4, 1, 8])   # prompt + response tokens
    W = int(lengths.max()) - 1
    cols = torch.arange(W)[None]
    mask = ((cols >= (plen - 1)[:, None]) & (cols <= (lengths - 2)[:, None])).float()
    rows = SimpleNamespace(num_rows=B, max_length=W + 1, lengths=lengths)
    cfg = SimpleNamespace(algorithm=SimpleNamespace(gamma=0.95, lam=0.9), critic=SimpleNamespace(critic_warmup=0))
    ctrl = KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.01, horizon=30)
    ours = build_kl_in_reward(AlgorithmConfig(use_kl_in_reward=True, kl_penalty="low_var_kl", kl_ctrl=ctrl,
                                              advantage_estimator="gae"))
    with verl_core_algos() as ca:
        from verl.utils import torch_functional as verl_F
        vctrl = ca.get_kl_controller(AlgoCfg(type="adaptive", kl_coef=0.1, target_kl=0.01, horizon=30))
        for _ in range(3):
            rewards = torch.randint(0, 2, (B,), generator=g).float()
            old = -2.0 * torch.rand(B, W, generator=g)
            ref = old + 0.3 * torch.randn(B, W, generator=g)
            values = torch.randn(B, W, generator=g)
            scores = torch.zeros(B, W)
            scores[torch.arange(B), lengths - 2] = rewards
            tlr_v, _ = _verl_apply_kl_penalty(ca, verl_F.masked_mean, mask, scores, old, ref, vctrl, "low_var_kl")
            want, want_ret = ca.compute_gae_advantage_return(tlr_v, values, mask, gamma=0.95, lam=0.9)
            phase = CriticPhase(_Values(values), cfg)
            r, tlr, _ = ours.estimator_rewards(rewards, old, ref, mask, mask, True,
                                               scores=phase.token_level_scores(rows, rewards))
            adv, ret, _ = phase.advantages(rows, r, mask, token_level_rewards=tlr)
            torch.testing.assert_close(adv, (want * mask).float(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ret, (want_ret * mask).float(), rtol=1e-5, atol=1e-5)
            adv0, _, _ = phase.advantages(rows, rewards, mask)   # the same rows without KL: different
            assert not torch.allclose(adv0, adv)

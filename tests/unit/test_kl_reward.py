"""KL in the reward (``megatron_rl.algo.kl_reward``) against verl 0.9.1's own functions.

verl's ``kl_penalty``, ``FixedKLController``, ``AdaptiveKLController``, ``get_kl_controller`` and
``verl_F.masked_mean`` run from the unchanged ``core_algos.py`` / ``torch_functional.py`` vendored under
``tests/data/verl/core_algos/`` (``tests/verl_core_algos.py``). ``apply_kl_penalty`` lives in verl 0.9.1's
``verl/trainer/ppo/ray_trainer.py``, which cannot be imported here (Ray, ``DataProto``): ``_verl_apply_kl_penalty``
below transcribes its body line by line, calling verl's own functions for every computation.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algo.kl_reward import (AdaptiveKLController, KLControlConfig, KLInReward, NoKLInReward,
                                        token_level_scores)
from megatron_rl.config.sections import AlgorithmConfig, FilterGroupsConfig
from megatron_rl.losses.kl import kl_penalty as our_kl_penalty
from megatron_rl.plan.checks import Unbuilt
from megatron_rl.plan.kl_reward import build_kl_in_reward
from megatron_rl.testing.distributed import run_ranks
from tests.verl_core_algos import AlgoCfg, verl_core_algos

PENALTIES = ("kl", "abs", "mse", "low_var_kl", "k3+")


def _verl_apply_kl_penalty(core_algos, masked_mean, response_mask, token_level_scores, old_log_probs, ref_log_prob,
                           kl_ctrl, kl_penalty):
    """verl 0.9.1 ``ray_trainer.apply_kl_penalty`` (the ``data.batch`` reads replaced by arguments)."""
    batch_size = response_mask.shape[0]
    kld = core_algos.kl_penalty(old_log_probs, ref_log_prob, kl_penalty=kl_penalty)
    kld = kld * response_mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, mask=response_mask, axis=-1)
    current_kl = torch.mean(current_kl, dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=batch_size)
    return token_level_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def _batch(gen, B=8, T=12, drift=0.3):
    """Log-probs of sampled tokens (old drifting from ref), uneven response lengths, one empty row, scores."""
    ref = -torch.rand(B, T, generator=gen) * 3
    old = (ref + drift * torch.randn(B, T, generator=gen)).clamp(max=0.0)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[1] = 0
    start = torch.randint(0, 3, (B,), generator=gen)
    cols = torch.arange(T)
    mask = ((cols >= start[:, None]) & (cols < (start + lengths)[:, None])).float()
    rewards = torch.randint(0, 2, (B,), generator=gen).float()
    return old, ref, mask, rewards


@pytest.mark.parametrize("penalty", PENALTIES)
@pytest.mark.parametrize("ctrl", ["fixed", "adaptive"])
def test_ten_steps_match_verl(penalty, ctrl):
    """token_level_rewards, both metrics and beta after each of 10 steps equal verl's (float32 tolerance)."""
    cfg = KLControlConfig(type=ctrl, kl_coef=0.05, target_kl=0.02, horizon=40)
    ours = KLInReward(penalty, cfg, our_kl_penalty)
    gen = torch.Generator().manual_seed(7)
    with verl_core_algos() as ca:
        import verl.utils.torch_functional as verl_F

        theirs = ca.get_kl_controller(AlgoCfg(type=ctrl, kl_coef=0.05, target_kl=0.02, horizon=40))
        betas = []
        for step in range(10):
            old, ref, mask, rewards = _batch(gen, drift=0.05 + 0.05 * step)
            scores = token_level_scores(rewards, mask)
            got, got_m = ours.apply(scores, old, ref, mask)
            want, want_m = _verl_apply_kl_penalty(ca, verl_F.masked_mean, mask, scores, old, ref, theirs, penalty)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            for k in want_m:
                assert got_m[k] == pytest.approx(want_m[k], rel=1e-6, abs=1e-9), (step, k)
            assert ours.controller.value == pytest.approx(float(theirs.value), rel=1e-6), step
            betas.append(ours.controller.value)
    if ctrl == "adaptive":  # the controller moved (both ways over the steps: the drift grows past the target)
        assert betas[0] != betas[-1] and len(set(betas)) == 10
    else:
        assert set(betas) == {0.05}


def test_token_level_scores_on_the_last_response_token():
    """verl puts the score on the response's last token; a row without response tokens gets it at the last column
    (verl's index -1), so every row's sum is its reward."""
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 1, 0]], dtype=torch.float32)
    r = torch.tensor([1.5, -2.0, 0.25, 3.0])
    s = token_level_scores(r, mask)
    want = torch.zeros(4, 5)
    want[0, 2], want[1, 4], want[2, 4], want[3, 3] = 1.5, -2.0, 0.25, 3.0
    assert torch.equal(s, want)
    assert torch.equal(s.sum(-1), r)


def test_sequence_rewards_are_score_minus_beta_kl_sum():
    """GRPO / RLOO get score - beta x sum over the response of kld (verl: token_level_rewards.sum(-1))."""
    gen = torch.Generator().manual_seed(3)
    old, ref, mask, rewards = _batch(gen)
    k = KLInReward("low_var_kl", KLControlConfig(kl_coef=0.1), our_kl_penalty)
    got, _ = k.sequence_rewards(rewards, old, ref, mask)
    x = (ref - old).double().clamp(-20, 20)  # Schulman's k3 in float64
    k3 = (x.exp() - x - 1).clamp(-10, 10)
    want = rewards.double() - 0.1 * (k3 * mask.double()).sum(-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(NoKLInReward().sequence_rewards(rewards, old, ref, mask)[0], rewards)


def _dp_rank(rank, world, old, ref, mask, scores):
    import torch.distributed as dist

    k = KLInReward("kl", KLControlConfig(type="adaptive", kl_coef=0.05, target_kl=0.02, horizon=40), our_kl_penalty)
    rows = slice(0, 3) if rank == 0 else slice(3, None)  # uneven: 3 and 5 rows
    out = []
    for _ in range(3):
        tlr, m = k.apply(scores[rows], old[rows], ref[rows], mask[rows], group=dist.group.WORLD)
        out.append((tlr, m, k.controller.value))
    return out


def test_current_kl_is_the_whole_batch_mean_over_dp_ranks():
    """Two DP ranks holding 3 and 5 rows step the controller as one process holding all 8 (current_kl: the mean
    over all sequences, batch size 8), not as a mean of per-rank means."""
    gen = torch.Generator().manual_seed(11)
    old, ref, mask, rewards = _batch(gen, drift=0.4)
    mask[0:3] *= (torch.arange(mask.shape[1]) < 3).float()  # rank 0's rows short: per-rank means would differ
    scores = token_level_scores(rewards, mask)
    single = KLInReward("kl", KLControlConfig(type="adaptive", kl_coef=0.05, target_kl=0.02, horizon=40),
                        our_kl_penalty)
    want = []
    for _ in range(3):
        tlr, m = single.apply(scores, old, ref, mask)
        want.append((tlr, m, single.controller.value))
    r0, r1 = run_ranks(_dp_rank, 2, old, ref, mask, scores, timeout=60)
    for (t0, m0, b0), (t1, m1, b1), (t, m, b) in zip(r0, r1, want):
        torch.testing.assert_close(torch.cat([t0, t1]), t)
        assert m0 == m1 and m0["actor/reward_kl_penalty"] == pytest.approx(m["actor/reward_kl_penalty"], rel=1e-12)
        assert b0 == b1 == pytest.approx(b, rel=1e-12)


def test_resume_keeps_the_adaptive_beta_and_says_what_changed():
    cfg = KLControlConfig(type="adaptive", kl_coef=0.05, target_kl=0.02, horizon=40)
    a = KLInReward("kl", cfg, our_kl_penalty)
    a.controller.update(current_kl=0.5, n_steps=8)
    saved = a.state_dict()
    b = KLInReward("kl", cfg, our_kl_penalty)
    assert b.load_state_dict(saved) is None and b.controller.value == a.controller.value != 0.05
    c = KLInReward("kl", KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.02, horizon=40), our_kl_penalty)
    said = c.load_state_dict(saved)
    assert c.controller.value == a.controller.value and "kl_coef 0.05 -> 0.2" in said
    f = KLInReward("kl", KLControlConfig(type="fixed", kl_coef=0.05), our_kl_penalty)
    said = f.load_state_dict(saved)
    assert f.controller.value == 0.05 and "type 'adaptive' -> 'fixed'" in said
    assert "no KL controller state" in KLInReward("kl", cfg, our_kl_penalty).load_state_dict(None)
    assert "not used" in NoKLInReward().load_state_dict(saved)


def test_adaptive_controller_is_verls_arithmetic():
    with verl_core_algos() as ca:
        for kl in (0.0, 0.019, 0.02, 0.021, 0.5, math.inf):
            v = ca.AdaptiveKLController(0.3, 0.02, 7)
            o = AdaptiveKLController(0.3, 0.02, 7)
            v.update(kl, 5)
            o.update(kl, 5)
            assert o.value == pytest.approx(float(v.value), rel=1e-15), kl


@pytest.mark.parametrize("change, key", [
    (dict(kl_penalty="full"), "algorithm.kl_penalty: 'full'"),
    (dict(kl_penalty="k4"), "algorithm.kl_penalty: 'k4'"),
    (dict(kl_ctrl=KLControlConfig(type="pid")), "algorithm.kl_ctrl.type"),
    (dict(kl_ctrl=KLControlConfig(type="adaptive", horizon=0)), "algorithm.kl_ctrl.horizon"),
    (dict(kl_ctrl=KLControlConfig(type="adaptive", target_kl=0.0)), "algorithm.kl_ctrl.target_kl"),
    (dict(kl_ctrl=KLControlConfig(kl_coef=-1.0)), "algorithm.kl_ctrl.kl_coef"),
    (dict(filter_groups=FilterGroupsConfig(enable=True)), "algorithm.use_kl_in_reward: not built with"),
    (dict(advantage_estimator="gdpo"), "algorithm.use_kl_in_reward: no effect with algorithm.adv_estimator 'gdpo'"),
])
def test_refusals_name_the_key(change, key):
    with pytest.raises(Unbuilt) as e:
        build_kl_in_reward(AlgorithmConfig(use_kl_in_reward=True, **change))
    assert any(p.startswith(key) for p in e.value.problems), e.value.problems
    assert build_kl_in_reward(AlgorithmConfig(use_kl_in_reward=False, **change)) is None  # off: verl ignores them


def _fake_dp_rank(rank, world, old, ref, mask, scores, backend):
    import torch.distributed as dist

    from megatron_rl.testing import fake_accelerator as fa

    fa.install()
    # an NCCL-like DP group (its device only) or gloo (host tensors only)
    group = dist.new_group(list(range(world)), backend=fa.BACKEND if backend == "fakeccl" else "gloo")
    dev = torch.device(fa.DEVICE, 0)
    k = build_kl_in_reward(AlgorithmConfig(use_kl_in_reward=True, kl_penalty="kl", kl_ctrl=KLControlConfig(
        type="adaptive", kl_coef=0.05, target_kl=0.02, horizon=40)))
    rows = slice(0, 3) if rank == 0 else slice(3, None)
    r, m = k.sequence_rewards(scores.sum(-1)[rows].to(dev), old[rows].to(dev), ref[rows].to(dev),
                              mask[rows].to(dev), group=group)
    return str(r.device), r.cpu(), m, k.controller.value


@pytest.mark.parametrize("backend", ["fakeccl", "gloo"])
def test_on_an_accelerator(backend):
    """The step's tensors on a device that is not the CPU, the DP group NCCL-like (refusing host tensors) or gloo
    (refusing device tensors): the rewards stay on the device and equal the CPU's single-process result (the
    plan's KLInReward stages its all-reduce on the group's device)."""
    gen = torch.Generator().manual_seed(5)
    old, ref, mask, rewards = _batch(gen, drift=0.3)
    scores = token_level_scores(rewards, mask)
    single = KLInReward("kl", KLControlConfig(type="adaptive", kl_coef=0.05, target_kl=0.02, horizon=40),
                        our_kl_penalty)
    want, want_m = single.sequence_rewards(rewards, old, ref, mask)
    out = run_ranks(_fake_dp_rank, 2, old, ref, mask, scores, backend, timeout=60)
    assert {o[0] for o in out} == {"fakegpu:0"}
    torch.testing.assert_close(torch.cat([o[1] for o in out]), want)
    for o in out:
        assert o[2]["actor/reward_kl_penalty"] == pytest.approx(want_m["actor/reward_kl_penalty"], rel=1e-12)
        assert o[3] == pytest.approx(single.controller.value, rel=1e-12)

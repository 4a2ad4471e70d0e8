"""Review of the estimators and KL in the reward against verl 0.9.1 (the vendored ``core_algos.py``) with the
settings of verl's own run scripts (``examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf.sh``,
``examples/remax_trainer/run_qwen2.5-3b_seq_balance.sh``: ``use_kl_in_reward=True``): the penalised token-level
rewards reach reinforce_plus_plus / remax as verl's ``apply_kl_penalty`` then its estimator (one process and 2
uneven DP ranks), the recipes' algorithm block migrates and builds; gdpo with the penalty refused; the summing
estimators read only each row's sum; a fully rejected group gets 0 (OPO's 0/0); whitening with < 2 kept tokens
raises as verl; the whole-batch reductions (estimators, critic) on an accelerator with an NCCL-like or gloo
group; migrate's note on KL with dynamic sampling; ``describe`` says the estimator and a defaulted KPop phi.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_kl_reward_token_estimators.py -q``
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.algo.estimator import AlgoParams, Estimator
from megatron_rl.algo.kl_reward import KLControlConfig, KLInReward, NoKLInReward, token_level_scores
from megatron_rl.config import ConfigError
from megatron_rl.plan import load_job_config
from megatron_rl.config.sections import AlgorithmConfig
from megatron_rl.config.migrate_verl import migrate_verl
from megatron_rl.config.verl_keys import UNSUPPORTED
from megatron_rl.losses.kl import kl_penalty as our_kl_penalty
from megatron_rl.plan.advantage import build_estimator
from megatron_rl.plan.checks import Unbuilt
from megatron_rl.plan.kl_reward import build_kl_in_reward
from megatron_rl.testing.distributed import run_ranks
from tests.unit.test_kl_reward import _verl_apply_kl_penalty
from tests.verl_core_algos import AlgoCfg, verl_core_algos

MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.vocab_size=64"]
CTRL = dict(type="adaptive", kl_coef=0.2, target_kl=0.02, horizon=40)
GAMMA = 0.9


def _batch(seed, B=8, T=9):
    g = torch.Generator().manual_seed(seed)
    ref = -torch.rand(B, T, generator=g) * 3
    old = (ref + 0.4 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[5] = 1
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    rewards = torch.randint(0, 2, (B,), generator=g).float() + 0.1 * torch.randn(B, generator=g)
    baselines = torch.rand(B, generator=g)
    return old, ref, mask, rewards, baselines


def _ours(name, k, old, ref, mask, rewards, baselines, group=None):
    est = Estimator(name, AlgoParams(gamma=GAMMA))
    r, tlr, m = k.estimator_rewards(rewards, old, ref, mask, mask, est.reads_token_rewards, group=group)
    extra = {"reward_baselines": baselines} if name == "remax" else {}
    return est.advantages(r, torch.arange(rewards.shape[0]), mask, group=group, token_level_rewards=tlr,
                          **extra), m


def _verl(ca, masked_mean, name, ctrl, old, ref, mask, rewards, baselines):
    scores = token_level_scores(rewards, mask)   # verl's reward manager: the score on the last response token
    tlr, m = _verl_apply_kl_penalty(ca, masked_mean, mask, scores, old, ref, ctrl, "low_var_kl")
    kw = dict(token_level_rewards=tlr, response_mask=mask, config=AlgoCfg(gamma=GAMMA))
    if name == "remax":
        kw["reward_baselines"] = baselines
    adv, _ = ca.get_adv_estimator_fn(name)(**kw)
    return adv * mask, m


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "remax"])
def test_penalised_token_rewards_reach_the_estimator_as_in_verl(name):
    k = KLInReward("low_var_kl", KLControlConfig(**CTRL), our_kl_penalty)
    with verl_core_algos() as ca:
        import verl.utils.torch_functional as verl_F

        ctrl = ca.get_kl_controller(AlgoCfg(**CTRL))
        for step in range(4):
            old, ref, mask, rewards, baselines = _batch(step)
            got, got_m = _ours(name, k, old, ref, mask, rewards, baselines)
            want, want_m = _verl(ca, verl_F.masked_mean, name, ctrl, old, ref, mask, rewards, baselines)
            torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
            assert got_m["actor/reward_kl_penalty_coeff"] == pytest.approx(want_m["actor/reward_kl_penalty_coeff"])
            # the penalty matters: without it the advantages differ
            plain = Estimator(name, AlgoParams(gamma=GAMMA)).advantages(
                rewards, torch.arange(8), mask, **({"reward_baselines": baselines} if name == "remax" else {}))
            assert not torch.allclose(plain, got, atol=1e-4)


def _dp_rank(rank, world, name, batches):
    import torch.distributed as dist

    k = KLInReward("low_var_kl", KLControlConfig(**CTRL), our_kl_penalty)
    rows = slice(0, 3) if rank == 0 else slice(3, None)   # 3 and 5 rows
    return [_ours(name, k, *(t[rows] for t in b), group=dist.group.WORLD)[0] for b in batches]


def test_reinforce_plus_plus_over_uneven_dp_ranks_is_the_whole_batch():
    batches = [_batch(10 + s) for s in range(3)]
    r0, r1 = run_ranks(_dp_rank, 2, "reinforce_plus_plus", batches, timeout=60)
    with verl_core_algos() as ca:
        import verl.utils.torch_functional as verl_F

        ctrl = ca.get_kl_controller(AlgoCfg(**CTRL))
        for a0, a1, b in zip(r0, r1, batches):
            want, _ = _verl(ca, verl_F.masked_mean, "reinforce_plus_plus", ctrl, *b)
            torch.testing.assert_close(torch.cat([a0, a1]), want.float(), rtol=1e-5, atol=1e-5)


def test_summing_estimators_keep_scalar_rewards_and_no_kl_is_unchanged():
    old, ref, mask, rewards, _ = _batch(0)
    k = KLInReward("kl", KLControlConfig(kl_coef=0.1), our_kl_penalty)
    r, tlr, _ = k.estimator_rewards(rewards, old, ref, mask, mask, False)
    assert tlr is None and r.shape == rewards.shape
    r, tlr, m = NoKLInReward().estimator_rewards(rewards, old, ref, mask, mask, True)
    assert tlr is None and r is rewards and m == {}


def _cfg(*overrides):
    return load_job_config(None, MODEL + list(overrides), world_size=1)


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "remax", "reinforce_plus_plus_baseline", "rloo"])
def test_verl_recipes_settings_build(name):
    """The algorithm block of verl's own run scripts for these estimators (use_kl_in_reward=True, kl_penalty kl,
    kl_ctrl.kl_coef 0.001) migrates and the job plan builds it."""
    verl = {"algorithm": {"adv_estimator": name, "use_kl_in_reward": True, "kl_penalty": "kl",
                          "kl_ctrl": {"kl_coef": 0.001}},
            "actor_rollout_ref": {"actor": {}, "rollout": {"n": 4}}}
    a = migrate_verl(verl).tree["algorithm"]
    assert a["advantage_estimator"] == name and a["use_kl_in_reward"] is True
    cfg = _cfg(f"algorithm.adv_estimator={name}", "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl",
               "algorithm.kl_ctrl={kl_coef: 0.001}", "rollout.n_samples_per_prompt=4")
    assert build_kl_in_reward(cfg.algorithm) is not None and build_estimator(cfg).name == name


def test_gdpo_with_kl_in_reward_is_refused_and_not_migrated():
    with pytest.raises(ConfigError, match=r"algorithm\.use_kl_in_reward: no effect with algorithm\.adv_estimator "
                                          r"'gdpo'"):
        _cfg("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a, b]", "algorithm.use_kl_in_reward=true",
             "rollout.n_samples_per_prompt=4")
    m = migrate_verl({"algorithm": {"adv_estimator": "gdpo", "gdpo_reward_keys": ["a", "b"], "use_kl_in_reward": True},
                      "actor_rollout_ref": {"actor": {}, "rollout": {"n": 4}}})
    assert not m.tree["algorithm"].get("use_kl_in_reward", False)
    [e] = [e for e in m.entries if e.key == "algorithm.use_kl_in_reward"]
    assert "no effect on adv_estimator gdpo" in e.detail


@pytest.mark.parametrize("name", ["opo", "gpg", "reinforce_plus_plus", "rloo_vectorized"])
def test_a_group_with_every_token_rejected_gets_zero_not_nan(name):
    """Rejection (rollout_rs) can mask a whole group; OPO's length-weighted baseline is then 0 / 0 in verl. The
    trainer's advantages are 0 off the loss's mask, finite everywhere."""
    mask = torch.ones(4, 3)
    mask[2:] = 0.0
    adv = Estimator(name, AlgoParams()).advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]),
                                                   mask)
    assert torch.isfinite(adv).all() and (adv[2:] == 0).all() and (adv[:2] != 0).all()


def _fake_estimator_rank(rank, world, name, rewards, groups, mask, backend):
    import torch.distributed as dist

    from megatron_rl.testing import fake_accelerator as fa

    fa.install()
    # an NCCL-like DP group (its device only) or gloo (host tensors only)
    group = dist.new_group(list(range(world)), backend=fa.BACKEND if backend == "fakeccl" else "gloo")
    dev = torch.device(fa.DEVICE, 0)
    cfg = _cfg(f"algorithm.adv_estimator={name}", "rollout.n_samples_per_prompt=4")
    rows = slice(0, 4) if rank == 0 else slice(4, None)   # whole groups: 4 and 8 rows
    adv = build_estimator(cfg).advantages(rewards[rows].to(dev), groups[rows].to(dev), mask[rows].to(dev),
                                          group=group)
    return str(adv.device), adv.cpu()


@pytest.mark.parametrize("backend", ["fakeccl", "gloo"])
@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg"])
def test_whole_batch_statistics_on_an_accelerator(name, backend):
    """The estimators whose statistics span the batch (whitening, GPG's count) with the step's tensors on a device
    that is not the CPU and the DP group NCCL-like (refusing host tensors) or gloo (refusing device tensors):
    the plan's estimator stages its all-reduces on the group's device (``parallel.devices``) and gives the
    single-process CPU result."""
    g = torch.Generator().manual_seed(4)
    mask = (torch.arange(7)[None] < torch.randint(1, 8, (12,), generator=g)[:, None]).float()
    rewards = torch.randint(0, 2, (12,), generator=g).float()
    groups = torch.arange(12) // 4
    want = Estimator(name, AlgoParams()).advantages(rewards, groups, mask)
    out = run_ranks(_fake_estimator_rank, 2, name, rewards, groups, mask, backend, timeout=60)
    assert {o[0] for o in out} == {"fakegpu:0"}
    torch.testing.assert_close(torch.cat([o[1] for o in out]), want)


def test_a_rejected_last_token_moves_the_score_where_verl_drops_it():
    """docs/advantages.md: token-level rejection of a row's last token -- verl's reinforce_plus_plus (score on the
    last response token, rejected mask) gives that row returns 0; here the score sits on the last kept token."""
    resp = torch.ones(4, 4)
    kept = resp.clone()
    kept[0, 3] = 0.0   # row 0's last token rejected
    rewards = torch.tensor([2.0, 0.0, 1.0, 0.5])
    with verl_core_algos() as ca:
        _, verl_ret = ca.get_adv_estimator_fn("reinforce_plus_plus")(
            token_level_rewards=token_level_scores(rewards, resp), response_mask=kept, config=AlgoCfg(gamma=1.0))
        _, ours_ret = ca.get_adv_estimator_fn("reinforce_plus_plus")(
            token_level_rewards=token_level_scores(rewards, kept), response_mask=kept, config=AlgoCfg(gamma=1.0))
        want, _ = ca.get_adv_estimator_fn("reinforce_plus_plus")(
            token_level_rewards=token_level_scores(rewards, kept), response_mask=kept, config=AlgoCfg(gamma=1.0))
    assert (verl_ret[0] == 0).all() and torch.equal(ours_ret[0, :3], torch.full((3,), 2.0))
    got = Estimator("reinforce_plus_plus", AlgoParams()).advantages(rewards, torch.arange(4), kept)
    torch.testing.assert_close(got, want.float())


def test_migrate_says_kl_in_reward_with_dynamic_sampling_is_not_built():
    """The job plan refuses use_kl_in_reward with filter_groups.enable: migrate lists it as a difference (it wrote
    it as mapped, and the migrated config then failed to load)."""
    m = migrate_verl({"algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": True,
                                    "filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 4}},
                      "actor_rollout_ref": {"actor": {}, "rollout": {"n": 4}}})
    [e] = [e for e in m.entries if e.key == "algorithm.use_kl_in_reward"]
    assert e.kind == UNSUPPORTED and "filter_groups.enable" in e.detail
    assert not m.tree["algorithm"].get("use_kl_in_reward", False)


@pytest.mark.parametrize("kept", [0, 1])
def test_whitening_with_fewer_than_two_kept_tokens_raises_as_verl_naming_the_rejection(kept):
    """Every token rejected (or all but one): verl's masked_whiten raises; so does the trainer's estimator, on
    every rank alike (the count is all-reduced first), naming the rejection that emptied the batch."""
    mask = torch.zeros(4, 3)
    mask[0, :kept] = 1.0
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    with verl_core_algos() as ca:
        with pytest.raises(ValueError):
            ca.get_adv_estimator_fn("reinforce_plus_plus")(token_level_rewards=token_level_scores(rewards, mask),
                                                           response_mask=mask, config=AlgoCfg(gamma=1.0))
    with pytest.raises(ValueError, match=r"needs >= 2 response tokens.*algorithm\.rollout_correction"):
        Estimator("reinforce_plus_plus", AlgoParams()).advantages(rewards, torch.arange(4), mask)


def test_the_summing_estimators_read_only_each_rows_sum_in_verl():
    """The estimators outside ``algo.estimator.TOKEN_LEVEL`` get the summed penalised reward: verl's own functions
    give the same advantages for any spread of a row's token rewards with that sum; the token-by-token ones do
    not (gdpo: refused with the penalty)."""
    from megatron_rl.algo.estimator import TOKEN_LEVEL, TRAINER_ESTIMATORS

    summing = [n for n in TRAINER_ESTIMATORS if n not in TOKEN_LEVEL and n != "gdpo"]
    g = torch.Generator().manual_seed(2)
    mask = torch.ones(8, 5)
    spread = torch.randn(8, 5, generator=g)
    last = torch.zeros(8, 5)
    last[:, -1] = spread.sum(-1)
    index = (torch.arange(8) // 4).numpy()
    with verl_core_algos() as ca:
        def run(name, tlr):
            kw = dict(token_level_rewards=tlr, response_mask=mask, index=index,
                      config=AlgoCfg(gamma=0.9, lam=1.0, norm_adv_by_std_in_grpo=True))
            if name == "remax":
                kw = dict(kw, reward_baselines=torch.zeros(8))
            return ca.get_adv_estimator_fn(name)(**kw)[0]
        for name in summing:
            torch.testing.assert_close(run(name, spread), run(name, last), rtol=1e-5, atol=1e-5, msg=name)
        for name in ("reinforce_plus_plus", "remax"):
            assert not torch.allclose(run(name, spread), run(name, last), atol=1e-3), name


def test_describe_says_the_estimator_and_a_defaulted_kpop_phi():
    """``check`` / the trainer's start print the estimator and the rejection; binary_kl's phi taken by default
    (rollout_rs_threshold null -> 2.0) is said."""
    from megatron_rl.plan.job import JobPlan

    cfg = _cfg("algorithm.adv_estimator=reinforce_plus_plus", "algorithm.rollout_correction.rollout_rs=binary_kl")
    line = JobPlan.build(cfg, 1).describe()[-1]
    assert line.startswith("advantages: reinforce_plus_plus (gamma 1; whitened over DP); rejection: binary_kl <= 2")
    assert "phi defaulted" in line
    cfg = _cfg("algorithm.rollout_correction.rollout_rs=binary_kl",
               "algorithm.rollout_correction.rollout_rs_threshold=0.1")
    assert JobPlan.build(cfg, 1).describe()[-1] == \
        "advantages: grpo (gamma 1; per prompt group); rejection: binary_kl <= 0.1"


def _fake_critic_rank(rank, world, returns, values, mask, backend):
    import torch.distributed as dist

    from megatron_rl.testing import fake_accelerator as fa
    from megatron_rl.trainer import critic_step

    fa.install()
    group = dist.new_group(list(range(world)), backend=fa.BACKEND if backend == "fakeccl" else "gloo")
    dev = torch.device(fa.DEVICE, 0)
    rows = slice(0, 3) if rank == 0 else slice(3, None)
    r, v, m = returns[rows].to(dev), values[rows].to(dev), mask[rows].to(dev)
    adv, _ = critic_step.compute_gae_advantage_return(r, v, m, gamma=1.0, lam=0.95, group=group,
                                                      all_reduce=critic_step.all_reduce_)
    return critic_step.explained_variance(r, v, m, group), adv.cpu()


@pytest.mark.parametrize("backend", ["fakeccl", "gloo"])
def test_critic_statistics_on_an_accelerator(backend):
    """The critic's GAE whitening and explained variance with the step's tensors on an accelerator and an
    NCCL-like or gloo DP group: staged reductions, the single-process CPU result."""
    from megatron_rl.algo.gae import compute_gae_advantage_return
    from megatron_rl.trainer.critic_step import explained_variance

    g = torch.Generator().manual_seed(6)
    returns, values = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    mask = (torch.arange(5)[None] < torch.randint(1, 6, (8,), generator=g)[:, None]).float()
    want_ev = explained_variance(returns, values, mask)
    want_adv, _ = compute_gae_advantage_return(returns, values, mask, gamma=1.0, lam=0.95)
    out = run_ranks(_fake_critic_rank, 2, returns, values, mask, backend, timeout=60)
    for ev, _ in out:
        assert ev == pytest.approx(want_ev, rel=1e-9)
    torch.testing.assert_close(torch.cat([a for _, a in out]), want_adv)

"""The trainer's GAE with a critic (``trainer/critic_step.py``) in the actor's [B, L-1] row layout equals verl 0.9.1's
own ``compute_gae_advantage_return`` (vendored core_algos) in verl's response layout: the reward on each row's last
response token, values of the state before each response token, multi-turn environment tokens masked, tokens the
rollout correction rejected masked too (verl replaces ``response_mask`` with the rejected one before
``compute_advantage``; a rejected last token loses the row's reward there as here), prompts of different lengths. Also ``critic/vf_explained_var`` against verl's ``metric_utils`` formula, and the critic's config
refusals (each naming its key)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.actor import RolloutBatch
from megatron_rl.trainer.critic_step import CriticPhase, explained_variance
from megatron_rl.testing.jobs import job_problems
from tests.verl_core_algos import verl_core_algos


class _Values:
    """A stand-in critic whose values are given."""

    def __init__(self, values):
        self.values = values

    def compute_values(self, rows):
        return self.values


class _Cfg:
    class algorithm:
        gamma, lam = 0.95, 0.9

    class critic:
        critic_warmup = 3


def _rows(seed, B=6):
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(1, 5, (B,), generator=g).tolist()
    rlens = torch.randint(1, 8, (B,), generator=g).tolist()
    prompts = [torch.randint(0, 50, (p,), generator=g).tolist() for p in plens]
    responses = [torch.randint(0, 50, (r,), generator=g).tolist() for r in rlens]
    lp = [[-0.5] * r for r in rlens]
    masks = [[1] + [int(x) for x in (torch.rand(r - 1, generator=g) > 0.3)] if r > 1 else [1] for r in rlens]
    for m in masks:
        m[-1] = 1  # a trajectory ends with the model's turn
    rows = RolloutBatch.from_sequences(prompts, responses, lp, loss_masks=masks)
    rewards = torch.randn(B, generator=g)
    values = torch.randn(B, rows.max_length - 1, generator=g)
    return rows, rewards, values, plens, rlens, masks


@pytest.mark.parametrize("seed", range(3))
def test_gae_in_row_layout_matches_verl_in_response_layout(seed):
    rows, rewards, values, plens, rlens, masks = _rows(seed)
    # rejection: a few more tokens out, row 2's last token among them
    g = torch.Generator().manual_seed(seed + 50)
    for b in range(rows.num_rows):
        for j in range(rlens[b]):
            if torch.rand(1, generator=g).item() < 0.15 or (b == 2 and j == rlens[b] - 1):
                masks[b][j] = 0
    loss_mask = torch.zeros(rows.num_rows, rows.max_length - 1)
    for b in range(rows.num_rows):
        loss_mask[b, plens[b] - 1: plens[b] - 1 + rlens[b]] = torch.tensor(masks[b], dtype=torch.float32)
    assert torch.equal(loss_mask * rows.response_mask, loss_mask)
    adv, returns, got_v = CriticPhase(_Values(values), _Cfg).advantages(rows, rewards, loss_mask)
    B, R = rows.num_rows, max(rlens)
    v_r, r_r, m_r = torch.zeros(B, R), torch.zeros(B, R), torch.zeros(B, R)
    for b in range(B):
        cols = torch.arange(plens[b] - 1, plens[b] - 1 + rlens[b])   # column t scores token t+1
        v_r[b, : rlens[b]] = values[b, cols]
        m_r[b, : rlens[b]] = torch.tensor(masks[b], dtype=torch.float32)
        r_r[b, rlens[b] - 1] = rewards[b]
    with verl_core_algos() as verl:
        want_a, want_r = verl.compute_gae_advantage_return(r_r, v_r, m_r, gamma=0.95, lam=0.9)
    for b in range(B):
        cols = torch.arange(plens[b] - 1, plens[b] - 1 + rlens[b])
        keep = m_r[b, : rlens[b]] > 0
        torch.testing.assert_close(adv[b, cols][keep], want_a[b, : rlens[b]][keep], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(returns[b, cols][keep], want_r[b, : rlens[b]][keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(adv * (1 - loss_mask), torch.zeros_like(adv))  # nothing outside the mask


def test_explained_variance_matches_verl_metric():
    rows, rewards, values, *_ = _rows(5)
    mask = rows.response_mask.bool()
    returns = torch.randn(values.shape, generator=torch.Generator().manual_seed(1))
    vr, vv = torch.masked_select(returns, mask), torch.masked_select(values, mask)
    want = float(1.0 - torch.var(vr - vv) / (torch.var(vr) + 1e-5))   # verl 0.9.1 metric_utils
    assert explained_variance(returns, values, mask) == pytest.approx(want, rel=1e-6)


def test_warmup_follows_verls_comparison():
    phase = CriticPhase(_Values(None), _Cfg)   # critic_warmup 3: global steps 1, 2 train the critic only
    assert [phase.actor_trains(s) for s in range(4)] == [False, False, True, True]


GAE = ("algorithm.advantage_estimator=gae",)


@pytest.mark.parametrize("overrides,needle", [
    (("critic.enable=true",), "critic.enable: true trains a critic that algorithm.advantage_estimator: 'grpo'"),
    (GAE + ("critic.enable=false",), "critic.enable: false, but algorithm.advantage_estimator: gae"),
    (GAE + ("algorithm.rollout_correction.bypass_mode=true",), "critic.enable: not built with algorithm.rollout_correction.bypass_mode"),
    (GAE + ("rollout.mode=async",), "critic.enable: not built with rollout.mode: 'async'"),
    (GAE + ("critic.cliprange_value=0",), "critic.cliprange_value: must be > 0"),
    (GAE + ("critic.loss_agg_mode=mean",), "critic.loss_agg_mode: 'mean' must be one of"),
    (GAE + ("critic.ppo_epochs=0",), "critic.ppo_epochs: must be an int >= 1"),
    (GAE + ("critic.lr_decay_style=zigzag",), "critic.lr_decay_style"),
    (GAE + ("parallel.context_parallel_size=2",), "critic.enable: not built with parallel.context_parallel_size: 2"),
    (GAE + ("parallel.expert_model_parallel_size=2",),
     "critic.enable: not built with parallel.expert_model_parallel_size: 2"),
    (GAE + ("parallel.virtual_pipeline_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"),
     "critic.enable: not built with parallel.virtual_pipeline_model_parallel_size"),
    (GAE + ("actor.routing_replay=r3",), "critic.enable: not built with actor.routing_replay: 'r3'"),
    (GAE + ("model.num_moe_experts=2",), "critic.enable: not built for an MoE model"),
])
def test_refusals_name_the_key(overrides, needle):
    _, problems = job_problems("sized_model", *overrides, world_size=2 if any("_size=2" in o for o in overrides) else 1)
    assert any(needle in p for p in problems), problems


def test_kl_in_the_reward_reaches_the_critics_gae():
    """Built since the token-level path (tests/integration/test_kl_reward_critic_loop.py proves it against verl)."""
    _, problems = job_problems("sized_model", *GAE, "algorithm.use_kl_in_reward=true", world_size=1)
    assert not [p for p in problems if "use_kl_in_reward" in p or "critic" in p], problems


def test_gae_alone_turns_the_critic_on():
    cfg, problems = job_problems("sized_model", *GAE, world_size=1)
    assert not [p for p in problems if "critic" in p], problems
    assert cfg.critic.enabled(cfg.algorithm.advantage_estimator)
    cfg, _ = job_problems("sized_model", world_size=1)
    assert not cfg.critic.enabled(cfg.algorithm.advantage_estimator)


def test_critic_seq_mean_token_sum_norm_divisor_follows_the_actors_loss_scale_factor():
    """verl 0.9.1's critic.loss_scale_factor is ``${oc.select:actor_rollout_ref.actor.loss_scale_factor,null}`` (its
    generated config): the critic's seq-mean-token-sum-norm divides by the actor's factor when one is set, else by
    the response budget (the width of verl's response mask)."""
    import os

    import yaml

    import megatron_rl.config as config_pkg
    from megatron_rl.plan.job import critic_spec

    path = os.path.join(os.path.dirname(config_pkg.__file__), "verl_defaults", "0.9.1", "_generated_ppo_trainer.yaml")
    with open(path) as fh:
        assert yaml.safe_load(fh)["critic"]["loss_scale_factor"] == \
            "${oc.select:actor_rollout_ref.actor.loss_scale_factor,null}"
    mode = ("critic.loss_agg_mode=seq-mean-token-sum-norm",)
    cfg, problems = job_problems("sized_model", *GAE, *mode, "actor.policy_loss.loss_scale_factor=777", world_size=1)
    assert not problems, problems
    assert critic_spec(cfg, world_size=1).loss_scale_factor == 777.0
    cfg, _ = job_problems("sized_model", *GAE, *mode, world_size=1)
    assert critic_spec(cfg, world_size=1).loss_scale_factor == float(cfg.rollout.max_new_tokens)


def test_critic_mini_batches_must_divide_the_prompts_per_dp_rank():
    """As actor.ppo_mini_batches: a critic mini-batch is whole prompt groups of each DP rank (verl asserts its
    mini-batch size divides the batch); refused in the plan, not found after the first rollout."""
    cfg, _ = job_problems("sized_model", world_size=2)
    per_rank = cfg.data.prompts_per_step // 2
    bad = per_rank + 1 if per_rank > 1 else 2
    _, problems = job_problems("sized_model", *GAE, f"critic.ppo_mini_batches={bad}", world_size=2)
    assert any(p.startswith(f"critic.ppo_mini_batches: {bad} does not divide") for p in problems), problems
    _, problems = job_problems("sized_model", *GAE, f"critic.ppo_mini_batches={per_rank}", world_size=2)
    assert not [p for p in problems if "critic.ppo_mini_batches" in p], problems


@pytest.mark.parametrize("warmup,critic_only", [(0, 0), (1, 0), (3, 2)])
def test_describe_says_how_many_steps_train_the_critic_alone(warmup, critic_only):
    """The plan's line counts the critic-only steps as verl's comparison gives them (``CriticPhase.actor_trains``),
    not the raw key (critic_warmup: 1 trains the actor from the first step)."""
    from megatron_rl.plan.job import JobPlan

    cfg, problems = job_problems("sized_model", *GAE, f"critic.critic_warmup={warmup}", world_size=1)
    phase = CriticPhase(_Values(None), cfg)
    assert sum(not phase.actor_trains(s) for s in range(10)) == critic_only
    [line] = [ln for ln in JobPlan.build(cfg, 1).describe() if ln.startswith("critic:")]
    assert f"critic_warmup {warmup}: the first {critic_only} step(s) train the critic alone" in line, line


def test_critic_epochs_mini_batches_and_aggregation_default_to_the_actors_as_verl():
    """verl 0.9.1 (its generated config): critic.ppo_epochs / ppo_mini_batch_size / loss_agg_mode default to the
    actor's (``${oc.select:actor_rollout_ref.actor.<key>,...}``); here the unset critic keys take the actor's
    ppo_epochs, ppo_mini_batches and policy_loss.loss_agg_mode, and a critic key set wins."""
    import os

    import yaml

    import megatron_rl.config as config_pkg
    from megatron_rl.plan.job import critic_spec

    path = os.path.join(os.path.dirname(config_pkg.__file__), "verl_defaults", "0.9.1", "_generated_ppo_trainer.yaml")
    with open(path) as fh:
        c = yaml.safe_load(fh)["critic"]
    assert c["ppo_epochs"] == "${oc.select:actor_rollout_ref.actor.ppo_epochs,1}"
    assert c["ppo_mini_batch_size"] == "${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size,256}"
    assert c["loss_agg_mode"] == "${oc.select:actor_rollout_ref.actor.loss_agg_mode,token-mean}"
    actor = ("actor.ppo_epochs=2", "actor.ppo_mini_batches=2", "actor.policy_loss.loss_agg_mode=seq-mean-token-mean")
    cfg, problems = job_problems("sized_model", *GAE, *actor, world_size=1)
    assert not problems, problems
    spec = critic_spec(cfg, world_size=1)
    assert (spec.optim.ppo_epochs, spec.optim.ppo_mini_batches, spec.loss_agg_mode) == (2, 2, "seq-mean-token-mean")
    cfg, _ = job_problems("sized_model", *GAE, *actor, "critic.ppo_epochs=1", "critic.ppo_mini_batches=1",
                          "critic.loss_agg_mode=token-mean", world_size=1)
    spec = critic_spec(cfg, world_size=1)
    assert (spec.optim.ppo_epochs, spec.optim.ppo_mini_batches, spec.loss_agg_mode) == (1, 1, "token-mean")

"""KL in the reward with the critic (``gae``) in the real RL loop (one gloo rank, the copy task, the frozen reference):
every step's advantages and returns are verl 0.9.1's ``apply_kl_penalty`` (transcribed over verl's own functions in
``tests/unit/test_kl_reward.py``; the scores on each row's last token, verl's reward manager's place) followed by
verl's ``compute_gae_advantage_return`` (vendored ``core_algos.py``) on the step's values and mask.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_kl_reward_critic_loop.py -q``
"""
import pytest
import torch

from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job
from tests.unit.test_kl_reward import _verl_apply_kl_penalty
from tests.verl_core_algos import AlgoCfg, verl_core_algos

pytestmark = [pytest.mark.mcore, pytest.mark.timeout(300)]

CFG = ("algorithm.advantage_estimator=gae", "algorithm.gamma=0.95", "algorithm.lam=0.9", "critic.lr=1e-3",
       "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl",
       "algorithm.kl_ctrl={type: adaptive, kl_coef: 0.05, target_kl: 0.0005, horizon: 20}",
       "algorithm.rollout_correction={rollout_is: token, rollout_is_threshold: 2.0}",
       "trainer.steps=2", "trainer.dump_rollouts=false")


def _train_recording(rank, world, cfg):
    from megatron_rl.algo.kl_reward import KLInReward
    from megatron_rl.trainer.critic_step import CriticPhase
    from megatron_rl.trainer.loop import train

    rec = []
    inner_apply, inner_adv = KLInReward.apply, CriticPhase.advantages

    def apply(self, scores, old, ref, mask, group=None):
        rec.append(dict(scores=scores.clone(), old=old.clone(), ref=ref.clone(), mask=mask.clone()))
        return inner_apply(self, scores, old, ref, mask, group)

    def advantages(self, rows, rewards, mask, group=None, token_level_rewards=None):
        out = inner_adv(self, rows, rewards, mask, group, token_level_rewards)
        rec[-1].update(rewards=rewards.clone(), lengths=rows.lengths.clone(), loss_mask=mask.clone(),
                       adv=out[0].clone(), returns=out[1].clone(), values=out[2].clone())
        return out

    KLInReward.apply, CriticPhase.advantages = apply, advantages
    train(cfg)
    return rec


def test_gae_with_kl_in_reward_is_verls(copy_model, tmp_path):
    job = named_job("copy_loop", *CFG, hf=copy_model, run_dir=tmp_path / "run", world_size=1)
    [rec] = run_ranks(_train_recording, 1, job, timeout=280)
    assert len(rec) == 2
    with verl_core_algos() as ca:
        import verl.utils.torch_functional as verl_F

        ctrl = ca.get_kl_controller(AlgoCfg(type="adaptive", kl_coef=0.05, target_kl=0.0005, horizon=20))
        for s in rec:
            mask = s["mask"].float()
            B = mask.shape[0]
            assert torch.equal(s["loss_mask"].float(), mask)   # no rejection configured
            scores = torch.zeros_like(mask)
            scores[torch.arange(B), s["lengths"] - 2] = s["rewards"].float()   # each row's last token
            assert torch.equal(s["scores"], scores)
            tlr, _ = _verl_apply_kl_penalty(ca, verl_F.masked_mean, mask, scores, s["old"], s["ref"], ctrl, "kl")
            want, want_ret = ca.compute_gae_advantage_return(tlr, s["values"], mask, gamma=0.95, lam=0.9)
            torch.testing.assert_close(s["adv"], (want * mask).float(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s["returns"], (want_ret * mask).float(), rtol=1e-5, atol=1e-6)
        assert float(ctrl.value) != 0.05   # beta moved: the penalty was in the rewards

"""``algorithm.adv_estimator: optimal_token_baseline`` with KL in the reward in the real RL loop (megatron actor on one
gloo rank, the frozen reference, embedded engine, the copy task, token IS): every step's advantages, as the actor
received them, are verl 0.9.1's ``apply_kl_penalty`` (transcribed over verl's own functions in
``tests/unit/test_kl_reward.py``) followed by verl's ``compute_optimal_token_baseline_advantage`` (vendored
``core_algos.py``) on the step's tensors: the loss's old log-probs, the log-prob pass's sum pi^2 (aligned with them:
pi_target^2 <= sum pi^2 <= 1 at every response token; its value vs HF: ``test_actor_sum_pi_squared.py``) and the
correction's IS weights, as verl's ``compute_advantage`` passes them.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_optimal_token_baseline_loop.py -q``
"""
import pytest
import torch

from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job
from tests.unit.test_kl_reward import _verl_apply_kl_penalty
from tests.verl_core_algos import AlgoCfg, verl_core_algos

pytestmark = [pytest.mark.mcore, pytest.mark.timeout(300)]

CFG = ("algorithm.adv_estimator=optimal_token_baseline", "algorithm.use_kl_in_reward=true",
       "algorithm.kl_penalty=low_var_kl",
       "algorithm.kl_ctrl={type: adaptive, kl_coef: 0.05, target_kl: 0.0005, horizon: 20}",
       "algorithm.rollout_correction={rollout_is: token, rollout_is_threshold: 2.0}",
       "trainer.steps=3", "trainer.dump_rollouts=false")


def _train_recording(rank, world, cfg):
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.algo.estimator import Estimator
    from megatron_rl.algo.kl_reward import KLInReward
    from megatron_rl.trainer.loop import train

    rec = []
    inner_apply, inner_adv, inner_train = KLInReward.apply, Estimator.advantages, MegatronActor.train_step

    def apply(self, scores, old, ref, mask, group=None):
        rec.append(dict(scores=scores.clone(), old=old.clone(), ref=ref.clone(), mask=mask.clone()))
        return inner_apply(self, scores, old, ref, mask, group)

    def advantages(self, rewards, group_index, mask, group=None, token_level_rewards=None, **inputs):
        rec[-1].update(rewards=rewards.clone(), index=torch.as_tensor(group_index).clone(), loss_mask=mask.clone(),
                       **{k: None if v is None else v.clone() for k, v in inputs.items()})
        return inner_adv(self, rewards, group_index, mask, group, token_level_rewards, **inputs)

    def train_step(self, batch, old, adv, *a, **k):
        rec[-1]["adv"] = adv.clone()
        return inner_train(self, batch, old, adv, *a, **k)

    KLInReward.apply, Estimator.advantages, MegatronActor.train_step = apply, advantages, train_step
    train(cfg)
    return rec


def test_optimal_token_baseline_with_kl_in_reward_is_verls(copy_model, tmp_path):
    job = named_job("copy_loop", *CFG, hf=copy_model, run_dir=tmp_path / "run", world_size=1)
    [rec] = run_ranks(_train_recording, 1, job, timeout=280)
    assert len(rec) == 3
    with verl_core_algos() as ca:
        import verl.utils.torch_functional as verl_F

        ctrl = ca.get_kl_controller(AlgoCfg(type="adaptive", kl_coef=0.05, target_kl=0.0005, horizon=20))
        for s in rec:
            mask = s["mask"].float()
            assert torch.equal(s["loss_mask"], mask)   # no rejection configured: verl's one response_mask
            on = mask > 0
            # the scores on each row's last response token, as verl's reward manager puts them
            assert torch.equal(s["scores"].sum(-1), s["rewards"].float())
            spp, old = s["sum_pi_squared"], s["old_log_probs"]
            assert torch.equal(old, s["old"])
            assert bool((spp[on] >= torch.exp(2 * old[on]) - 1e-5).all() and (spp[on] <= 1 + 1e-5).all())
            assert s["rollout_is_weights"] is not None
            tlr, _ = _verl_apply_kl_penalty(ca, verl_F.masked_mean, mask, s["scores"], s["old"], s["ref"], ctrl,
                                            "low_var_kl")
            want, _ = ca.get_adv_estimator_fn("optimal_token_baseline")(
                token_level_rewards=tlr, response_mask=mask, index=s["index"].numpy(), config=AlgoCfg(gamma=1.0),
                old_log_probs=old, sum_pi_squared=spp, rollout_is_weights=s["rollout_is_weights"])
            torch.testing.assert_close(s["adv"], (want * mask).float(), rtol=1e-5, atol=1e-6)
        assert float(ctrl.value) != 0.05                        # beta moved: the penalty was in the rewards
    assert any(float(s["adv"].abs().sum()) > 0 for s in rec)   # non-vacuous

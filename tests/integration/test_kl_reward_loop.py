"""KL in the reward in the real RL loop (megatron actor on one gloo rank, the frozen reference, embedded engine, the
copy task): the adaptive controller's beta, step after step, is verl 0.9.1's ``AdaptiveKLController`` (vendored,
``tests/verl_core_algos.py``) fed the logged ``actor/reward_kl_penalty`` and the step's batch size (16 rows), and a
run stopped after a checkpoint and resumed continues with the saved beta (not ``kl_coef``).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_kl_reward_loop.py -q``
"""
import json
import os

import pytest
import torch

from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job
from tests.verl_core_algos import verl_core_algos

pytestmark = [pytest.mark.mcore, pytest.mark.timeout(400)]

KL = ("algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=low_var_kl",
      "algorithm.kl_ctrl={type: adaptive, kl_coef: 0.05, target_kl: 0.0005, horizon: 20}")
ROWS = 16  # copy_loop: 4 prompts x 4 samples


def _train(rank, world, cfg):
    from megatron_rl.trainer.loop import train

    train(cfg)
    return None


def _train_recording(rank, world, cfg):
    """The loop, recording per step what the KL in the reward received and what the advantages received."""
    from megatron_rl.algo.estimator import Estimator
    from megatron_rl.algo.kl_reward import KLInReward
    from megatron_rl.trainer.loop import train

    seen, adv_rewards = [], []
    inner_seq, inner_adv = KLInReward.sequence_rewards, Estimator.advantages

    def sequence_rewards(self, rewards, old, ref, mask, group=None):
        beta = self.controller.value
        out, m = inner_seq(self, rewards, old, ref, mask, group)
        seen.append(dict(rewards=rewards.clone(), old=old.clone(), ref=ref.clone(), mask=mask.clone(), beta=beta))
        return out, m

    def advantages(self, rewards, *a, **k):
        adv_rewards.append(rewards.clone())
        return inner_adv(self, rewards, *a, **k)

    KLInReward.sequence_rewards, Estimator.advantages = sequence_rewards, advantages
    train(cfg)
    return seen, adv_rewards


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def test_adaptive_beta_is_verls_and_resumes(copy_model, tmp_path):
    full = named_job("copy_loop", *KL, "trainer.steps=3", "trainer.dump_rollouts=false", hf=copy_model,
                     run_dir=tmp_path / "full", world_size=1)
    [(seen, adv_rewards)] = run_ranks(_train_recording, 1, full, timeout=300)
    steps = _metrics(full.trainer.run_dir)
    # the advantages get score - beta x sum_t k3(old, ref) over the response (float64 here)
    assert len(seen) == len(adv_rewards) == 3
    for s, r in zip(seen, adv_rewards):
        x = (s["ref"] - s["old"]).double().clamp(-20, 20)
        k3 = (x.exp() - x - 1).clamp(-10, 10) * s["mask"].double()
        torch.testing.assert_close(r.double(), s["rewards"].double() - s["beta"] * k3.sum(-1), rtol=1e-6, atol=1e-6)
    assert not torch.equal(adv_rewards[2], seen[2]["rewards"])  # the penalty is there
    assert len(steps) == 3
    with verl_core_algos() as ca:
        ctrl = ca.get_kl_controller(type("C", (), dict(type="adaptive", kl_coef=0.05, target_kl=0.0005,
                                                       horizon=20))())
        for m in steps:
            assert m["actor/reward_kl_penalty_coeff"] == pytest.approx(float(ctrl.value), rel=1e-12)
            ctrl.update(current_kl=m["actor/reward_kl_penalty"], n_steps=ROWS)
    assert steps[0]["actor/reward_kl_penalty"] == 0.0  # step 1: the actor still is the reference
    assert steps[2]["actor/reward_kl_penalty"] > 0.0
    assert steps[2]["actor/reward_kl_penalty_coeff"] != 0.05

    part = named_job("copy_loop", *KL, "trainer.steps=2", "trainer.dump_rollouts=false", hf=copy_model,
                     run_dir=tmp_path / "part", world_size=1)
    assert run_ranks(_train, 1, part, timeout=300) == [None]
    resumed = named_job("copy_loop", *KL, "trainer.steps=3", "trainer.dump_rollouts=false", "trainer.resume=true",
                        hf=copy_model, run_dir=tmp_path / "part", world_size=1)
    assert run_ranks(_train, 1, resumed, timeout=300) == [None]
    last = _metrics(resumed.trainer.run_dir)[-1]
    assert last["actor/reward_kl_penalty_coeff"] == pytest.approx(steps[2]["actor/reward_kl_penalty_coeff"],
                                                                  rel=1e-12)

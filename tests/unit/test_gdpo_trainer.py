"""GDPO in the trainer: a verl-style dict reward's components (``algorithm.gdpo_reward_keys``) are read per row on
rank 0 (a missing key is one error naming it; a failed reward gives 0 components), carried with the rows through
the DP split to the estimator, whose advantages equal verl 0.9.1's own ``compute_gdpo_outcome_advantage`` called as
verl's trainer calls it (components in ``non_tensor_batch``, the prompt / attention mask in ``batch``).

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_gdpo_trainer.py -q``
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.algo.estimator import AlgoParams, Estimator
from megatron_rl.trainer.reward_components import reward_components
from megatron_rl.trainer.rollout_phase import generate_step
from megatron_rl.actor.replay_modes import NoReplay
from tests.unit.test_data_rollout_phase import FixedEngine
from tests.unit.test_dict_rewards import _setup
from tests.verl_core_algos import AlgoCfg, verl_core_algos

pytestmark = pytest.mark.timeout(300)
KEYS = ("acc", "length")


def test_components_read_from_dict_rewards_and_missing_keys_named():
    extras = [{"acc": 1.0, "length": 3.0}, None, {"acc": 0.0}]
    with pytest.raises(ValueError, match=r"algorithm\.gdpo_reward_keys: \['length'\] not in the reward of row 2"):
        reward_components(extras, [1.0, 0.0, -1.0], KEYS)
    assert reward_components(extras[:2], [1.0, 0.0], ("score",) + KEYS) == [[1.0, 1.0, 3.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize("weights", [None, (0.3, 2.0)])
def test_gdpo_step_matches_verl(tmp_path, weights):
    tok, cfg, task = _setup(tmp_path)
    try:
        out = generate_step(task, FixedEngine(tok, ["7", "8", "777"]), cfg, step=0, expected_version="step-0",
                            reward_keys=KEYS, replay=NoReplay())
    finally:
        task.close()
    comps = np.array(out.reward_components, dtype=np.float32)
    assert comps.shape == (6, 2) and sorted(comps[:, 0].tolist()) == [0, 0, 0, 0, 1, 1]
    assert comps[:, 1].tolist() == [1.0, 1.0, 3.0] * 2   # "length" of the stripped response
    shard = out.part(range(6), 0.0).shard(0, 3, 0, torch.device("cpu"))
    mask = shard.batch.response_mask.float()
    est = Estimator("gdpo", AlgoParams(gdpo_reward_keys=KEYS, gdpo_reward_weights=weights))
    got = est.advantages(shard.rewards, shard.group_index, mask, **shard.estimator_inputs)
    P = 1   # verl's layout: [prompt | response]; the mask here covers the response columns of each row
    attn = torch.cat([torch.ones(6, P, dtype=torch.long), (mask > 0).long()], dim=1)
    with verl_core_algos() as verl:
        want, _ = verl.get_adv_estimator_fn("gdpo")(
            token_level_rewards=shard.rewards.unsqueeze(-1) * mask, response_mask=mask,
            index=shard.group_index.numpy(), config=AlgoCfg(gdpo_reward_keys=list(KEYS), gdpo_reward_weights=weights),
            non_tensor_batch={k: comps[:, i] for i, k in enumerate(KEYS)},
            batch={"prompts": torch.zeros(6, P, dtype=torch.long), "attention_mask": attn})
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    assert (got != 0).any()

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

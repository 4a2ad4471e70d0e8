"""The estimators with whole-batch statistics (``GLOBAL_STATS``: GAE, REINFORCE++, REINFORCE++-baseline, GDPO
whitening; GPG's alpha), run on 3 gloo ranks with ``group`` = the world -- uneven shards, one rank without rows,
each prompt group whole on one rank -- equal verl 0.9.1's own function on the whole batch.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_advantage_estimators_dp.py -q``
"""
from __future__ import annotations

import numpy as np
import torch

from megatron_rl.algo import GLOBAL_STATS, advantage_fn
from megatron_rl.testing.distributed import run_ranks
from tests.verl_core_algos import AlgoCfg, verl_core_algos

B, T = 14, 7
SPLIT = [range(0, 9), range(9, 9), range(9, 14)]   # rank 1 has no rows; groups of 3 or 2 stay whole on a rank


def _batch():
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float() * (torch.rand(B, T, generator=g) > 0.2).float()
    mask[:, 0] = 1.0
    rewards = torch.randint(0, 2, (B, T), generator=g).float() * mask * (torch.rand(B, T, generator=g) > 0.7)
    rewards[0] = 0.0
    values = torch.randn(B, T, generator=g)
    index = np.array([f"p{i // 3}" if i < 9 else f"q{(i - 9) // 2}" for i in range(B)], dtype=object)
    return rewards, mask, values, index


def _kwargs(name, rewards, mask, values, index, rows):
    rows = list(rows)
    kw = dict(token_level_rewards=rewards[rows], response_mask=mask[rows], index=index[rows],
              config=AlgoCfg(gamma=0.95, norm_adv_by_std_in_grpo=True))
    if name == "gae":
        kw = dict(token_level_rewards=rewards[rows], values=values[rows], response_mask=mask[rows], gamma=0.95,
                  lam=0.9)
    return kw


def _rank(rank, world):
    import torch.distributed as dist
    rewards, mask, values, index = _batch()
    out = {}
    for name in GLOBAL_STATS:
        out[name] = advantage_fn(name)(**_kwargs(name, rewards, mask, values, index, SPLIT[rank]),
                                       group=dist.group.WORLD)
    return out


def test_global_statistics_over_dp_match_verl_on_the_whole_batch():
    assert set(GLOBAL_STATS) == {"gae", "gdpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg"}
    results = run_ranks(_rank, 3, timeout=120)
    rewards, mask, values, index = _batch()
    with verl_core_algos() as verl:
        for name in GLOBAL_STATS:
            want = verl.get_adv_estimator_fn(name)(**_kwargs(name, rewards.clone(), mask, values, index, range(B)))
            for k in range(2):
                got = torch.cat([results[r][name][k] for r in range(3)])
                torch.testing.assert_close(got, want[k], rtol=1e-5, atol=1e-5, msg=f"{name} output {k}")
            # the local statistics alone differ (the test can tell a missing reduction)
            local = advantage_fn(name)(**_kwargs(name, rewards, mask, values, index, SPLIT[0]))[0]
            assert not torch.allclose(local, want[0][:9], atol=1e-4), name

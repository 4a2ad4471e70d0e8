"""The critic's step logic with the actor's tensors on an accelerator (``testing.fake_accelerator``): GAE, its
global whitening, the explained variance and the value / return means on 2 DP ranks whose DP group is NCCL-like
(``fakeccl``, which refuses host tensors), the rows, rewards, values and the loss mask on ``fakegpu`` -- as
``trainer/step.py`` hands them. The result equals the same whole batch computed in one process on the CPU.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_critic_devices.py -q``
"""
import pytest
import torch
import torch.distributed as dist

from megatron_rl.actor import RolloutBatch
from megatron_rl.testing import fake_accelerator as fa
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.trainer.critic_step import CriticPhase


class _Critic:
    """A stand-in critic: given values on the actor's device; its update reports nothing."""

    def __init__(self, values):
        self.values = values

    def compute_values(self, rows):
        return self.values

    def train_step(self, rows, values, returns, mask):
        assert values.device == returns.device == mask.device == self.values.device
        return {}


class _Cfg:
    class algorithm:
        gamma, lam = 0.99, 0.95

    class critic:
        critic_warmup = 0


def _batch(B=4):
    g = torch.Generator().manual_seed(3)
    plens = torch.randint(1, 5, (B,), generator=g).tolist()
    rlens = torch.randint(1, 7, (B,), generator=g).tolist()
    rows = RolloutBatch.from_sequences([torch.randint(0, 50, (p,), generator=g).tolist() for p in plens],
                                       [torch.randint(0, 50, (r,), generator=g).tolist() for r in rlens],
                                       [[-0.5] * r for r in rlens])
    return rows, torch.randn(B, generator=g), torch.randn(B, rows.max_length - 1, generator=g)


def _run(rows, rewards, values, dev, group):
    rows, rewards, values = rows.to(dev), rewards.to(dev), values.to(dev)
    phase = CriticPhase(_Critic(values), _Cfg)
    mask = rows.response_mask.to(dev)
    adv, ret, v = phase.advantages(rows, rewards, mask, group=group)
    metrics = phase.train(rows, v, ret, mask, group=group)
    return adv.cpu(), ret.cpu(), metrics


def _rank(rank, world):
    fa.install()
    dp = dist.new_group(list(range(world)), backend=fa.BACKEND)
    rows, rewards, values = _batch()
    half = rows.num_rows // world
    lo, hi = rank * half, (rank + 1) * half
    return _run(rows.select(lo, hi), rewards[lo:hi], values[lo:hi, : rows.select(lo, hi).max_length - 1],
                torch.device(fa.DEVICE, 0), dp)


@pytest.mark.timeout(90)
def test_critic_phase_on_an_accelerator_equals_one_process_on_cpu():
    got = run_ranks(_rank, 2, timeout=80)
    rows, rewards, values = _batch()
    want_a, want_r, want_m = _run(rows, rewards, values, torch.device("cpu"), None)
    half = rows.num_rows // 2
    for r, (a, ret, m) in enumerate(got):
        W = a.shape[1]
        torch.testing.assert_close(a, want_a[r * half:(r + 1) * half, :W], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ret, want_r[r * half:(r + 1) * half, :W], rtol=1e-5, atol=1e-6)
        assert m == pytest.approx(want_m, rel=1e-6)

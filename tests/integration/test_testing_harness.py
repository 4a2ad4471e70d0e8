"""The multi-rank launcher itself: results per rank, errors and hangs surface, never stall."""
import pytest
import torch
import torch.distributed as dist

from megatron_rl.testing.distributed import RankError, run_ranks


def _allreduce(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t


def _raise_on_1(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _hang_on_0(rank, world):
    if rank == 0:
        t = torch.zeros(1)
        dist.recv(t, src=1)  # rank 1 never sends
    return rank


def test_results_per_rank():
    out = run_ranks(_allreduce, 3, timeout=60)
    assert [float(o) for o in out] == [6.0, 6.0, 6.0]


def test_rank_error_is_reported():
    with pytest.raises(RankError, match="boom on rank 1"):
        run_ranks(_raise_on_1, 2, timeout=60)


def test_hang_becomes_timeout():
    with pytest.raises((TimeoutError, RankError)):
        run_ranks(_hang_on_0, 2, timeout=5)

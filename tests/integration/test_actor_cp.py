"""Context-parallel split / gather of the actor vs megatron-core's own ``get_batch_on_this_cp_rank``.

Megatron's CP cannot run a model on CPU (its local attention asserts CP == 1; CP needs TE), so the
actor's CP data path is tested on its own: ``cp_split`` must equal megatron's zigzag slicing for every
CP rank, and ``cp_gather`` over a real gloo CP group must invert it.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_cp.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor.cp import cp_gather, cp_split
from megatron_rl.platform.mcore_version import megatron_cp_batch
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.fake_group import fake_process_group


def _megatron_split(x, tok, cp):
    """megatron's slicing for every CP rank (this process as each rank of a fake group of ``cp``)."""
    out = []
    for r in range(cp):
        with fake_process_group(r, cp) as group:
            out.append(megatron_cp_batch({"x": x.clone(), "tokens": tok.clone()}, group))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_matches_megatron(cp):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    tok = torch.arange(2 * 24).view(2, 24)
    refs = _megatron_split(x, tok, cp)
    for r, ref in enumerate(refs):
        assert ref["x"].shape[1] == 24 // cp
        assert torch.equal(cp_split(x, r, cp), ref["x"])
        assert torch.equal(cp_split(tok, r, cp), ref["tokens"])


def test_split_rejects_bad_length():
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by 2 x context_parallel_size = 4"):
        cp_split(torch.zeros(1, 10), 0, 2)


def _gather(rank, world, x):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    return cp_gather(cp_split(x, rank, world), group, world)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cp", [2, 3])
def test_gather_inverts_split(cp):
    x = torch.randn(2, 6 * cp, 5)
    for out in run_ranks(_gather, cp, x, timeout=50):
        assert torch.equal(out, x)

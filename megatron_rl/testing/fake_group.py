"""A process group of any size, held by this one process as any of its ranks (torch's ``fake`` backend: sizes
and ranks are real, collectives do nothing): what megatron-core's per-rank helpers read, without starting ranks.

    with fake_process_group(rank=1, size=4) as group:     # the default group, as rank 1 of 4
        megatron_cp_batch(batch, group)                    # megatron's split for CP rank 1 of 4
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist

__all__ = ["fake_process_group"]


@contextlib.contextmanager
def fake_process_group(rank: int, size: int):
    """The default process group as ``rank`` of ``size`` for the duration of the block (this process must not
    have one already)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_process_group: this process already has a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()

"""Routing replay under context parallelism and sequence parallelism: the replay targets of a micro-batch are in
the token order megatron's router sees on a CP x SP rank.

Reference: megatron-core's own ``get_batch_on_this_cp_rank`` (its zigzag: chunks ``r`` and ``2*cp-1-r`` of
``2*cp``) applied to a tensor of positions, then the sequence-parallel scatter along the sequence dimension
and the router's ``[s, b]`` flattening (s-major). Every replayed expert must be the rollout's expert of that
(row, position); padding and each row's last token keep the trainer's own choice (-1). CP itself needs
Transformer Engine's attention to run a model (GPU only), so this checks the routing placement on its own.
"""
import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor.routing import micro_batch_targets
from megatron_rl.platform.mcore_version import megatron_cp_batch
from megatron_rl.testing.fake_group import fake_process_group


@pytest.mark.parametrize("cp_size, sp_size", [(2, 1), (4, 1), (2, 2), (1, 2)])
def test_targets_follow_megatrons_cp_zigzag_and_sp_scatter(cp_size, sp_size):
    B, L, NL, K, E = 3, 16, 2, 2, 8
    g = torch.Generator().manual_seed(cp_size * 10 + sp_size)
    routing = torch.rand(B, L, NL, E, generator=g).argsort(-1)[..., :K].to(torch.uint8)
    lengths = torch.tensor([16, 11, 7])
    for cp_rank in range(cp_size):
        with fake_process_group(cp_rank, cp_size) as cp_group:
            pos = megatron_cp_batch({"tokens": torch.arange(L).expand(B, L).clone()}, cp_group)["tokens"]  # [B, L/cp]
        for sp_rank in range(sp_size):
            local = pos.chunk(sp_size, dim=1)[sp_rank]                      # SP scatters the sequence dim
            got = micro_batch_targets(routing, lengths, (0, B), L, cp_rank, cp_size, sp_rank, sp_size)
            assert got.shape == (NL, local.shape[1] * B, K)
            for s in range(local.shape[1]):
                for b in range(B):
                    p = int(local[b, s])
                    want = routing[b, p].long() if p < int(lengths[b]) - 1 else torch.full((NL, K), -1)
                    assert torch.equal(got[:, s * B + b, :], want), (cp_rank, sp_rank, s, b, p)

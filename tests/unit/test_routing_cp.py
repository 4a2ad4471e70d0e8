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

from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank
from megatron_rl.actor.routing import micro_batch_targets


@pytest.mark.parametrize("cp_size, sp_size", [(2, 1), (4, 1), (2, 2), (1, 2)])
def test_targets_follow_megatrons_cp_zigzag_and_sp_scatter(monkeypatch, cp_size, sp_size):
    B, L, NL, K, E = 3, 16, 2, 2, 8
    g = torch.Generator().manual_seed(cp_size * 10 + sp_size)
    routing = torch.rand(B, L, NL, E, generator=g).argsort(-1)[..., :K].to(torch.uint8)
    lengths = torch.tensor([16, 11, 7])
    for cp_rank in range(cp_size):
        monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp_size)
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda r=cp_rank: r)
        pos = get_batch_on_this_cp_rank({"tokens": torch.arange(L).expand(B, L).clone()})["tokens"]  # [B, L/cp]
        for sp_rank in range(sp_size):
            local = pos.chunk(sp_size, dim=1)[sp_rank]                      # SP scatters the sequence dim
            got = micro_batch_targets(routing, lengths, (0, B), L, cp_rank, cp_size, sp_rank, sp_size)
            assert got.shape == (NL, local.shape[1] * B, K)
            for s in range(local.shape[1]):
                for b in range(B):
                    p = int(local[b, s])
                    want = routing[b, p].long() if p < int(lengths[b]) - 1 else torch.full((NL, K), -1)
                    assert torch.equal(got[:, s * B + b, :], want), (cp_rank, sp_rank, s, b, p)

"""Each rank receives only the rows it trains on: rank 0 cuts a step's batch by DP shard and scatters the pieces
(``RolloutSource`` -> ``parallel.rank0.scatter_from_rank0`` with ``RowSplit``), instead of broadcasting every row and
every routing record to every rank.

4 gloo ranks at DP4 (2 prompt groups each), rows with MoE routing records. Checked on every rank: the bytes it
receives (the pickled piece, what ``scatter_object_list`` sends it) are its shard's share of the whole batch's
(by tokens, which the routing records scale with), not the whole batch, and
the tensors it trains on (``StepShard``) equal those the whole batch gives that DP rank (``StepBatch.shard`` of the
whole batch, built locally from the same rows) -- with contiguous shards and with token-balanced ones.
"""
import pickle

import pytest
import torch

from megatron_rl.testing.distributed import run_ranks

N_SAMPLES, GROUPS, LAYERS, TOPK = 2, 8, 6, 4


def _batch():
    from megatron_rl.trainer.step_batch import StepBatch

    g = torch.Generator().manual_seed(0)
    prompts, responses, lps, routing, versions, masks = [], [], [], [], [], []
    for grp in range(GROUPS):
        p = torch.randint(3, 50, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        for _ in range(N_SAMPLES):
            r = torch.randint(3, 50, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            prompts.append(p)
            responses.append(r)
            lps.append((-torch.rand(len(r), generator=g)).tolist())
            routing.append(torch.randint(0, 64, (len(p) + len(r) - 1, LAYERS, TOPK), generator=g, dtype=torch.uint8))
            versions.append([3] * len(r))
            masks.append([int(j % 3 != 1) for j in range(len(r))])     # multi-turn: environment tokens are 0
    return StepBatch(prompt_ids=prompts, response_ids=responses, rollout_log_probs=lps,
                     rewards=torch.rand(len(prompts), generator=g).tolist(), weight_version="step-3", routing=routing,
                     token_versions=versions, loss_masks=masks, metrics={"reward/failed": 0.0})


def _rank(rank, world, balance):
    import torch.distributed as dist

    from megatron_rl.parallel.rank0 import scatter_from_rank0
    from megatron_rl.trainer.rollout_source import RowSplit

    split = RowSplit(list(range(world)), world, N_SAMPLES, balance)   # global rank r is DP rank r
    piece, whole = scatter_from_rank0(_batch, split.pieces)
    full = _batch()                                            # the reference: the whole batch, sharded locally
    ref = full.shard(4, N_SAMPLES, 0, rank, world, torch.device("cpu"), balance_tokens=balance)
    got = piece.shard(4, N_SAMPLES, 0, torch.device("cpu"))
    for name in ("tokens", "prompt_lengths", "lengths", "rollout_log_probs", "routing", "response_mask"):
        torch.testing.assert_close(getattr(got.batch, name), getattr(ref.batch, name), rtol=0, atol=0, msg=name)
    for name in ("rewards", "group_index", "token_lag"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=0, atol=0, msg=name)
    assert list(got.rows) == list(ref.rows)
    assert piece.summary == full.summary(0.0) and piece.num_tokens == full.num_tokens
    assert (whole is not None) == (rank == 0)
    dist.barrier()
    tokens = [len(p) + len(r) for p, r in zip(full.prompt_ids, full.response_ids)]
    return {"received": len(pickle.dumps(piece)), "whole": len(pickle.dumps(full)), "rows": list(got.rows),
            "share": sum(tokens[i] for i in got.rows) / sum(tokens)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("balance", [False, True], ids=["contiguous", "token-balanced"])
def test_each_rank_receives_only_its_dp_shard(balance):
    res = run_ranks(_rank, 4, balance, timeout=100)
    assert sorted(r for x in res for r in x["rows"]) == list(range(GROUPS * N_SAMPLES))
    whole = res[0]["whole"]
    for rank, x in enumerate(res):   # proportional to the rank's share of the step's tokens (routing ~ tokens)
        assert x["received"] < 1.2 * x["share"] * whole + 2000, (rank, x, whole)
        assert x["received"] < 0.5 * whole, (rank, x, whole)
    assert sum(x["received"] for x in res) < 1.1 * whole

"""Each rank receives only what it trains on: rank 0 cuts a step's batch by DP shard (and the routing records by
pipeline stage) and sends each rank its piece (``RolloutSource`` -> ``parallel.rank0.scatter_from_rank0`` with
``RowSplit``), instead of broadcasting every row and every routing record to every rank.

4 gloo ranks at DP4 (2 prompt groups each), then PP2 x DP2, rows with MoE routing records. Checked on every rank:
the bytes it receives, counted where torch's collectives and receives fill tensors, are its shard's share of the
whole batch's (by tokens, which the routing records scale with; at PP2 its stage's layers' share of the routing),
not the whole batch, and the tensors it trains on (``StepShard``) equal those the whole batch gives that DP rank
(``StepBatch.shard`` of the whole batch, built locally from the same rows) -- with contiguous shards and with
token-balanced ones.
"""
import dataclasses
import pickle

import pytest
import torch

from megatron_rl.testing.distributed import run_ranks

N_SAMPLES, GROUPS, LAYERS, TOPK = 2, 8, 24, 8


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


#: PP2 x DP2 on the same 4 ranks: global rank r is stage r // 2 (these MoE layers), DP rank r % 2
STAGE_LAYERS = [tuple(range(8)), tuple(range(8, 24))]


def _count_received(counts):
    """Count, in this process, the bytes of every tensor a torch.distributed collective or receive fills here
    (``counts["bytes"]``): patched at torch's entry points, so what is counted is what crossed the wire."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def nbytes(x):
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        return sum(nbytes(t) for t in x) if isinstance(x, (list, tuple)) else 0

    def wrap(name, real):
        def counted(*args, **kw):
            out = real(*args, **kw)
            pos = args[1] if len(args) > 1 and name in ("broadcast", "scatter") else None
            src = kw.get("src", kw.get("group_src", pos))
            if name == "irecv" or src != dist.get_rank():
                counts["bytes"] += nbytes(args[0] if args else kw.get("tensor", kw.get("tensor_list")))
            return out
        return counted

    for name in ("irecv", "broadcast", "scatter", "all_gather", "all_reduce"):   # recv receives through irecv
        fn = wrap(name, getattr(c10d, name))
        setattr(c10d, name, fn)
        setattr(dist, name, fn)


def _received(counts, fn):
    """``fn()`` and the bytes this rank received while it ran."""
    import torch.distributed as dist

    dist.barrier()
    counts["bytes"] = 0
    out = fn()
    n = counts["bytes"]
    dist.barrier()
    return out, n


def _routing_bytes(batch, rows, layers):
    """Bytes of the routing records of ``rows``, of ``layers`` alone (independent of the code under test)."""
    return sum((len(batch.prompt_ids[i]) + len(batch.response_ids[i]) - 1) * len(layers) * TOPK for i in rows)


def _rank(rank, world, balance):
    from megatron_rl.parallel.rank0 import scatter_from_rank0
    from megatron_rl.trainer.rollout_source import RowSplit

    counts = {"bytes": 0}
    _count_received(counts)
    split = RowSplit(list(range(world)), world, N_SAMPLES, balance)   # global rank r is DP rank r
    (piece, whole), received = _received(counts, lambda: scatter_from_rank0(_batch, split.pieces))
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

    # PP2 x DP2: each stage receives its DP shard's rows with the routing of its own MoE layers alone
    stage, dp = rank // 2, rank % 2
    pp_split = RowSplit([r % 2 for r in range(world)], 2, N_SAMPLES, balance,
                        layers_of=[STAGE_LAYERS[r // 2] for r in range(world)])
    (pp_piece, _), pp_received = _received(counts, lambda: scatter_from_rank0(_batch, pp_split.pieces))
    pp_ref = full.shard(4, N_SAMPLES, 0, dp, 2, torch.device("cpu"), balance_tokens=balance)
    pp_got = pp_piece.shard(4, N_SAMPLES, 0, torch.device("cpu"))
    layers = list(STAGE_LAYERS[stage])
    torch.testing.assert_close(pp_got.batch.routing, pp_ref.batch.routing[:, :, layers], rtol=0, atol=0)
    torch.testing.assert_close(pp_got.batch.tokens, pp_ref.batch.tokens, rtol=0, atol=0)
    # a piece rank 0 cannot make (here: rank 2's, after rank 1 got its own) is an error on every rank, no wait
    from megatron_rl.parallel.rank0 import Pieces

    def failing(batch):
        cut = pp_split.pieces(batch)
        return Pieces(cut.keys, lambda key: 1 / 0 if key == cut.keys[2] else cut.make(key))
    try:
        scatter_from_rank0(_batch, failing)
        failed = None
    except RuntimeError as exc:
        failed = str(exc)
    tokens = [len(p) + len(r) for p, r in zip(full.prompt_ids, full.response_ids)]
    no_routing = len(pickle.dumps(dataclasses.replace(full, routing=None)))
    return {"failed": failed, "received": received, "whole": len(pickle.dumps(full)), "rows": list(got.rows),
            "share": sum(tokens[i] for i in got.rows) / sum(tokens), "pp_received": pp_received,
            "pp_routing": _routing_bytes(full, pp_got.rows, layers),
            "pp_other": no_routing * sum(tokens[i] for i in pp_got.rows) / sum(tokens)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("balance", [False, True], ids=["contiguous", "token-balanced"])
def test_each_rank_receives_only_its_dp_shard(balance):
    """Bytes counted where torch's collectives and receives fill tensors, on every rank: at DP4 each rank's are its
    shard's share of the step (by tokens, which the routing records scale with); at PP2 x DP2 each stage's are
    its rows' routing of its own layers (8 of 24 MoE layers on stage 0, 16 on stage 1) plus its rows' share of
    the rest. A piece rank 0 fails to make is raised on every rank (also on those that got theirs)."""
    res = run_ranks(_rank, 4, balance, timeout=100)
    assert sorted(r for x in res for r in x["rows"]) == list(range(GROUPS * N_SAMPLES))
    assert all("ZeroDivisionError" in x["failed"] for x in res), [x["failed"] for x in res]
    whole = res[0]["whole"]
    assert res[0]["received"] < 100 and res[0]["pp_received"] < 100    # rank 0 keeps its piece: nothing sent to it
    for rank, x in enumerate(res[1:], 1):   # proportional to the rank's share of the step's tokens (routing ~ tokens)
        assert 0.9 * x["share"] * whole < x["received"] < 1.1 * x["share"] * whole + 2000, (rank, x, whole)
        expect = x["pp_routing"] + x["pp_other"]
        assert 0.9 * expect < x["pp_received"] < 1.1 * expect + 2000, (rank, x)


def _rank_model_parallel(rank, world, tp, pp, cp):
    """RowSplit.gather on megatron's groups (TP x PP x CP x DP on ``world`` gloo ranks), then the scatter."""
    from types import SimpleNamespace

    from megatron_rl.parallel import ParallelConfig, initialize_model_parallel
    from megatron_rl.parallel.groups import ActorGroups
    from megatron_rl.parallel.rank0 import scatter_from_rank0
    from megatron_rl.trainer.rollout_source import RowSplit

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp), seed=1)
    groups = ActorGroups.from_parallel_state()
    cfg = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=N_SAMPLES))
    split = RowSplit.gather(cfg, groups.dp_rank, groups.dp_size, False)   # contiguous blocks (no token budget)
    piece, _ = scatter_from_rank0(_batch, split.pieces)
    ref = _batch().shard(4, N_SAMPLES, 0, groups.dp_rank, groups.dp_size, torch.device("cpu"))
    got = piece.shard(4, N_SAMPLES, 0, torch.device("cpu"))
    for name in ("tokens", "routing", "response_mask"):
        torch.testing.assert_close(getattr(got.batch, name), getattr(ref.batch, name), rtol=0, atol=0, msg=name)
    return {"dp_rank": groups.dp_rank, "dp_size": groups.dp_size, "rows": list(got.rows)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("tp,pp,cp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2xdp2", "pp2xdp2", "cp2xdp2"])
def test_ranks_of_one_dp_shard_receive_the_same_rows(tp, pp, cp):
    """With TP, PP or CP > 1 the ranks of one DP shard (megatron's data-parallel rank) all receive its rows, and
    the DP shards together hold every row once."""
    res = run_ranks(_rank_model_parallel, 4, tp, pp, cp, timeout=130)
    assert {x["dp_size"] for x in res} == {2}
    by_dp = {}
    for x in res:
        by_dp.setdefault(x["dp_rank"], []).append(x["rows"])
    assert sorted(by_dp) == [0, 1] and all(len(v) == 2 and v[0] == v[1] for v in by_dp.values()), by_dp
    assert sorted(r for v in by_dp.values() for r in v[0]) == list(range(GROUPS * N_SAMPLES))


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_nccl_job_scatters_pieces_through_host_memory():
    """On NCCL the pieces travel in a gloo group (``RowSplit.gather``): no pickled piece is staged in GPU memory
    (an object collective over NCCL puts each one there, on rank 0 one per global rank). One rank, one GPU."""
    import socket
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_rl.parallel.rank0 import scatter_from_rank0
    from megatron_rl.trainer.rollout_source import RowSplit
    from megatron_rl.trainer.step_batch import StepBatch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        cfg = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=2), trainer=SimpleNamespace(
            collective_timeout_s=60.0))
        split = RowSplit.gather(cfg, 0, 1, False)
        rows, length = 16, 2000     # routing: 16 x 1999 x 48 x 8 bytes = 12 MB pickled
        batch = StepBatch(prompt_ids=[[5] * 1000] * rows, response_ids=[[7] * 1000] * rows,
                          rollout_log_probs=[[-0.5] * 1000] * rows, rewards=[1.0] * rows, weight_version="step-0",
                          routing=[torch.zeros(length - 1, 48, 8, dtype=torch.uint8)] * rows)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        piece, whole = scatter_from_rank0(lambda: batch, split.pieces, group=split.group)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base < 1 << 20, torch.cuda.max_memory_allocated() - base
        assert whole is batch and piece.global_rows == list(range(rows))
        assert torch.equal(piece.rows.routing[3], batch.routing[3])
    finally:
        dist.destroy_process_group()


def _rank_nccl_like(rank, world):
    """The default group NCCL-like (``fakeccl``: objects staged on the ``fakegpu`` device): RowSplit.gather makes
    a gloo group and the pieces travel there; TRAFFIC counts the bytes handed to fakeccl collectives."""
    from types import SimpleNamespace

    from megatron_rl.parallel.rank0 import scatter_from_rank0
    from megatron_rl.testing import fake_accelerator as fa
    from megatron_rl.trainer.rollout_source import RowSplit

    fa.install()
    fa.make_default_group()
    cfg = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=N_SAMPLES), trainer=SimpleNamespace(
        collective_timeout_s=60.0))
    split = RowSplit.gather(cfg, rank, world, False)
    fa.TRAFFIC.clear()
    piece, _ = scatter_from_rank0(_batch, split.pieces, group=split.group)
    ref = _batch().shard(4, N_SAMPLES, 0, rank, world, torch.device("cpu"))
    torch.testing.assert_close(piece.shard(4, N_SAMPLES, 0, torch.device("cpu")).batch.routing, ref.batch.routing,
                               rtol=0, atol=0)
    return {"device_bytes": sum(fa.TRAFFIC.values()), "piece": len(pickle.dumps(piece))}


@pytest.mark.timeout(120)
def test_pieces_of_an_nccl_like_job_travel_in_host_memory():
    """With an NCCL-like default group the pieces go through a gloo group: what the device collectives carry is
    the few bytes of rank 0's outcome, not the rows."""
    res = run_ranks(_rank_nccl_like, 2, timeout=100)
    for x in res:
        assert x["piece"] > 5_000 and x["device_bytes"] < 200, res

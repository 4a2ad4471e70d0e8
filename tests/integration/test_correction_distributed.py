"""DP / CP / PP exactness of the correction on forked gloo ranks (each test has a hard timeout).

DP: any split of the batch over the group (uneven, a rank with no rows, a rank with only empty rows)
gives the single-process weights and metrics (rtol 1e-5; max/min exactly). CP: sequences split along
time (contiguous and zigzag) give the unsplit sequence-level weights and decisions. Collectives are
counted by wrapping torch.distributed itself, and only the groups passed in are used.
"""
import math

import pytest
import torch
import torch.distributed as dist

from megatron_rl.correction import RolloutCorrectionConfig, broadcast_from_last_stage, compute_rollout_correction
from megatron_rl.testing.distributed import run_ranks
from tests.correction_reference import check_against_reference, make_batch

CFGS = {
    "token_all": dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                      rollout_rs="token_k1,seq_mean_k3,seq_max_k2,seq_sum_k1",
                      rollout_rs_threshold="0.4_2.5,0.05,0.3,0.01_50", rollout_token_veto_threshold=1e-4),
    "seq_mask": dict(rollout_is="sequence", rollout_is_threshold="0.2_5", rollout_is_batch_normalize=True,
                     rollout_rs="token_k2,seq_sum_k3", rollout_rs_threshold="0.5,1.5"),
    "geo": dict(rollout_is="geometric", rollout_is_threshold=1.2, rollout_is_batch_normalize=True,
                rollout_rs="seq_mean_k1", rollout_rs_threshold="0.8_1.1", rollout_token_veto_threshold=1e-3),
    "kpop": dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                 rollout_rs="binary_kl,seq_mean_k3", rollout_rs_threshold="0.05,0.2"),
}
EXTREMA = ("_max", "_min", "_max_deviation")


def _count_collectives():
    counts = {"n": 0}
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter",
                 "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "broadcast_object_list"):
        orig = getattr(dist, name)

        def wrapped(*a, __orig=orig, **k):
            counts["n"] += 1
            return __orig(*a, **k)
        setattr(dist, name, wrapped)
    return counts


def _dp_body(rank, world, lt, lr, mask, bounds, cfg_kwargs):
    counts = _count_collectives()
    group = dist.new_group(list(range(world)))
    counts["n"] = 0
    lo, hi = bounds[rank]
    cfg = RolloutCorrectionConfig(**cfg_kwargs)
    res = compute_rollout_correction(lt[lo:hi], lr[lo:hi], mask[lo:hi], cfg, group=group)
    return {"res": res, "collectives": counts["n"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CFGS))
def test_dp_split_equals_single_process(name):
    lt, lr, mask = make_batch(7, B=13, T=11, spread=0.6, empty_rows=(5, 6))
    cfg = RolloutCorrectionConfig(**CFGS[name])
    single = compute_rollout_correction(lt, lr, mask, cfg)
    check_against_reference(single, lt, lr, mask, cfg)
    # rank 0: 5 rows, rank 1: only empty rows (5, 6), rank 2: no rows at all, rank 3: the rest
    bounds = [(0, 5), (5, 7), (7, 7), (7, 13)]
    out = run_ranks(_dp_body, 4, lt, lr, mask, bounds, CFGS[name], timeout=90)
    weights = torch.cat([o["res"].weights for o in out])
    new_mask = torch.cat([o["res"].response_mask for o in out])
    torch.testing.assert_close(weights, single.weights, rtol=1e-5, atol=1e-7)
    assert torch.equal(new_mask, single.response_mask)
    for o in out:
        assert o["collectives"] <= 3 and o["collectives"] == o["res"].num_collectives
        assert o["res"].metrics.keys() == single.metrics.keys()
        for k, v in single.metrics.items():
            got = o["res"].metrics[k]
            if k.endswith(EXTREMA):
                assert got == v, f"{k}: {got!r} != {v!r} (extrema must be exact)"
            else:
                assert math.isclose(got, v, rel_tol=1e-5, abs_tol=1e-9), f"{k}: {got!r} vs {v!r}"


def _cp_split(x, cp, r, zigzag):
    if not zigzag:
        return x.chunk(cp, dim=1)[r]
    chunks = x.chunk(2 * cp, dim=1)
    return torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=1)


def _cp_body(rank, world, lt, lr, mask, cfg_kwargs, dp, cp, zigzag):
    counts = _count_collectives()
    everyone = dist.new_group(list(range(world)))
    cp_groups = [dist.new_group([d * cp + c for c in range(cp)]) for d in range(dp)]
    counts["n"] = 0
    d, c = divmod(rank, cp)
    rows = lt.shape[0] // dp
    sl = slice(d * rows, (d + 1) * rows)
    parts = [_cp_split(t[sl], cp, c, zigzag) for t in (lt, lr, mask)]
    res = compute_rollout_correction(*parts, RolloutCorrectionConfig(**cfg_kwargs),
                                     group=everyone, cp_group=cp_groups[d])
    return {"res": res, "collectives": counts["n"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zigzag", [False, True], ids=["contiguous", "zigzag"])
@pytest.mark.parametrize("name", ["token_all", "seq_mask", "geo", "kpop"])
def test_cp_split_equals_unsplit(name, zigzag):
    dp, cp = 2, 2
    lt, lr, mask = make_batch(11, B=8, T=16, spread=0.5, empty_rows=(2,))
    cfg = RolloutCorrectionConfig(**CFGS[name])
    single = compute_rollout_correction(lt, lr, mask, cfg)
    out = run_ranks(_cp_body, dp * cp, lt, lr, mask, CFGS[name], dp, cp, zigzag, timeout=90)
    rows = lt.shape[0] // dp
    for rank, o in enumerate(out):
        d, c = divmod(rank, cp)
        sl = slice(d * rows, (d + 1) * rows)
        exp_w = _cp_split(single.weights[sl], cp, c, zigzag)
        exp_m = _cp_split(single.response_mask[sl], cp, c, zigzag)
        torch.testing.assert_close(o["res"].weights, exp_w, rtol=1e-6, atol=1e-7)
        assert torch.equal(o["res"].response_mask, exp_m), f"rank {rank}: RS/veto decisions differ"
        assert o["collectives"] <= 3
        for k, v in single.metrics.items():
            assert math.isclose(o["res"].metrics[k], v, rel_tol=1e-5, abs_tol=1e-9), f"{k}"


def _subgroup_body(rank, world, batches, cfg_kwargs):
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g = groups[rank // 2]
    lt, lr, mask = batches[rank // 2]
    half = lt.shape[0] // 2
    sl = slice(0, half) if rank % 2 == 0 else slice(half, None)
    return compute_rollout_correction(lt[sl], lr[sl], mask[sl], RolloutCorrectionConfig(**cfg_kwargs), group=g)


@pytest.mark.timeout(120)
def test_only_the_given_group_is_reduced():
    """Two independent DP groups in one world: each gets its own batch's metrics (not WORLD's)."""
    batches = [make_batch(21, B=6), make_batch(22, B=6, spread=1.0)]
    out = run_ranks(_subgroup_body, 4, batches, CFGS["token_all"], timeout=90)
    cfg = RolloutCorrectionConfig(**CFGS["token_all"])
    for gi in range(2):
        single = compute_rollout_correction(*batches[gi], cfg)
        for r in (2 * gi, 2 * gi + 1):
            for k, v in single.metrics.items():
                assert math.isclose(out[r].metrics[k], v, rel_tol=1e-5, abs_tol=1e-9), (r, k)


def _invalid_body(rank, world, lt, lr, mask):
    lo, hi = (0, 6) if rank == 0 else (6, 12)
    try:
        compute_rollout_correction(lt[lo:hi], lr[lo:hi], mask[lo:hi],
                                   RolloutCorrectionConfig.decoupled_token_is(), group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
def test_invalid_values_raise_on_every_rank_without_hanging():
    lt, lr, mask = make_batch(4, B=12, T=6, empty_rows=())
    lt[8, 0] = float("nan")  # only rank 1 holds it
    msgs = run_ranks(_invalid_body, 2, lt, lr, mask, timeout=45)
    assert msgs[1] is not None and "train_log_probs" in msgs[1] and "[seq 2, token 0]" in msgs[1]
    assert msgs[0] is not None and "other ranks" in msgs[0]


def _pp_body(rank, world, lt, lr, mask):
    pp = dist.new_group([0, 1])
    res = None
    if rank == 1:  # last stage holds the log-probs
        res = compute_rollout_correction(lt, lr, mask, RolloutCorrectionConfig.decoupled_seq_is_rs())
    return broadcast_from_last_stage(res, pp)


@pytest.mark.timeout(60)
def test_pp_broadcast_from_last_stage():
    lt, lr, mask = make_batch(9)
    out = run_ranks(_pp_body, 2, lt, lr, mask, timeout=45)
    assert torch.equal(out[0].weights, out[1].weights)
    assert torch.equal(out[0].response_mask, out[1].response_mask)
    assert out[0].metrics == out[1].metrics


def _cp_outside_group_body(rank, world, lt, lr, mask):
    counts = _count_collectives()
    cp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]  # DP without CP: misses the CP peer
    counts["n"] = 0
    half = lt.shape[1] // 2
    sl = slice(0, half) if rank % 2 == 0 else slice(half, None)
    cfg = RolloutCorrectionConfig(**CFGS["token_all"])
    msgs = []
    for group in (None, dp):
        try:
            compute_rollout_correction(lt[:, sl], lr[:, sl], mask[:, sl], cfg, group=group, cp_group=cp)
            msgs.append(None)
        except ValueError as exc:
            msgs.append(str(exc))
    return {"msgs": msgs, "collectives": counts["n"]}


@pytest.mark.timeout(120)
def test_cp_group_outside_group_raises_before_any_collective():
    """group=None or a group without the CP peers would give rank-local metrics: refused, naming ranks."""
    lt, lr, mask = make_batch(13, B=4, T=8)
    out = run_ranks(_cp_outside_group_body, 4, lt, lr, mask, timeout=90)
    for rank, o in enumerate(out):
        cp_ranks = [0, 1] if rank < 2 else [2, 3]
        none_msg, dp_msg = o["msgs"]
        assert none_msg is not None and f"cp_group has ranks {cp_ranks}" in none_msg and "group is None" in none_msg
        dp_ranks = [0, 2] if rank % 2 == 0 else [1, 3]
        assert dp_msg is not None and f"cp_group ranks {cp_ranks}" in dp_msg and f"ranks {dp_ranks}" in dp_msg
        assert o["collectives"] == 0, f"rank {rank} issued {o['collectives']} collectives before raising"

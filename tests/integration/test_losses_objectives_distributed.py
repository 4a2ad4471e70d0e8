"""DP2 x CP2 (4 forked gloo ranks) runs of every policy objective equal the single-process whole-batch run.

Rank r is DP rank r // 2 and CP rank r % 2. The DP ranks hold uneven row blocks (3 and 5 rows, one rank
with fully masked rows); each CP rank holds a zigzag half of every sequence's columns. Per rank: the
batch selection (clip_cov / kl_cov / m2po) over the DP group on whole rows, then the CP split, global
denominators, ``seq_valid_tokens`` and ``compute_policy_loss(..., cp_group=...)``. The losses summed over
all ranks, the all-reduced gradient and the all-reduced metrics must equal one process with the whole
batch, for every sequence-level and batch-level objective (and the token-local ones). No token is
gathered. Run: ``pytest tests/integration/test_losses_objectives_distributed.py``.
"""
import pytest
import torch

from megatron_rl.losses import (LOSS_AGG_MODES, LOSS_TYPES, LossBatch, PolicyLoss, PolicyLossConfig,
                                batch_selection, compute_policy_loss, global_denominators, merge_metrics,
                                metrics_to_floats, reduce_metrics, sequence_token_counts)
from megatron_rl.testing.distributed import run_ranks
from tests.integration.test_losses_distributed import make_problem, model_log_probs

F64 = torch.float64
PARAMS = {"dro": dict(dro_beta=0.3), "m2po": dict(m2_threshold=0.02), "opsm": dict(opsm_delta=0.01),
          "clip_cov": dict(clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=5.0), "kl_cov": dict(kl_cov_ratio=0.2)}
CASES = [(lt, PolicyLossConfig(loss_agg_mode=agg, loss_scale_factor=8.0, **PARAMS.get(lt, {})))
         for lt in LOSS_TYPES for agg in (LOSS_AGG_MODES if lt in ("gspo", "opsm", "ppo_clip") else ("token-mean",))]
DP_ROWS = [(0, 3), (3, 8)]


def problem():
    d = make_problem(seed=5)
    g = torch.Generator().manual_seed(11)
    d["rollout"] = d["old"] + torch.where(torch.rand(d["old"].shape, generator=g) < 0.3,
                                          0.4 * torch.randn(d["old"].shape, generator=g, dtype=F64),
                                          torch.zeros((), dtype=F64))
    d["adv"] = torch.randn(d["adv"].shape, generator=g, dtype=F64)   # per-token: covariances spread out
    return d


def _zigzag(T, world, rank):
    n = T // (2 * world)
    chunks = torch.arange(T).reshape(2 * world, n)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])


def _run(d, loss_type, cfg, rows, cols, dp_group, cp_group):
    """Loss output of the block ``rows`` x ``cols`` with the selection made on whole rows over dp_group."""
    r = slice(*rows)
    select, mask, sel_metrics = batch_selection(loss_type, cfg, d["old"][r], d["rollout"][r], d["adv"][r],
                                                d["mask"][r], group=dp_group)
    theta = d["theta"].clone().requires_grad_()
    c = (r, cols)
    local_mask = mask[:, cols]
    den = global_denominators(local_mask, group=dp_group, cp_group=cp_group)
    seq_n = sequence_token_counts(local_mask, cp_group=cp_group)
    out = compute_policy_loss(PolicyLoss.of(loss_type, cfg),
                              LossBatch(model_log_probs(d["X"][c], theta), d["old"][c], d["adv"][c], local_mask,
                                        is_weights=d["weights"][c], ref_log_probs=d["ref"][c], denominators=den,
                                        seq_valid_tokens=seq_n, cp_group=cp_group,
                                        token_select=None if select is None else select[:, cols]))
    out.loss.backward()
    return out, theta.grad, sel_metrics


def _body(rank, world, d):
    import torch.distributed as dist
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp, cp = rank // 2, rank % 2
    cols = _zigzag(d["mask"].shape[1], 2, cp)
    results = []
    for loss_type, cfg in CASES:
        out, grad, sel_metrics = _run(d, loss_type, cfg, DP_ROWS[dp], cols, dp_groups[cp], cp_groups[dp])
        loss = out.loss.detach().clone()
        grad = grad.clone()
        dist.all_reduce(loss)
        dist.all_reduce(grad)
        m = metrics_to_floats(reduce_metrics(out.metrics, group=dist.group.WORLD), prefix="")
        results.append((loss, grad, m, sel_metrics))
    return results


@pytest.mark.timeout(300)
def test_dp2_cp2_equals_single_process_for_every_objective():
    d = problem()
    per_rank = run_ranks(_body, 4, d, timeout=240)
    T = d["mask"].shape[1]
    for i, (loss_type, cfg) in enumerate(CASES):
        out, grad, sel_metrics = _run(d, loss_type, cfg, (0, 8), torch.arange(T), None, None)
        loss = out.loss.detach()
        m = metrics_to_floats(out.metrics, prefix="")
        assert float(loss) != 0.0 and float(grad.abs().sum()) > 0, loss_type
        for rank in range(4):
            r_loss, r_grad, r_m, r_sel = per_rank[rank][i]
            torch.testing.assert_close(r_loss, loss, rtol=1e-9, atol=1e-12, msg=f"{loss_type} {cfg.loss_agg_mode}")
            torch.testing.assert_close(r_grad, grad, rtol=1e-9, atol=1e-12, msg=f"{loss_type} {cfg.loss_agg_mode}")
            assert r_m.keys() == m.keys()
            for k in m:
                assert r_m[k] == pytest.approx(m[k], rel=1e-9, abs=1e-12), (loss_type, k)
            assert r_sel == pytest.approx(sel_metrics), loss_type
    # the batch-level objectives really select something here (else the test would prove little)
    for loss_type in ("clip_cov", "kl_cov"):
        cfg = dict(CASES)[loss_type]
        sel, _, _ = batch_selection(loss_type, cfg, d["old"], d["rollout"], d["adv"], d["mask"])
        assert 0 < int(sel.sum()) < int((d["mask"] != 0).sum()), loss_type
    _, mask, frac = batch_selection("m2po", dict(CASES)["m2po"], d["old"], d["rollout"], d["adv"], d["mask"])
    assert 0 < frac["m2po_maskfrac"] < 1


def _selection_body(rank, world, d, blocks):
    import torch.distributed as dist
    r = slice(*blocks[rank])
    out = []
    for loss_type in ("clip_cov", "kl_cov", "m2po"):
        sel, mask, metrics = batch_selection(loss_type, dict(CASES)[loss_type], d["old"][r], d["rollout"][r],
                                             d["adv"][r], d["mask"][r], group=dist.group.WORLD)
        out.append((sel, mask, metrics))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("blocks", [[(0, 0), (0, 8)], [(2, 3), (0, 8)]], ids=["no-rows", "no-valid-token"])
def test_batch_selection_with_a_rank_without_valid_tokens(blocks):
    """A DP rank holding no rows (or only a fully masked row) joins every collective of the selections and
    gets the single-process selection of the other rank's rows; no crash, no hang."""
    d = problem()
    assert int((d["mask"][2:3] != 0).sum()) == 0
    per_rank = run_ranks(_selection_body, 2, d, blocks, timeout=90)
    r = slice(*blocks[1])
    for i, loss_type in enumerate(("clip_cov", "kl_cov", "m2po")):
        sel, mask, metrics = batch_selection(loss_type, dict(CASES)[loss_type], d["old"][r], d["rollout"][r],
                                             d["adv"][r], d["mask"][r])
        assert per_rank[1][i][2] == pytest.approx(metrics) and per_rank[0][i][2] == pytest.approx(metrics)
        assert torch.equal(per_rank[1][i][1], mask), loss_type
        assert sel is None or torch.equal(per_rank[1][i][0], sel), loss_type
        if sel is not None:
            assert int(per_rank[0][i][0].sum()) == 0, loss_type


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_selections_and_sequence_sums_on_a_nccl_group_equal_cpu(tmp_path):
    """The batch selections, sequence sums, denominators and metrics with CUDA inputs and their collectives on
    a (1-rank) NCCL group equal the group-less CPU run."""
    import torch.distributed as dist
    d = problem()
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        for loss_type, cfg in CASES:
            if cfg.loss_agg_mode != "token-mean":
                continue
            for dev, g in (("cpu", None), ("cuda", group)):
                t = {k: v.to(dev) for k, v in d.items() if isinstance(v, torch.Tensor)}
                sel, mask, sel_metrics = batch_selection(loss_type, cfg, t["old"], t["rollout"], t["adv"], t["mask"],
                                                         group=g)
                theta = t["theta"].clone().requires_grad_()
                out = compute_policy_loss(PolicyLoss.of(loss_type, cfg),
                                          LossBatch(model_log_probs(t["X"], theta), t["old"], t["adv"], mask,
                                                    is_weights=t["weights"], ref_log_probs=t["ref"],
                                                    denominators=global_denominators(mask, group=g),
                                                    seq_valid_tokens=sequence_token_counts(mask, cp_group=g),
                                                    cp_group=g, token_select=sel))
                out.loss.backward()
                m = metrics_to_floats(reduce_metrics(out.metrics, group=g), prefix="")
                res = (out.loss.detach().cpu(), theta.grad.cpu(), m, sel_metrics,
                       None if sel is None else sel.cpu(), mask.cpu())
                if dev == "cpu":
                    cpu = res
            torch.testing.assert_close(res[0], cpu[0], rtol=1e-9, atol=1e-12, msg=loss_type)
            torch.testing.assert_close(res[1], cpu[1], rtol=1e-9, atol=1e-12, msg=loss_type)
            assert res[2] == pytest.approx(cpu[2], rel=1e-9, abs=1e-12) and res[3] == pytest.approx(cpu[3]), loss_type
            assert (res[4] is None or torch.equal(res[4], cpu[4])) and torch.equal(res[5], cpu[5]), loss_type
    finally:
        dist.destroy_process_group()

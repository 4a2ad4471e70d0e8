"""Multi-process (gloo) exactness of megatron_rl.losses with global denominators.

DP: 3 ranks with uneven micro-batches (different row counts and padded lengths; one rank whose
tokens are all masked) each aggregate their micro-batches with ``global_denominators(group=...)``;
the sum of the losses over ranks, the all-reduced parameter gradient and the all-reduced metrics
equal the single-process full-batch result (float64). CP: 2 ranks hold contiguous or zigzag time
slices of every sequence; with ``cp_group`` denominators and ``seq_valid_tokens`` the summed loss
and gradient equal the unsplit result. Every configuration carries a KL loss and an entropy bonus. Run: ``pytest tests/integration/test_losses_distributed.py``.
"""
import pytest
import torch
import torch.nn.functional as Fnn

from megatron_rl.losses import (LOSS_AGG_MODES, LossBatch, PolicyLoss, PolicyLossConfig, compute_policy_loss,
                                global_denominators, merge_metrics, metrics_to_floats, reduce_metrics,
                                sequence_token_counts)
from megatron_rl.testing.distributed import run_ranks
from tests.unit.test_losses_reference import make_batch

F64 = torch.float64
# (loss_type, PolicyLossConfig): the loss type is an argument of the loss (its owner is the correction config)
CONFIGS = [(lt, PolicyLossConfig(loss_agg_mode=mode, clip_ratio_c=3.0, clip_ratio_high=0.28,
                                 loss_scale_factor=8.0, kl_loss_coef=0.1, kl_loss_type="k3+", entropy_coeff=0.05))
           for lt in ("ppo_clip", "reinforce") for mode in LOSS_AGG_MODES]
# DP layout: per rank, micro-batches as (first row, end row, padded length)
DP_LAYOUT = [[(0, 3, 8), (3, 5, None)],    # rank 0: two micro-batches, the second re-padded shorter
             [(5, 6, None)],               # rank 1: one sequence
             [(6, 8, 8)]]                  # rank 2: rows 6-7, every token masked


def make_problem(seed=0, N=8, T=8, D=5, lengths=(4, 8, 0, 7, 3, 5, 6, 8)):
    """Rows 6-7 fully masked, row 2 empty; ~15% of the other valid tokens rejected."""
    d = make_batch(seed, B=N, T=T)
    g = torch.Generator().manual_seed(seed + 100)
    d["mask"] = ((torch.arange(T)[None, :] < torch.tensor(lengths)[:, None])
                 & (torch.rand(N, T, generator=g) > 0.15)).to(F64)
    d["mask"][6:] = 0
    d["X"] = torch.randn(N, T, D, generator=g, dtype=F64)
    d["theta"] = torch.randn(D, generator=g, dtype=F64)
    lp = model_log_probs(d["X"], d["theta"])
    big = torch.rand(N, T, generator=g) < 0.2          # some ratios far outside the clip range
    delta = torch.where(big, 1.5, 0.3) * torch.randn(N, T, generator=g, dtype=F64)
    d["old"] = torch.clamp(lp + delta, max=-1e-4)
    d["ref"] = torch.clamp(lp + 0.5 * torch.randn(N, T, generator=g, dtype=F64), max=-1e-4)
    return d


def model_log_probs(X, theta):
    """A tiny differentiable 'policy': log-probs = -softplus(X @ theta) <= 0."""
    return -Fnn.softplus(X @ theta)


def model_entropy(X, theta):
    """The tiny policy's per-token 'entropy' (>= 0, differentiable in theta), for the entropy bonus."""
    return Fnn.softplus(0.5 * X @ theta)


def micro_loss(d, cfg, theta, sel, den, seq_valid_tokens=None):
    """Loss of the micro-batch given by index ``sel`` into every [N, T] tensor (policy, KL and entropy terms)."""
    part = {k: d[k][sel] for k in ("old", "adv", "mask", "weights", "ref")}
    loss_type, cfg = cfg
    return compute_policy_loss(PolicyLoss.of(loss_type, cfg),
                               LossBatch(model_log_probs(d["X"][sel], theta), part["old"], part["adv"], part["mask"],
                                         is_weights=part["weights"], ref_log_probs=part["ref"], denominators=den,
                                         seq_valid_tokens=seq_valid_tokens, entropy=model_entropy(d["X"][sel], theta)))


def full_batch(d, cfg):
    theta = d["theta"].clone().requires_grad_()
    out = micro_loss(d, cfg, theta, (slice(None), slice(None)), None)
    (g,) = torch.autograd.grad(out.loss, theta)
    return out.loss.detach(), g, metrics_to_floats(out.metrics)


def _dp_body(rank, world, d):
    import torch.distributed as dist
    group = dist.group.WORLD
    results = []
    for cfg in CONFIGS:
        theta = d["theta"].clone().requires_grad_()
        sels = []
        for a, b, T in DP_LAYOUT[rank]:
            if T is None:   # re-pad to this micro-batch's last valid column
                cols = torch.nonzero(d["mask"][a:b].sum(0)).flatten()
                T = int(cols.max()) + 1 if cols.numel() else 1
            sels.append((slice(a, b), slice(0, T)))
        den = global_denominators([d["mask"][s] for s in sels], group=group)
        total = torch.zeros((), dtype=F64)
        metrics = []
        for s in sels:
            out = micro_loss(d, cfg, theta, s, den)
            out.loss.backward()
            total += out.loss.detach()
            metrics.append(out.metrics)
        grad = theta.grad.clone()
        dist.all_reduce(grad, group=group)
        dist.all_reduce(total, group=group)
        m = metrics_to_floats(reduce_metrics(merge_metrics(metrics), group=group))
        results.append((total, grad, m, float(den.num_tokens), float(den.num_seqs)))
    return results


@pytest.mark.timeout(120)
def test_dp_uneven_micro_batches_equal_full_batch():
    d = make_problem()
    assert d["mask"][6:].sum() == 0 and d["mask"][:6].sum() > 0
    per_rank = run_ranks(_dp_body, 3, d, timeout=90)
    n_tok = float(d["mask"].sum())
    n_seq = float((d["mask"].sum(1) > 0).sum())
    for i, cfg in enumerate(CONFIGS):
        loss, grad, metrics = full_batch(d, cfg)
        assert float(loss) != 0.0 and grad.abs().sum() > 0
        for rank in range(3):
            total, g, m, den_tok, den_seq = per_rank[rank][i]
            assert (den_tok, den_seq) == (n_tok, n_seq)
            torch.testing.assert_close(total, loss, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(g, grad, rtol=1e-9, atol=1e-12)
            assert m.keys() == metrics.keys()
            for k in m:
                assert m[k] == pytest.approx(metrics[k], rel=1e-9, abs=1e-12), (cfg, k)


def _cp_slices(T, world, rank, zigzag):
    """Column indices of ``rank`` when sequences of length T are split over ``world`` CP ranks."""
    if not zigzag:
        n = T // world
        return torch.arange(rank * n, (rank + 1) * n)
    n = T // (2 * world)
    chunks = torch.arange(T).reshape(2 * world, n)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])


def _cp_body(rank, world, d, zigzag):
    import torch.distributed as dist
    cp_group = dist.group.WORLD
    cols = _cp_slices(d["mask"].shape[1], world, rank, zigzag)
    sel = (slice(None), cols)
    results = []
    for cfg in CONFIGS:
        theta = d["theta"].clone().requires_grad_()
        local_mask = d["mask"][sel]
        den = global_denominators(local_mask, group=None, cp_group=cp_group)
        seq_n = sequence_token_counts(local_mask, cp_group=cp_group)
        out = micro_loss(d, cfg, theta, sel, den, seq_valid_tokens=seq_n)
        out.loss.backward()
        loss = out.loss.detach().clone()
        grad = theta.grad.clone()
        dist.all_reduce(loss, group=cp_group)
        dist.all_reduce(grad, group=cp_group)
        results.append((loss, grad))
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zigzag", [False, True], ids=["contiguous", "zigzag"])
def test_cp_split_sequences_equal_full_batch(zigzag):
    d = make_problem(seed=3)
    per_rank = run_ranks(_cp_body, 2, d, zigzag, timeout=90)
    for i, cfg in enumerate(CONFIGS):
        loss, grad, _ = full_batch(d, cfg)
        for rank in range(2):
            torch.testing.assert_close(per_rank[rank][i][0], loss, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(per_rank[rank][i][1], grad, rtol=1e-9, atol=1e-12)

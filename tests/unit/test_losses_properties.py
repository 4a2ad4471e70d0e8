"""Hypothesis property tests of megatron_rl.losses: padding invariance (junk and NaN in padding
included), micro-batch split invariance with global denominators (loss, gradient and metrics),
sequence-order invariance. Run: ``pytest tests/unit/test_losses_properties.py``.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.losses import (LOSS_AGG_MODES, LossBatch, PolicyLoss, PolicyLossConfig, compute_policy_loss,
                                global_denominators, merge_metrics, metrics_to_floats)
from test_losses_reference import make_batch

F64 = torch.float64
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)  # same examples every run

# (loss_type, PolicyLossConfig): the loss type is an argument of the loss (its owner is the correction config)
configs = st.tuples(st.sampled_from(["ppo_clip", "reinforce"]), st.builds(
    PolicyLossConfig,
    clip_ratio_low=st.sampled_from([0.1, 0.2]),
    clip_ratio_high=st.sampled_from([0.2, 0.28]),
    clip_ratio_c=st.sampled_from([None, 3.0]),
    loss_agg_mode=st.sampled_from(LOSS_AGG_MODES),
    loss_scale_factor=st.just(16.0),          # constant factor: sum-norm is then padding-invariant
    kl_loss_coef=st.sampled_from([0.0, 0.2]),
    kl_loss_type=st.sampled_from(["low_var_kl", "k3+", "k1"]),
))


def loss_and_grad(d, cfg, use_w, denominators=None):
    loss_type, cfg = cfg
    lp = d["logp"].clone().requires_grad_()
    out = compute_policy_loss(PolicyLoss.of(loss_type, cfg),
                              LossBatch(lp, d["old"], d["adv"], d["mask"], is_weights=d["weights"] if use_w else None,
                                        ref_log_probs=d["ref"], denominators=denominators))
    (g,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), g, out.metrics


def rows(d, idx, T=None):
    """Rows ``idx`` of every tensor, cut to the first T columns."""
    return {k: v[idx][:, :T] if T is not None else v[idx] for k, v in d.items()}


@SETTINGS
@given(seed=st.integers(0, 10_000), B=st.integers(1, 6), T=st.integers(1, 8), pad=st.integers(1, 5),
       cfg=configs, use_w=st.booleans(), junk=st.sampled_from([0.0, -1e30, float("nan"), float("inf")]))
def test_padding_invariance(seed, B, T, pad, cfg, use_w, junk):
    """Extra padded columns holding any junk (NaN, inf) change neither loss nor gradients."""
    d = make_batch(seed, B=B, T=T, empty_rows=(seed % 3,))
    padded = {k: torch.cat([v, torch.full((B, pad), junk if k != "mask" else 0.0, dtype=F64)], dim=1)
              for k, v in d.items()}
    l1, g1, m1 = loss_and_grad(d, cfg, use_w)
    l2, g2, m2 = loss_and_grad(padded, cfg, use_w)
    torch.testing.assert_close(l2, l1, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g2[:, :T], g1, rtol=1e-12, atol=1e-14)
    assert torch.all(g2[:, T:] == 0)
    f1, f2 = metrics_to_floats(m1), metrics_to_floats(m2)
    assert f1.keys() == f2.keys()
    for k in f1:
        assert abs(f1[k] - f2[k]) <= 1e-12 * max(1.0, abs(f1[k])), k


@SETTINGS
@given(seed=st.integers(0, 10_000), B=st.integers(1, 8), T=st.integers(1, 8), cfg=configs,
       use_w=st.booleans(), cuts=st.lists(st.integers(0, 8), max_size=4), trim=st.booleans())
def test_micro_batch_split_invariance(seed, B, T, cfg, use_w, cuts, trim):
    """Any split of the rows into micro-batches (each optionally cut to its own padded length), each
    aggregated with the global denominators: the summed loss, the concatenated gradient and the merged
    metrics equal the full batch's."""
    d = make_batch(seed, B=B, T=T, empty_rows=(seed % 4, (seed // 4) % 5))
    bounds = sorted({0, B, *[c for c in cuts if c <= B]})
    chunks = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        idx = torch.arange(a, b)
        Tk = T
        if trim:   # re-pad the micro-batch to its own last valid column (at least 1)
            valid_cols = torch.nonzero(d["mask"][idx].sum(0)).flatten()
            Tk = int(valid_cols.max()) + 1 if valid_cols.numel() else 1
        chunks.append((idx, Tk, rows(d, idx, Tk)))
    den = global_denominators([c[2]["mask"] for c in chunks])
    full_loss, full_grad, full_metrics = loss_and_grad(d, cfg, use_w)
    total = torch.zeros((), dtype=F64)
    grad = torch.zeros_like(full_grad)
    metrics = []
    for idx, Tk, c in chunks:
        l, g, m = loss_and_grad(c, cfg, use_w, den)
        total += l
        grad[idx, :Tk] = g
        metrics.append(m)
    torch.testing.assert_close(total, full_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, full_grad, rtol=1e-10, atol=1e-12)
    merged, full = metrics_to_floats(merge_metrics(metrics)), metrics_to_floats(full_metrics)
    assert merged.keys() == full.keys()
    for k in full:
        assert abs(merged[k] - full[k]) <= 1e-10 * max(1.0, abs(full[k])), k


@SETTINGS
@given(seed=st.integers(0, 10_000), B=st.integers(2, 7), cfg=configs, use_w=st.booleans(),
       perm_seed=st.integers(0, 1000))
def test_sequence_order_invariance(seed, B, cfg, use_w, perm_seed):
    d = make_batch(seed, B=B, T=6)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(perm_seed))
    l1, g1, _ = loss_and_grad(d, cfg, use_w)
    l2, g2, _ = loss_and_grad(rows(d, perm), cfg, use_w)
    torch.testing.assert_close(l2, l1, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g2, g1[perm], rtol=1e-12, atol=1e-14)

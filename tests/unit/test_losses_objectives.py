"""Every policy objective against a float64 transcription of its source (``tests/policy_objectives_reference``).

verl 0.9.1's objectives (``verl/trainer/ppo/core_algos.py``), slime's OPSM and AReaL's M2PO mask are run on
the same random tensors (masks with rejected tokens and empty rows, IS weights or none, every
``loss_agg_mode``); loss, gradient w.r.t. the log-probs and the metrics verl reports must match.
Run: ``pytest tests/unit/test_losses_objectives.py``.
"""
import pytest
import torch

from megatron_rl.losses import (LOSS_AGG_MODES, LossBatch, PolicyLoss, PolicyLossConfig, batch_selection,
                                compute_policy_loss, metrics_to_floats)
from megatron_rl.losses.selection import covariance_selection, m2po_keep_mask
from tests import policy_objectives_reference as ref
from tests.unit.test_losses_reference import make_batch

F64 = torch.float64
TOKEN_MODES = ["vanilla", "ppo_clip", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "kl_cov", "dro", "cispo",
               "reinforce", "opsm"]
PARAMS = {"dro": dict(dro_beta=0.3), "sapo": dict(tau_pos=1.0, tau_neg=1.05), "kl_cov": dict(kl_cov_ratio=0.2),
          "opsm": dict(opsm_delta=0.01), "dppo_tv": dict(clip_ratio_low=0.1, clip_ratio_high=0.05),
          "dppo_kl": dict(clip_ratio_low=0.05, clip_ratio_high=0.02)}
METRICS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "opsm_clipfrac")


def batch(seed, empty_rows=(1,), **kw):
    d = make_batch(seed, B=7, T=10, empty_rows=empty_rows, beyond_clamp=False, **kw)
    if not empty_rows:                      # every row keeps at least one valid token
        d["mask"][:, 0] = 1.0
    return d


def run_ours(d, loss_type, cfg, weights, dtype=F64):
    lp = d["logp"].to(dtype).clone().requires_grad_(True)
    w = d["weights"].to(dtype) if weights else None
    out = compute_policy_loss(PolicyLoss.of(loss_type, cfg),
                              LossBatch(lp, d["old"].to(dtype), d["adv"].to(dtype), d["mask"].to(dtype), is_weights=w))
    grad, = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), grad, metrics_to_floats(out.metrics, prefix="")


def run_ref(d, loss_type, rcfg, agg, weights, factor=None):
    lp = d["logp"].clone().requires_grad_(True)
    loss, metrics = ref.VERL[loss_type](d["old"], lp, d["adv"], d["mask"], agg, rcfg,
                                        rollout_is_weights=d["weights"] if weights else None,
                                        loss_scale_factor=factor)
    grad, = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, {k: float(torch.as_tensor(v).detach()) for k, v in metrics.items()}


def check(ours, theirs, rtol=1e-7, atol=1e-9, metric_atol=1e-7):
    """verl divides per-sequence sums by n + 1e-8: relative differences up to ~1e-8."""
    (l1, g1, m1), (l2, g2, m2) = ours, theirs
    torch.testing.assert_close(l1.to(F64), l2, rtol=rtol, atol=atol)
    torch.testing.assert_close(g1.to(F64), g2, rtol=rtol, atol=atol)
    for k in METRICS:
        if k in m2:
            assert m1[k] == pytest.approx(m2[k], abs=metric_atol), k


@pytest.mark.parametrize("loss_type", TOKEN_MODES)
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("weights", [False, True])
def test_token_objectives_match_reference(loss_type, agg, weights):
    for seed in range(3):
        d = batch(seed, per_token_adv=seed == 1)
        params = PARAMS.get(loss_type, {})
        cfg = PolicyLossConfig(loss_agg_mode=agg, loss_scale_factor=8.0 if agg.endswith("norm") else None,
                               **params)
        check(run_ours(d, loss_type, cfg, weights),
              run_ref(d, loss_type, ref.Cfg(**params), agg, weights, factor=8.0))


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_geo_mean_matches_verl(weights, agg):
    """GMPO ignores loss_agg_mode (verl: torch.mean over rows); rows all keep a valid token here."""
    for seed in range(3):
        d = batch(seed, empty_rows=(), per_token_adv=seed == 2)
        cfg = PolicyLossConfig(loss_agg_mode=agg, clip_ratio_low=0.2, clip_ratio_high=0.28)
        check(run_ours(d, "geo_mean", cfg, weights),
              run_ref(d, "geo_mean", ref.Cfg(clip_ratio_low=0.2, clip_ratio_high=0.28), agg, weights),
              rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_clip_cov_matches_verl_when_every_candidate_is_cut(weights, agg):
    params = dict(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=5.0)
    for seed in range(3):
        d = batch(seed, per_token_adv=True)
        theirs = run_ref(d, "clip_cov", ref.Cfg(**params), agg, weights, factor=8.0)
        assert 0 < theirs[2]["n_candidates"] <= theirs[2]["clip_num"]
        cfg = PolicyLossConfig(loss_agg_mode=agg, loss_scale_factor=8.0 if agg.endswith("norm") else None, **params)
        check(run_ours(d, "clip_cov", cfg, weights), theirs)


def test_float32_within_fp32_tolerance():
    for loss_type in TOKEN_MODES + ["geo_mean"]:
        d = batch(4, empty_rows=())
        params = PARAMS.get(loss_type, {})
        cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean", **params)
        theirs = run_ref(d, loss_type, ref.Cfg(**params), "seq-mean-token-mean", True)
        check(run_ours(d, loss_type, cfg, True, dtype=torch.float32), theirs, rtol=2e-5, atol=2e-6,
              metric_atol=1e-5)


def test_clip_cov_random_choice_is_seeded_and_layout_free():
    d = batch(5, per_token_adv=True)
    valid = d["mask"] != 0
    cfg = PolicyLossConfig(clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=5.0, clip_cov_seed=3)
    sel = covariance_selection("clip_cov", cfg, d["logp"], d["old"], d["adv"], valid)
    everything = covariance_selection("clip_cov", PolicyLossConfig(clip_cov_ratio=1.0, clip_cov_lb=0.05,
                                                                   clip_cov_ub=5.0), d["logp"], d["old"],
                                      d["adv"], valid)
    clip_num = max(int(0.1 * valid.sum().item()), 1)
    assert int(sel.sum()) == min(clip_num, int(everything.sum())) and bool((sel <= everything).all())
    perm = torch.randperm(d["logp"].shape[0], generator=torch.Generator().manual_seed(0))
    sel_p = covariance_selection("clip_cov", cfg, d["logp"][perm], d["old"][perm], d["adv"][perm], valid[perm])
    assert torch.equal(sel_p, sel[perm])                      # the choice follows the tokens, not the layout
    other = covariance_selection("clip_cov", PolicyLossConfig(clip_cov_ratio=0.1, clip_cov_lb=0.05,
                                                              clip_cov_ub=5.0, clip_cov_seed=4),
                                 d["logp"], d["old"], d["adv"], valid)
    assert int(other.sum()) == int(sel.sum()) and not torch.equal(other, sel)


@pytest.mark.parametrize("threshold", [1e-4, 0.01, 0.05, 0.3, 10.0])
def test_m2po_mask_matches_areal(threshold):
    for seed in range(4):
        d = batch(seed)
        g = torch.Generator().manual_seed(seed)
        rollout = d["old"] + torch.where(torch.rand(d["old"].shape, generator=g) < 0.3,
                                         0.5 * torch.randn(d["old"].shape, generator=g, dtype=F64), torch.zeros(()))
        valid = d["mask"] != 0
        expected = ref.m2po_loss_mask(rollout, d["old"], valid, threshold)
        assert torch.equal(m2po_keep_mask(d["old"], rollout, valid, threshold), expected)
        _, mask, metrics = batch_selection("m2po", PolicyLossConfig(m2_threshold=threshold), d["old"], rollout,
                                           d["adv"], d["mask"])
        assert torch.equal(mask != 0, expected)
        frac = 1 - expected.sum().item() / valid.sum().item()
        assert metrics["m2po_maskfrac"] == pytest.approx(frac)


def test_m2po_loss_is_ppo_clip_on_the_shrunk_mask():
    d = batch(7)
    rollout = d["old"] + 0.4 * torch.randn(d["old"].shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    cfg = PolicyLossConfig(m2_threshold=0.02)
    _, mask, _ = batch_selection("m2po", cfg, d["old"], rollout, d["adv"], d["mask"])
    d2 = dict(d, mask=mask)
    check(run_ours(d2, "m2po", cfg, True), run_ref(d2, "vanilla", ref.Cfg(), "token-mean", True))


def test_kl_cov_selection_is_the_top_k_covariances():
    d = batch(8, per_token_adv=True)
    valid = d["mask"] != 0
    cfg = PolicyLossConfig(kl_cov_ratio=0.25)
    sel = covariance_selection("kl_cov", cfg, d["logp"], d["old"], d["adv"], valid)
    a, lp = d["adv"][valid], d["logp"][valid]
    cov = (a - a.mean()) * (lp - lp.mean())
    k = max(1, int(len(cov) * 0.25))
    top = torch.zeros_like(cov, dtype=torch.bool)
    top[torch.topk(cov, k).indices] = True
    assert torch.equal(sel[valid], top) and int(sel[~valid].sum()) == 0


@pytest.mark.gpu
def test_every_objective_on_cuda_equals_cpu():
    """The same float32 inputs on CUDA and on CPU: loss, gradient, metrics and batch selections agree."""
    from megatron_rl.losses import LOSS_TYPES
    d = batch(9, empty_rows=(), per_token_adv=True)
    rollout = d["old"] + 0.2 * torch.randn(d["old"].shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    params = {**PARAMS, "m2po": dict(m2_threshold=0.01),
              "clip_cov": dict(clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=5.0)}
    for loss_type in LOSS_TYPES:
        cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean", **params.get(loss_type, {}))
        results = []
        for dev in ("cpu", "cuda"):
            t = {k: v.to(dev, torch.float32) for k, v in d.items()}
            sel, mask, sel_metrics = batch_selection(loss_type, cfg, t["old"], rollout.to(dev, torch.float32),
                                                     t["adv"], t["mask"])
            lp = t["logp"].clone().requires_grad_(True)
            out = compute_policy_loss(PolicyLoss.of(loss_type, cfg),
                                      LossBatch(lp, t["old"], t["adv"], mask, is_weights=t["weights"],
                                                token_select=sel))
            grad, = torch.autograd.grad(out.loss, lp)
            results.append((out.loss.detach().cpu(), grad.cpu(), metrics_to_floats(out.metrics, prefix=""),
                            None if sel is None else sel.cpu(), mask.cpu(), sel_metrics))
        (l1, g1, m1, s1, k1, x1), (l2, g2, m2, s2, k2, x2) = results
        torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6, msg=loss_type)
        torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-6, msg=loss_type)
        assert m2 == pytest.approx(m1, abs=1e-5) and x2 == pytest.approx(x1), loss_type
        assert (s1 is None) == (s2 is None) and (s1 is None or torch.equal(s1, s2)), loss_type
        assert torch.equal(k1, k2), loss_type


def test_m2po_without_rollout_log_probs_is_a_named_error():
    d = batch(3)
    with pytest.raises(ValueError, match="m2po.*rollout"):
        batch_selection("m2po", PolicyLossConfig(m2_threshold=0.01), d["old"], None, d["adv"], d["mask"])


def test_m2po_ties_are_kept_or_masked_together():
    """Equal m2 values (shared prefixes) are one block: kept together when their mean with the smaller values
    is below the threshold, masked together otherwise."""
    old = torch.full((2, 3), -1.0, dtype=F64)
    rollout = old + torch.tensor([[0.3, 0.3, 0.0], [0.3, 0.0, 0.0]], dtype=F64)   # m2: 0.09 x3, 0 x3
    valid = torch.ones(2, 3, dtype=torch.bool)
    keep = m2po_keep_mask(old, rollout, valid, 0.05)        # all: mean 0.045 < 0.05 -> keep all
    assert bool(keep.all())
    keep = m2po_keep_mask(old, rollout, valid, 0.04)        # the tied 0.09s go together
    assert torch.equal(keep, rollout == old)


def test_selections_take_tied_tokens_together():
    """Identical rows (one prompt, shared response and advantage): their tokens tie in covariance and in
    Clip-Cov's hash, and are selected together, so a selection of k = 1 holds one token of every row."""
    d = batch(6, empty_rows=(), per_token_adv=True)
    B = d["mask"].shape[0]
    for k in ("logp", "old", "adv", "mask"):
        d[k][:] = d[k][0]
    valid = d["mask"] != 0
    n = int(valid.sum())
    kl = covariance_selection("kl_cov", PolicyLossConfig(kl_cov_ratio=1.0 / n), d["logp"], d["old"], d["adv"], valid)
    clip = covariance_selection("clip_cov", PolicyLossConfig(clip_cov_ratio=1.0 / n, clip_cov_lb=-1e9, clip_cov_ub=1e9),
                                d["old"], d["old"], d["adv"], valid)
    for sel in (kl, clip):
        assert int(sel.sum()) == B and all(torch.equal(sel[0], sel[i]) for i in range(B))

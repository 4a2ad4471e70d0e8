"""megatron_rl.losses vs an independent reference: plain float64 per-sequence / per-token Python loops.

The reference below never calls megatron_rl code: each token's loss is built from 0-d float64 tensors
with Python branching (clip, dual-clip, ratio clamp), aggregated by per-sequence loops, and
differentiated with torch.autograd. Every loss_type x aggregation mode x dual-clip x IS-weights
combination is compared on value, gradient and metrics; KL estimators against closed-form values
and derivatives. Run: ``pytest tests/unit/test_losses_reference.py``.
"""
import math

import pytest
import torch

from megatron_rl.losses import (LOSS_AGG_MODES, LossBatch, PolicyLoss, PolicyLossConfig, compute_policy_loss,
                                kl_penalty, metrics_to_floats, objective)

F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# Test data
# ----------------------------------------------------------------------------------------------
def make_batch(seed, B=6, T=9, empty_rows=(1,), big_fraction=0.15, per_token_adv=False, beyond_clamp=None):
    """Random [B, T] float64 batch: right-padded variable lengths, ~15% rejected valid tokens, some
    fully empty rows, old/current log-ratios that trigger the PPO clip, dual-clip and the +-20 clamp."""
    g = torch.Generator().manual_seed(seed)
    beyond_clamp = (seed % 3 == 2) if beyond_clamp is None else beyond_clamp
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    for r in empty_rows:
        if r < B:
            lengths[r] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None])
    mask &= torch.rand(B, T, generator=g) > 0.15           # rejection sampling inside sequences
    logp = -3.0 * torch.rand(B, T, generator=g, dtype=F64) - 1e-3
    delta = 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    big = torch.rand(B, T, generator=g) < big_fraction
    delta = torch.where(big, 2.0 * torch.sign(torch.randn(B, T, generator=g, dtype=F64)), delta)
    old = torch.clamp(logp + delta, max=-1e-4)
    if beyond_clamp and B > 0 and T > 1:   # log-ratios beyond +-20 (the clamp before exp)
        old[0, 0] = -30.0                  # logp - old >= 27
        logp[0, 1], old[0, 1] = -45.0, -1.0  # logp - old = -44
    if per_token_adv:
        adv = torch.randn(B, T, generator=g, dtype=F64)
    else:
        adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).clone()
    weights = 2.0 * torch.rand(B, T, generator=g, dtype=F64)
    ref = torch.clamp(logp + 0.5 * torch.randn(B, T, generator=g, dtype=F64), max=-1e-4)
    ent = 3.0 * torch.rand(B, T, generator=g, dtype=F64)   # per-token entropy of the policy
    return dict(logp=logp, old=old, adv=adv, mask=mask.to(F64), weights=weights, ref=ref, ent=ent)


# ----------------------------------------------------------------------------------------------
# Independent reference (loops; no megatron_rl code)
# ----------------------------------------------------------------------------------------------
def ref_token_loss(lp, old, a, w, loss_type, low, high, c):
    """One token's loss (0-d float64 tensor), plus (clipped, clipped_lower) booleans."""
    if loss_type == "reinforce":
        return -a * w * lp, False, False
    d = lp - old
    if float(d.detach()) > 20.0:
        d = torch.tensor(20.0, dtype=F64)
    elif float(d.detach()) < -20.0:
        d = torch.tensor(-20.0, dtype=F64)
    r = torch.exp(d)
    if float(r.detach()) < 1 - low:
        rc = torch.tensor(1 - low, dtype=F64)
    elif float(r.detach()) > 1 + high:
        rc = torch.tensor(1 + high, dtype=F64)
    else:
        rc = r
    l1, l2 = -a * r, -a * rc
    clipped = float(l2.detach()) > float(l1.detach())
    loss = l2 if clipped else l1
    clipped_lower = False
    if c is not None and a < 0:
        cap = -a * c
        if float(loss.detach()) > cap:
            loss, clipped_lower = torch.tensor(cap, dtype=F64), True
    return loss * w, clipped, clipped_lower


def ref_kl(lp, rf, kl_type):
    """One token's KL estimate from 0-d tensors (value and autograd path written out per type)."""
    x = lp - rf
    base = kl_type.rstrip("+")
    if base in ("k1", "kl"):
        v = x
    elif base == "abs":
        v = x if float(x.detach()) >= 0 else -x
    elif base in ("k2", "mse"):
        v = 0.5 * x * x
    else:
        nx = -x
        if float(nx.detach()) > 20:
            nx = torch.tensor(20.0, dtype=F64)
        elif float(nx.detach()) < -20:
            nx = torch.tensor(-20.0, dtype=F64)
        v = torch.exp(nx) - nx - 1
        if float(v.detach()) > 10:
            v = torch.tensor(10.0, dtype=F64)
    if kl_type.endswith("+"):                      # value of v, gradient of k2
        k2 = 0.5 * x * x
        v = k2 - float(k2.detach()) + float(v.detach())
    return v


def ref_policy_loss(data, cfg, use_weights, logp_leaf, loss_type="ppo_clip", ent_leaf=None):
    """Full reference: per-sequence lists of valid-token losses, aggregated by explicit loops; with
    ``cfg.entropy_coeff`` verl's bonus, ``- entropy_coeff * agg(entropy)`` in the same aggregation."""
    B, T = data["mask"].shape
    per_seq, kl_seq, ent_seq = [], [], []
    n_clip = n_lower = n_tok = 0
    kl_sum, ppo_kl_sum = 0.0, 0.0
    for i in range(B):
        row, krow = [], []
        for t in range(T):
            if data["mask"][i, t] != 1:
                continue
            lp = logp_leaf[i, t]
            old, a = float(data["old"][i, t]), float(data["adv"][i, t])
            w = float(data["weights"][i, t]) if use_weights else 1.0
            loss, cl, cll = ref_token_loss(lp, old, a, w, loss_type, cfg.clip_ratio_low,
                                           cfg.clip_ratio_high, cfg.clip_ratio_c)
            row.append(loss)
            n_tok += 1
            n_clip += cl
            n_lower += cll
            ppo_kl_sum += min(max(old - float(lp.detach()), -20.0), 20.0)
            if cfg.kl_loss_coef > 0:
                k = ref_kl(lp, float(data["ref"][i, t]), cfg.kl_loss_type)
                krow.append(k)
                kl_sum += float(k.detach())
        per_seq.append(row)
        kl_seq.append(krow)
        ent_seq.append([ent_leaf[i, t] for t in range(T) if data["mask"][i, t] == 1] if ent_leaf is not None else [])

    def agg(seqs):
        nonempty = [s for s in seqs if s]
        n_seq = len(nonempty)
        if n_seq == 0:
            return logp_leaf.sum() * 0.0
        if cfg.loss_agg_mode == "token-mean":
            return sum(x for s in nonempty for x in s) / n_tok
        if cfg.loss_agg_mode == "token-sum":
            return sum(x for s in nonempty for x in s)
        if cfg.loss_agg_mode == "seq-mean-token-sum":
            return sum(sum(s) for s in nonempty) / n_seq
        if cfg.loss_agg_mode == "seq-mean-token-mean":
            return sum(sum(s) / len(s) for s in nonempty) / n_seq
        factor = T if cfg.loss_scale_factor is None else cfg.loss_scale_factor
        return sum(sum(s) for s in nonempty) / (n_seq * factor)

    loss = agg(per_seq)
    if cfg.kl_loss_coef > 0:
        loss = loss + cfg.kl_loss_coef * agg(kl_seq)
    if cfg.entropy_coeff != 0:
        loss = loss - cfg.entropy_coeff * agg(ent_seq)
    denom = max(n_tok, 1)
    metrics = {"actor/pg_clipfrac": n_clip / denom, "actor/pg_clipfrac_lower": n_lower / denom,
               "actor/ppo_kl": ppo_kl_sum / denom}
    if cfg.kl_loss_coef > 0:
        metrics["actor/kl_loss"] = kl_sum / denom
    return loss, metrics


def run_both(data, cfg, use_weights, loss_type="ppo_clip"):
    """(ours, reference) as (loss, grad wrt logp, metrics)."""
    lp1 = data["logp"].clone().requires_grad_()
    out = compute_policy_loss(PolicyLoss.of(loss_type, cfg),
                              LossBatch(lp1, data["old"], data["adv"], data["mask"],
                                        is_weights=data["weights"] if use_weights else None,
                                        ref_log_probs=data["ref"] if cfg.kl_loss_coef > 0 else None))
    (g1,) = torch.autograd.grad(out.loss, lp1)
    lp2 = data["logp"].clone().requires_grad_()
    ref_loss, ref_metrics = ref_policy_loss(data, cfg, use_weights, lp2, loss_type)
    (g2,) = torch.autograd.grad(ref_loss, lp2, allow_unused=True)
    g2 = torch.zeros_like(lp2) if g2 is None else g2
    return (out.loss.detach(), g1, metrics_to_floats(out.metrics)), (ref_loss.detach(), g2, ref_metrics)


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_weights", [False, True], ids=["no_w", "is_w"])
@pytest.mark.parametrize("clip_ratio_c", [None, 3.0], ids=["no_dual", "dual"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_loss_matches_reference(loss_type, mode, clip_ratio_c, use_weights):
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_ratio_c, loss_agg_mode=mode)
    for seed in range(3):
        data = make_batch(seed, per_token_adv=bool(seed % 2))
        (l1, g1, m1), (l2, g2, m2) = run_both(data, cfg, use_weights, loss_type)
        torch.testing.assert_close(l1, l2, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)
        assert set(m1) == set(m2)
        for k in m1:
            assert m1[k] == pytest.approx(m2[k], rel=1e-12, abs=1e-12), k
        assert torch.all(g1[data["mask"] == 0] == 0)   # rejected / padded tokens get no gradient
        if loss_type == "ppo_clip":
            assert m2["actor/pg_clipfrac"] > 0          # the data really exercises the clip


def test_dual_clip_is_exercised():
    """Guard that the dual-clip branch is really hit by the data the reference test uses."""
    hits = 0
    cfg = PolicyLossConfig(clip_ratio_c=3.0)
    for seed in range(3):
        (_, _, m1), (_, _, m2) = run_both(make_batch(seed, per_token_adv=bool(seed % 2)), cfg, False)
        hits += m2["actor/pg_clipfrac_lower"] > 0
        assert m1["actor/pg_clipfrac_lower"] == pytest.approx(m2["actor/pg_clipfrac_lower"])
    assert hits > 0


def test_seq_mean_token_sum_norm_with_scale_factor():
    cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=37.0)
    (l1, g1, _), (l2, g2, _) = run_both(make_batch(7), cfg, True)
    torch.testing.assert_close(l1, l2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kl_type", ["k1", "abs", "k2", "low_var_kl", "k3+", "low_var_kl+", "k1+"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_kl_loss_term_matches_reference(kl_type, mode):
    cfg = PolicyLossConfig(loss_agg_mode=mode, kl_loss_coef=0.37, kl_loss_type=kl_type, clip_ratio_c=None)
    (l1, g1, m1), (l2, g2, m2) = run_both(make_batch(11), cfg, True)
    torch.testing.assert_close(l1, l2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)
    assert m1["actor/kl_loss"] == pytest.approx(m2["actor/kl_loss"], rel=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_entropy_bonus_matches_reference(loss_type, mode):
    """verl's entropy bonus: loss = pg_loss (+ KL) - entropy_coeff * agg(entropy, mask, loss_agg_mode); value
    and gradients (w.r.t. log-probs and entropy) equal the loop reference's autograd."""
    cfg = PolicyLossConfig(loss_agg_mode=mode, entropy_coeff=0.013, kl_loss_coef=0.2, loss_scale_factor=5.0)
    data = make_batch(5, per_token_adv=True)
    lp1, e1 = data["logp"].clone().requires_grad_(), data["ent"].clone().requires_grad_()
    out = compute_policy_loss(PolicyLoss.of(loss_type, cfg),
                              LossBatch(lp1, data["old"], data["adv"], data["mask"], is_weights=data["weights"],
                                        ref_log_probs=data["ref"], entropy=e1))
    g_lp1, g_e1 = torch.autograd.grad(out.loss, (lp1, e1))
    lp2, e2 = data["logp"].clone().requires_grad_(), data["ent"].clone().requires_grad_()
    ref_loss, _ = ref_policy_loss(data, cfg, True, lp2, loss_type, ent_leaf=e2)
    g_lp2, g_e2 = torch.autograd.grad(ref_loss, (lp2, e2))
    torch.testing.assert_close(out.loss.detach(), ref_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_lp1, g_lp2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_e1, g_e2, rtol=1e-12, atol=1e-12)
    valid = data["mask"] == 1
    assert torch.all(g_e1[valid] < 0) and torch.all(g_e1[~valid] == 0)  # more entropy lowers the loss
    no_bonus_cfg = PolicyLossConfig(loss_agg_mode=mode, kl_loss_coef=0.2, loss_scale_factor=5.0)
    no_bonus = compute_policy_loss(PolicyLoss.of(loss_type, no_bonus_cfg),
                                   LossBatch(data["logp"], data["old"], data["adv"], data["mask"],
                                             is_weights=data["weights"], ref_log_probs=data["ref"]))
    assert no_bonus.entropy_loss is None
    torch.testing.assert_close(out.loss.detach(), no_bonus.loss - 0.013 * out.entropy_loss.detach(), rtol=1e-12,
                               atol=1e-12)


def test_entropy_bonus_needs_the_entropy():
    with pytest.raises(ValueError, match=r"entropy is required because PolicyLossConfig.entropy_coeff=0.1"):
        d = make_batch(0)
        compute_policy_loss(PolicyLoss.of("ppo_clip", PolicyLossConfig(entropy_coeff=0.1)),
                            LossBatch(d["logp"], d["old"], d["adv"], d["mask"]))
    d = make_batch(0)
    d["ent"][0, 0] = float("nan")
    d["mask"][0, 0] = 1.0
    with pytest.raises(ValueError, match=r"entropy has NaN/inf values at valid \(mask=1\) positions"):
        compute_policy_loss(PolicyLoss.of("ppo_clip", PolicyLossConfig(entropy_coeff=0.1)),
                            LossBatch(d["logp"], d["old"], d["adv"], d["mask"], entropy=d["ent"]))


KL_CLOSED_FORM = {
    # name: (value(x), d value / d logp (x))  with x = logp - ref
    "k1": (lambda x: x, lambda x: 1.0),
    "abs": (lambda x: abs(x), lambda x: math.copysign(1.0, x)),
    "k2": (lambda x: 0.5 * x * x, lambda x: x),
    # k3 is capped at 10 (verl): x = -3 gives exp(3) - 4 = 16.1 -> 10 with zero gradient
    "k3": (lambda x: min(math.exp(-x) + x - 1, 10.0),
           lambda x: 1 - math.exp(-x) if math.exp(-x) + x - 1 < 10 else 0.0),
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


@pytest.mark.parametrize("kl_type", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                                     "k1+", "abs+", "k2+", "k3+", "low_var_kl+"])
def test_kl_estimators_closed_form(kl_type):
    xs = [-3.0, -0.7, -0.1, 0.05, 0.4, 1.3, 2.0]
    ref = torch.full((1, len(xs)), -2.5, dtype=F64)
    lp = (ref + torch.tensor([xs], dtype=F64)).requires_grad_()
    v = kl_penalty(lp, ref, kl_type)
    (g,) = torch.autograd.grad(v.sum(), lp)
    base = kl_type.rstrip("+")
    val_fn, grad_fn = KL_CLOSED_FORM[ALIASES.get(base, base)]
    for j, x in enumerate(xs):
        assert float(v[0, j].detach()) == pytest.approx(val_fn(x), rel=1e-12, abs=1e-14)
        want_grad = x if kl_type.endswith("+") else grad_fn(x)     # "+" = k2 gradient
        assert float(g[0, j]) == pytest.approx(want_grad, rel=1e-12, abs=1e-14)


def test_k3_clamps_never_inf():
    """|log-ratio| far beyond 20: k3 stays finite (log ratio clamped at 20, value capped at 10)."""
    lp = torch.tensor([[-0.01, -90.0, -1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-80.0, -0.01, -1.0]], dtype=F64)
    for t in ("k3", "low_var_kl", "k3+"):
        v = kl_penalty(lp, ref, t)
        (g,) = torch.autograd.grad(v.sum(), lp)
        assert torch.isfinite(v).all() and torch.isfinite(g).all()
        assert float(v[0, 1].detach()) == 10.0 and float(v[0, 2].detach()) == 0.0
        # x = logp - ref = 79.99: exp(-x) ~ 0, k3 = x - 1 -> capped at 10
        assert float(v[0, 0].detach()) == 10.0
    v32 = kl_penalty(lp.detach().float(), ref.float(), "k3")
    assert torch.isfinite(v32).all()


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_input_selection(loss_type):
    """Bypass: old := rollout; PPO-clip drops the correction weights, REINFORCE keeps them."""
    d = make_batch(3)
    rollout = d["old"]
    old, w = objective(loss_type).loss_inputs(True, rollout, None, d["weights"])
    assert old is rollout
    assert (w is None) if loss_type == "ppo_clip" else (w is d["weights"])
    old2, w2 = objective(loss_type).loss_inputs(False, rollout, d["ref"], d["weights"])
    assert old2 is d["ref"] and w2 is d["weights"]
    # bypass PPO-clip == plain PPO on pi_theta / pi_rollout (reference with no weights)
    cfg = PolicyLossConfig()
    lp = d["logp"].clone().requires_grad_()
    out = compute_policy_loss(PolicyLoss.of(loss_type, cfg), LossBatch(lp, old, d["adv"], d["mask"], is_weights=w))
    ref_loss, _ = ref_policy_loss(d, cfg, loss_type == "reinforce", d["logp"].clone().requires_grad_(), loss_type)
    torch.testing.assert_close(out.loss.detach(), ref_loss.detach(), rtol=1e-12, atol=1e-12)


def test_all_tokens_rejected_gives_zero_loss_and_zero_grad():
    d = make_batch(5)
    d["mask"].zero_()
    for mode in LOSS_AGG_MODES:
        for lt in ("ppo_clip", "reinforce"):
            cfg = PolicyLossConfig(loss_agg_mode=mode, kl_loss_coef=0.1)
            lp = d["logp"].clone().requires_grad_()
            out = compute_policy_loss(PolicyLoss.of(lt, cfg),
                                      LossBatch(lp, d["old"], d["adv"], d["mask"], is_weights=d["weights"],
                                                ref_log_probs=d["ref"]))
            (g,) = torch.autograd.grad(out.loss, lp)
            assert float(out.loss.detach()) == 0.0 and torch.all(g == 0)
            assert all(v == 0.0 for v in metrics_to_floats(out.metrics).values())
            assert all(float(v.count) == 0 for v in out.metrics.values())


def test_float32_inputs_match_float64_reference():
    """fp32 log-probs (the trainer's dtype) agree with the float64 reference to fp32 precision."""
    d = make_batch(9)
    cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean", clip_ratio_c=3.0)
    d32 = {k: v.float() for k, v in d.items()}
    lp = d32["logp"].clone().requires_grad_()
    out = compute_policy_loss(PolicyLoss.of("ppo_clip", cfg),
                              LossBatch(lp, d32["old"], d32["adv"], d32["mask"], is_weights=d32["weights"]))
    assert out.loss.dtype == torch.float32
    (g,) = torch.autograd.grad(out.loss, lp)
    d64 = {k: v.double() for k, v in d32.items()}
    lp2 = d64["logp"].clone().requires_grad_()
    ref_loss, _ = ref_policy_loss(d64, cfg, True, lp2)
    (g2,) = torch.autograd.grad(ref_loss, lp2)
    torch.testing.assert_close(out.loss.detach().double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g.double(), g2, rtol=1e-5, atol=1e-6)


def test_bfloat16_inputs_computed_in_float32():
    """bf16 log-probs (e.g. straight from a bf16 model) are upcast: fp32 loss, finite, matching the
    float64 reference on the same (bf16-rounded) values."""
    d = {k: v.to(torch.bfloat16) for k, v in make_batch(4).items()}
    cfg = PolicyLossConfig(loss_agg_mode="token-mean")
    lp = d["logp"].clone().requires_grad_()
    out = compute_policy_loss(PolicyLoss.of("ppo_clip", cfg),
                              LossBatch(lp, d["old"], d["adv"], d["mask"], is_weights=d["weights"]))
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    d64 = {k: v.double() for k, v in d.items()}
    ref_loss, _ = ref_policy_loss(d64, cfg, True, d64["logp"].clone().requires_grad_())
    torch.testing.assert_close(out.loss.detach().double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)


def test_large_global_token_count_is_exact_in_float32():
    """Token counts above 2^24 are not representable in fp32; the division happens in float64."""
    from megatron_rl.losses import LossDenominators, aggregate_loss
    loss = torch.tensor([[3.0, 5.0]], dtype=torch.float32)
    n = 2 ** 24 + 1
    out = aggregate_loss(loss, torch.ones(1, 2), "token-mean", LossDenominators(num_tokens=n, num_seqs=1))
    assert out.dtype == torch.float32
    assert float(out) == float(torch.tensor(8.0 / n, dtype=torch.float32))

"""KPop (``rollout_rs: binary_kl``) against a float64 transcription of AReaL's own functions.

Transcribed from AReaL ``areal/utils/functional/functional.py`` at commit
13353cc6767b7e47d45eed5fd87a0a6e669a246c (PR #1405, "Supporting features for IcePop and KPop"):
``compute_binary_kl_divergence`` and the token-level ``action='mask'`` path of ``apply_rejection_sampling`` with
``metric='binary_kl'`` (``_check_bounds`` without ``lower``), in float64. The DP / CP exactness of the option is in
``tests/integration/test_correction_distributed.py`` (config "kpop"), bypass mode in ``test_correction_in_loss.py``.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.correction import RolloutCorrectionConfig, compute_rollout_correction
from megatron_rl.correction.binary_kl import kpop_statistic


def areal_compute_binary_kl_divergence(log_p, log_q, eps=1e-8):
    p = torch.clamp(torch.exp(log_p), eps, 1.0 - eps)
    q = torch.clamp(torch.exp(log_q), eps, 1.0 - eps)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def areal_apply_rejection_sampling_token_binary_kl(proximal_logprobs, old_logprobs, loss_mask, upper):
    """(updated_mask, behave_imp_weight, filtered_fraction) of the token-level mask path, float64."""
    log_ratio = proximal_logprobs.detach().double() - old_logprobs.detach().double()
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    kl_fwd = areal_compute_binary_kl_divergence(proximal_logprobs.detach().double(), old_logprobs.detach().double())
    kl_rev = areal_compute_binary_kl_divergence(old_logprobs.detach().double(), proximal_logprobs.detach().double())
    metric = torch.maximum(kl_fwd, kl_rev)
    behave_imp_weight = torch.exp(log_ratio)
    in_bounds = metric <= upper
    candidates = loss_mask.bool()
    updated_mask = (candidates & in_bounds).to(loss_mask.dtype)
    filtered_fraction = (candidates & ~in_bounds).sum().item() / max(candidates.sum().item(), 1)
    behave_imp_weight = torch.where(updated_mask.bool(), behave_imp_weight, 0.0)
    return updated_mask, behave_imp_weight, filtered_fraction


def _batch(seed, B=6, T=40):
    g = torch.Generator().manual_seed(seed)
    lp_old = -torch.rand(B, T, generator=g, dtype=torch.float64) ** 2 * 6   # many likely tokens, some rare
    lp_old[0, :4] = 0.0                                                    # p = 1: the clamp's boundary
    lp_prox = (lp_old + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mask = (torch.rand(B, T, generator=g) < 0.85).double()
    mask[3] = 0.0                                                          # an empty row
    return lp_prox, lp_old, mask


def test_statistic_is_areals():
    lp_prox, lp_old, _ = _batch(0)
    want = torch.maximum(areal_compute_binary_kl_divergence(lp_prox, lp_old),
                         areal_compute_binary_kl_divergence(lp_old, lp_prox))
    got = kpop_statistic(lp_prox, lp_old)
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    got32 = kpop_statistic(lp_prox.float(), lp_old.float())   # float32 log-probs: computed in float64
    torch.testing.assert_close(got32, torch.maximum(areal_compute_binary_kl_divergence(
        lp_prox.float().double(), lp_old.float().double()), areal_compute_binary_kl_divergence(
        lp_old.float().double(), lp_prox.float().double())), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("phi", [0.02, 0.1, 2.0])
def test_mask_weights_and_fraction_are_areals(phi):
    """Decoupled: p = the recomputed (proximal) log-probs, q = the rollout's; the kept tokens keep the untruncated
    ratio (preset decoupled_token_kpop)."""
    lp_prox, lp_old, mask = _batch(1)
    cfg = RolloutCorrectionConfig.decoupled_token_kpop(threshold=phi)
    res = compute_rollout_correction(lp_prox, lp_old, mask, cfg)
    want_mask, want_w, frac = areal_apply_rejection_sampling_token_binary_kl(lp_prox, lp_old, mask, phi)
    assert torch.equal(res.loss_mask.bool(), want_mask.bool())
    assert 0 < int(want_mask.sum()) < int(mask.sum()) or phi == 2.0
    torch.testing.assert_close(res.weights.double(), want_w, rtol=1e-6, atol=0.0)
    assert res.metrics["rollout_corr/rollout_rs_binary_kl_masked_fraction"] == pytest.approx(frac, rel=1e-12)


def test_a_token_at_the_threshold_is_kept():
    """AReaL keeps metric <= phi (its PR moved from < to <=)."""
    lp_prox = torch.tensor([[-0.3, -1.2, -2.0]], dtype=torch.float64)
    lp_old = torch.tensor([[-0.9, -1.0, -0.1]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    phi = float(torch.maximum(areal_compute_binary_kl_divergence(lp_prox, lp_old),
                              areal_compute_binary_kl_divergence(lp_old, lp_prox))[0, 0])
    res = compute_rollout_correction(lp_prox, lp_old, mask, RolloutCorrectionConfig(rollout_rs="binary_kl",
                                                                                    rollout_rs_threshold=phi))
    assert res.loss_mask[0].tolist() == [1.0, 1.0, 0.0]


def test_default_threshold_and_refusals():
    assert RolloutCorrectionConfig(rollout_rs="binary_kl").rs_bounds["binary_kl"].upper == 2.0
    assert RolloutCorrectionConfig.decoupled_token_kpop().rs_bounds["binary_kl"].upper == 2.0
    assert RolloutCorrectionConfig.from_dict({"preset": "decoupled_token_kpop", "threshold": 0.1}) \
        .rs_bounds["binary_kl"].upper == 0.1
    with pytest.raises(ValueError, match="rollout_rs_threshold: required"):
        RolloutCorrectionConfig(rollout_rs="binary_kl,seq_mean_k3")
    with pytest.raises(ValueError, match=r"rollout_rs_threshold\[binary_kl\]"):
        RolloutCorrectionConfig(rollout_rs="binary_kl", rollout_rs_threshold="0.1_2")
    with pytest.raises(ValueError, match="must be a finite positive number"):
        RolloutCorrectionConfig(rollout_rs="binary_kl", rollout_rs_threshold=-1.0)
    assert RolloutCorrectionConfig.decoupled_token_kpop().is_bounds.upper == pytest.approx(math.exp(20.0))

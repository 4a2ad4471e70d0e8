"""Bypass mode's in-loss correction (``correction.correct_in_loss``) and what ``CorrectionResult`` gives the loss.

``correct_in_loss`` on one micro-batch equals the independent reference of ``tests/correction_reference.py`` on the
same log-probs (weights, rejection mask; batch normalisation over the micro-batch's kept tokens / sequences), for
token, sequence and geometric IS with token and sequence rejection options and the veto. ``CorrectionResult`` in
bypass mode gives the loss no weights and the mask before rejection (invalid sequences removed); decoupled mode is
unchanged. CP / DP / PP: ``tests/integration/test_bypass_steps.py``.
"""
import pytest
import torch

from megatron_rl.correction import RolloutCorrectionConfig, compute_rollout_correction, correct_in_loss
from tests.correction_reference import make_batch, reference

CFGS = {
    "seq_tis_geo_rs": dict(rollout_is="sequence", rollout_is_threshold=1.5, rollout_rs="seq_mean_k1",
                           rollout_rs_threshold=1.2),
    "token_all": dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                      rollout_rs="token_k1,seq_mean_k3,seq_max_k2,seq_sum_k1",
                      rollout_rs_threshold="0.4_2.5,0.05,0.3,0.01_50", rollout_token_veto_threshold=1e-4),
    "seq_mask_bn": dict(rollout_is="sequence", rollout_is_threshold="0.2_5", rollout_is_batch_normalize=True,
                        rollout_rs="token_k2,seq_sum_k3", rollout_rs_threshold="0.5,1.5"),
    "geo_bn": dict(rollout_is="geometric", rollout_is_threshold=1.2, rollout_is_batch_normalize=True,
                   rollout_rs="seq_mean_k1", rollout_rs_threshold="0.8_1.1", rollout_token_veto_threshold=1e-3),
    "rs_only": dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.3_3"),
    "kpop": dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="binary_kl", rollout_rs_threshold=0.05),
}


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
@pytest.mark.parametrize("name", list(CFGS))
def test_in_loss_correction_matches_reference(name, loss_type):
    lt, lr, mask = make_batch(5, B=10, T=14, spread=0.5, empty_rows=(4,))
    cfg = RolloutCorrectionConfig(**CFGS[name], bypass_mode=True, loss_type=loss_type)
    ref_w, ref_mask, _ = reference(lt.double(), lr.double(), mask, **cfg.to_dict())
    lc = correct_in_loss(lt, lr, mask, cfg)
    ref_keep = torch.tensor(ref_mask, dtype=torch.bool)
    assert torch.equal(lc.keep, ref_keep)
    assert 0 < int(ref_keep.sum()) < int(mask.sum()), "the case must reject some tokens and keep others"
    torch.testing.assert_close(lc.kept_tokens, ref_keep.sum(1).double())
    if ref_w is None:
        assert lc.weights is None
    else:
        assert lc.weights.dtype == torch.float32 and not lc.weights.requires_grad
        torch.testing.assert_close(lc.weights.double(), torch.tensor(ref_w, dtype=torch.float64), rtol=2e-6,
                                   atol=1e-7)
        assert (lc.batch_norm_factor != 1.0) == cfg.rollout_is_batch_normalize


def test_in_loss_correction_reads_the_log_probs_it_is_given():
    """Another pi_theta, other decisions: nothing of an earlier call is kept."""
    lt, lr, mask = make_batch(9, B=8, T=12, spread=0.3, empty_rows=())
    cfg = RolloutCorrectionConfig(**CFGS["seq_tis_geo_rs"], bypass_mode=True, loss_type="reinforce")
    first = correct_in_loss(lt, lr, mask, cfg)
    moved = torch.where(mask.bool(), lt - 0.15, lt)
    later = correct_in_loss(moved, lr, mask, cfg)
    ref_w, ref_mask, _ = reference(moved.double(), lr.double(), mask, **cfg.to_dict())
    assert torch.equal(later.keep, torch.tensor(ref_mask, dtype=torch.bool))
    assert not torch.equal(later.keep, first.keep)
    torch.testing.assert_close(later.weights.double(), torch.tensor(ref_w, dtype=torch.float64), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_bypass_result_gives_the_loss_the_mask_before_rejection(loss_type):
    lt, lr, mask = make_batch(3, B=8, T=12, spread=0.5, empty_rows=(), pad_garbage=False, extreme=False)
    lr[2, 0] = float("nan")   # an invalid rollout log-prob: its sequence leaves the loss (on_invalid: reject)
    kw = dict(CFGS["seq_tis_geo_rs"], on_invalid="reject")
    bypass = compute_rollout_correction(lt, lr, mask, RolloutCorrectionConfig(**kw, bypass_mode=True,
                                                                               loss_type=loss_type))
    expected = mask.clone()
    expected[2] = 0
    assert bypass.recomputed_in_loss and torch.equal(bypass.loss_mask, expected)
    assert not torch.equal(bypass.response_mask, bypass.loss_mask), "the first pass rejects some sequences"
    old, w = bypass.loss_inputs(lt, lr)
    assert old is lr and w is None and bypass.weights is not None   # the first pass's weights: metrics only
    decoupled = compute_rollout_correction(lt, lr, mask, RolloutCorrectionConfig(**kw))
    assert not decoupled.recomputed_in_loss and decoupled.loss_mask is decoupled.response_mask
    old, w = decoupled.loss_inputs(lt, lr)
    assert old is lt and w is decoupled.weights

"""compute_rollout_correction vs the independent float64 per-sequence reference (single process)."""
import math
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_rl.correction import PRESETS, RolloutCorrectionConfig, compute_rollout_correction
from tests.correction_reference import check_against_reference, make_batch

CUSTOM = [
    dict(rollout_is="token", rollout_is_threshold=2.0),
    dict(rollout_is="token", rollout_is_threshold=1.2, rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True,
         rollout_rs="token_k2", rollout_rs_threshold=0.05),
    dict(rollout_is="geometric", rollout_is_threshold="0.8_1.25", rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_threshold="0.1_10"),
    dict(rollout_is="token", rollout_is_threshold="0.5_1.5", rollout_rs="token_k1,seq_sum_k2,seq_max_k3",
         rollout_rs_threshold="0.6_1.3,2.0,0.5", rollout_token_veto_threshold=1e-4),
    dict(rollout_rs="seq_sum_k1,seq_mean_k1,seq_mean_k2,seq_max_k2,token_k3",
         rollout_rs_threshold="0.05_3.0,2.0,0.02,0.3,0.4"),
    dict(rollout_is="geometric", rollout_is_threshold=1.5, rollout_rs="seq_sum_k3", rollout_rs_threshold=1.0,
         rollout_token_veto_threshold=1e-3, rollout_is_batch_normalize=True),
    dict(rollout_rs="token_k1", rollout_rs_threshold=1.5),  # a float U for k1 means [1/U, U]
    dict(rollout_rs="token_k1", rollout_rs_threshold="0.9_1.6"),  # asymmetric: bounds on r itself
    dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
         rollout_rs="token_k2", rollout_rs_threshold=0.02, rollout_token_veto_threshold=1e-3),
]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_matches_reference(preset):
    cfg = getattr(RolloutCorrectionConfig, preset)()
    lt, lr, mask = make_batch(seed=zlib.crc32(preset.encode()) % 1000)  # stable across runs
    check_against_reference(compute_rollout_correction(lt, lr, mask, cfg), lt, lr, mask, cfg)


@pytest.mark.parametrize("i", range(len(CUSTOM)))
@pytest.mark.parametrize("seed", [0, 1])
def test_custom_configs_match_reference(i, seed):
    cfg = RolloutCorrectionConfig(**CUSTOM[i])
    lt, lr, mask = make_batch(seed=seed + 10 * i)
    check_against_reference(compute_rollout_correction(lt, lr, mask, cfg), lt, lr, mask, cfg)


@pytest.mark.parametrize("i", range(len(CUSTOM)))
def test_float64_inputs_match_reference_to_float64_tolerance(i):
    """float64 log-probs are corrected in float64 per token: atol 1e-9 (float32 inputs: 1e-7)."""
    cfg = RolloutCorrectionConfig(**CUSTOM[i])
    lt, lr, mask = make_batch(seed=100 + i)
    lt, lr = lt.double() + 1e-9 * torch.rand(lt.shape, generator=torch.Generator().manual_seed(i)), lr.double()
    lt = torch.where(mask.bool(), lt.clamp(max=0.0), lt)
    check_against_reference(compute_rollout_correction(lt, lr, mask, cfg), lt, lr, mask, cfg)


def test_bf16_rollout_log_probs_are_accepted():
    """Mixed dtypes (fp32 training, bf16 rollout): corrected like the fp32 upcast of the bf16 values."""
    cfg = RolloutCorrectionConfig(**CUSTOM[5])
    lt, lr, mask = make_batch(seed=7)
    lr16 = lr.to(torch.bfloat16)
    res = compute_rollout_correction(lt, lr16, mask, cfg)
    check_against_reference(res, lt, lr16.float(), mask, cfg)


def test_asymmetric_k1_bounds_apply_to_pi_train_over_pi_rollout():
    # r = 1.5 for every token: inside [0.9, 1.6] on r, outside on 1/r = 0.667 (verl's convention)
    lr = torch.full((2, 3), -1.0)
    lt = lr + math.log(1.5)
    mask = torch.ones(2, 3)
    cfg = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.9_1.6")
    res = compute_rollout_correction(lt, lr, mask, cfg)
    assert res.response_mask.sum() == 6
    cfg = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.5_1.2")
    assert compute_rollout_correction(lt, lr, mask, cfg).response_mask.sum() == 0


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), B=st.integers(1, 7), T=st.integers(1, 9),
       spread=st.sampled_from([0.0, 0.05, 0.5, 3.0]), cfg_i=st.integers(0, len(CUSTOM) - 1),
       n_empty=st.integers(0, 2))
def test_property_matches_reference(seed, B, T, spread, cfg_i, n_empty):
    cfg = RolloutCorrectionConfig(**CUSTOM[cfg_i])
    lt, lr, mask = make_batch(seed, B=B, T=T, spread=spread, empty_rows=tuple(range(B - n_empty, B)),
                              extreme=seed % 2 == 0)
    res = compute_rollout_correction(lt, lr, mask, cfg)
    check_against_reference(res, lt, lr, mask, cfg)
    if res.weights is not None:
        assert torch.isfinite(res.weights).all()
        assert (res.weights[res.response_mask == 0] == 0).all()
    assert ((res.response_mask == 0) | (mask == 1)).all()  # rejection never adds tokens


def test_everything_rejected_keeps_metrics_defined():
    lt, lr, mask = make_batch(3, spread=2.0)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_batch_normalize=True,
                                  rollout_rs="seq_mean_k2", rollout_rs_threshold=1e-12)
    res = compute_rollout_correction(lt, lr, mask, cfg)
    assert res.response_mask.sum() == 0 and res.weights.abs().sum() == 0
    assert res.metrics["rollout_corr/kept_token_count"] == 0
    assert res.metrics["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert res.metrics["rollout_corr/rollout_is_batch_norm_factor"] == 1.0
    assert all(math.isfinite(v) for v in res.metrics.values())
    check_against_reference(res, lt, lr, mask, cfg)


def test_empty_batch_is_nan_free():
    cfg = RolloutCorrectionConfig.decoupled_seq_is_rs()
    lt, lr, mask = torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(3, 4)
    res = compute_rollout_correction(lt, lr, mask, cfg)
    assert all(math.isfinite(v) for v in res.metrics.values())
    assert res.metrics["rollout_corr/valid_token_count"] == 0
    check_against_reference(res, lt, lr, mask, cfg)


def test_bool_mask_and_dtype_preserved():
    lt, lr, mask = make_batch(5)
    cfg = RolloutCorrectionConfig.decoupled_token_is()
    res = compute_rollout_correction(lt, lr, mask.bool(), cfg)
    assert res.response_mask.dtype == torch.bool
    res_f = compute_rollout_correction(lt, lr, mask, cfg)
    assert res_f.response_mask.dtype == mask.dtype
    torch.testing.assert_close(res.weights, res_f.weights)


def test_inputs_not_modified_and_weights_detached():
    lt, lr, mask = make_batch(6)
    lt.requires_grad_(True)
    before = (lt.detach().clone(), lr.clone(), mask.clone())
    res = compute_rollout_correction(lt, lr, mask, RolloutCorrectionConfig.decoupled_token_is())
    assert not res.weights.requires_grad
    for a, b in zip((lt.detach(), lr, mask), before):
        assert torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0))


def test_thresholds_are_inclusive():
    # log r = 0.5 exactly: k2 = 0.125; a bound of exactly 0.125 keeps the token (verl: stat <= U)
    lr, lt, mask = torch.full((1, 2), -1.0), torch.full((1, 2), -0.5), torch.ones(1, 2)
    keep = RolloutCorrectionConfig(rollout_rs="token_k2", rollout_rs_threshold=0.125)
    assert compute_rollout_correction(lt, lr, mask, keep).response_mask.sum() == 2
    drop = RolloutCorrectionConfig(rollout_rs="token_k2", rollout_rs_threshold=0.1249999)
    assert compute_rollout_correction(lt, lr, mask, drop).response_mask.sum() == 0

"""Config validation, presets (verl's defaults), verl / seed-era dict migration, and bad input."""
import logging
import math

import pytest
import torch

from megatron_rl.correction import PRESETS, RolloutCorrectionConfig, compute_rollout_correction
from tests.correction_reference import check_against_reference, make_batch

# verl's latest RolloutCorrectionConfig presets (verl/trainer/config/algorithm.py): spec data.
VERL_PRESETS = {
    "decoupled_token_is": dict(rollout_is="token", rollout_is_threshold=2.0),
    "decoupled_seq_is": dict(rollout_is="sequence", rollout_is_threshold=2.0),
    "decoupled_token_icepop": dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
    "decoupled_seq_is_rs": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
                                rollout_rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "decoupled_geo_rs_token_tis": dict(rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "decoupled_k3_rs": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_seq_tis": dict(rollout_is="sequence", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_token_tis": dict(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "bypass_ppo_clip": dict(bypass_mode=True),
    "bypass_ppo_clip_geo_rs": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001", bypass_mode=True),
    "bypass_ppo_clip_k3_rs": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01, bypass_mode=True),
    "bypass_pg_is": dict(rollout_is="sequence", bypass_mode=True, loss_type="reinforce"),
    "bypass_pg_token_icepop": dict(rollout_is="token", rollout_is_threshold="0.5_5.0", bypass_mode=True,
                                   loss_type="reinforce"),
    "bypass_pg_geo_rs": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001", bypass_mode=True,
                             loss_type="reinforce"),
    "bypass_pg_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_rs="seq_mean_k1",
                                     rollout_rs_threshold="0.999_1.001", bypass_mode=True, loss_type="reinforce"),
    "bypass_pg_geo_rs_token_tis": dict(rollout_is="token", rollout_rs="seq_mean_k1",
                                       rollout_rs_threshold="0.999_1.001", bypass_mode=True, loss_type="reinforce"),
    "disabled": dict(),
}


@pytest.mark.parametrize("name", list(VERL_PRESETS))
def test_verl_presets_have_verl_defaults(name):
    assert getattr(RolloutCorrectionConfig, name)() == RolloutCorrectionConfig(**VERL_PRESETS[name])


def test_every_listed_preset_exists_and_from_dict_preset_key_works():
    assert set(VERL_PRESETS) <= set(PRESETS)
    for name in PRESETS:
        assert RolloutCorrectionConfig.from_dict({"preset": name}) == getattr(RolloutCorrectionConfig, name)()
    cfg = RolloutCorrectionConfig.from_dict({"preset": "decoupled_token_is", "threshold": 3.0,
                                             "rollout_is_batch_normalize": True})
    assert cfg.rollout_is_threshold == 3.0 and cfg.rollout_is_batch_normalize


def test_verl_block_accepted_as_is():
    block = {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
             "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0", "bypass_mode": False,
             "loss_type": "ppo_clip", "debug_rollout_actor_probs": False}
    assert RolloutCorrectionConfig.from_dict(block) == RolloutCorrectionConfig.decoupled_seq_is_rs()


@pytest.mark.parametrize("legacy, expected", [
    ({"rollout_is_threshold": 2.0, "rollout_is": True, "rollout_is_level": "token", "rollout_is_mode": "truncate",
      "rollout_is_veto_threshold": 1e-4},
     dict(rollout_is="token", rollout_is_threshold=2.0, rollout_token_veto_threshold=1e-4)),
    ({"rollout_is_threshold": 2.0, "rollout_is": True, "rollout_is_level": "sequence", "rollout_is_mode": "mask",
      "rollout_is_threshold_lower": 0.25},
     dict(rollout_is="sequence", rollout_is_threshold="0.25_2.0")),
    ({"rollout_is_threshold": 2.0, "rollout_is": False, "rollout_is_level": "geometric"}, dict(rollout_is=None)),
    ({"rollout_is": "sequence", "rollout_rs": "geometric", "rollout_rs_threshold": 1.001,
      "rollout_rs_threshold_lower": 0.999, "bypass_old_logprob_for_rollout": True,
      "use_pure_rollout_correction": True},
     dict(rollout_is="sequence", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001", bypass_mode=True,
          loss_type="reinforce")),
    ({"rollout_is": "token", "rollout_rs": "sequence", "rollout_rs_threshold": 2.0, "use_policy_gradient": False},
     dict(rollout_is="token", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")),
    ({"tis_imp_ratio_cap": 3.0}, dict(rollout_is="token", rollout_is_threshold=3.0)),
])
def test_seed_era_keys_translate_with_hint(legacy, expected, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_rl.correction"):
        cfg = RolloutCorrectionConfig.from_dict(legacy)
    assert cfg == RolloutCorrectionConfig(**expected)
    assert any("seed-era key" in r.message for r in caplog.records)


def test_unknown_key_names_nearest():
    with pytest.raises(ValueError, match=r"unknown key 'rollout_is_treshold'.*did you mean 'rollout_is_threshold'"):
        RolloutCorrectionConfig.from_dict({"rollout_is_treshold": 2.0})
    with pytest.raises(ValueError, match="unknown preset 'decoupled_tokn_is'.*decoupled_token_is"):
        RolloutCorrectionConfig.from_dict({"preset": "decoupled_tokn_is"})


@pytest.mark.parametrize("kwargs, match", [
    (dict(rollout_is="tokens"), "rollout_is: 'tokens'"),
    (dict(rollout_is_threshold=0.0), "rollout_is_threshold"),
    (dict(rollout_is_threshold=-1.0), "rollout_is_threshold"),
    (dict(rollout_is_threshold="2_0.5"), "lower bound 2.0 exceeds upper bound 0.5"),
    (dict(rollout_is_threshold="abc"), "not a number"),
    (dict(rollout_rs="token_k3"), r"rollout_rs_threshold: required"),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=1.0), r"unknown option 'token_k4'.*did you mean"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_2"), "one upper bound"),
    (dict(rollout_rs="token_k2,seq_mean_k3", rollout_rs_threshold="1,2,3"), "3 thresholds for 2"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=-0.5), r"rollout_rs_threshold\[token_k2\]"),
    (dict(rollout_token_veto_threshold=2.0), "rollout_token_veto_threshold"),
    (dict(loss_type="ppo"), "loss_type"),
    (dict(on_invalid="ignore"), "on_invalid"),
    (dict(rollout_is_batch_normalize="yes"), "rollout_is_batch_normalize"),
])
def test_bad_config_values_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrectionConfig(**kwargs)


def test_bad_tensors_are_named():
    lt, lr, mask = make_batch(1, B=4, T=5)
    cfg = RolloutCorrectionConfig.decoupled_token_is()
    with pytest.raises(ValueError, match=r"rollout_log_probs: shape \(4, 4\) does not match response_mask"):
        compute_rollout_correction(lt, lr[:, :4], mask, cfg)
    with pytest.raises(ValueError, match="train_log_probs: expected a floating dtype"):
        compute_rollout_correction(lt.long(), lr, mask, cfg)
    bad = mask.clone()
    bad[2, 1] = 0.5
    with pytest.raises(ValueError, match=r"response_mask: 1 values are not 0/1, first at \[seq 2, token 1\]"):
        compute_rollout_correction(lt, lr, bad, cfg)
    with pytest.raises(ValueError, match="expected shape"):
        compute_rollout_correction(lt[0], lr[0], mask[0], cfg)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 0.5])
def test_invalid_log_probs_raise_with_count_and_position(value):
    lt, lr, mask = make_batch(2, B=4, T=5, empty_rows=(), extreme=False, pad_garbage=False)
    mask[:] = 1
    lr[2, 3] = value
    with pytest.raises(ValueError, match=r"rollout_log_probs: 1 invalid values .* first at \[seq 2, token 3\]"):
        compute_rollout_correction(lt, lr, mask, RolloutCorrectionConfig.decoupled_token_is())


def test_invalid_log_probs_rejected_and_counted():
    lt, lr, mask = make_batch(2, B=5, T=6, empty_rows=(), extreme=False, pad_garbage=False)
    mask[:] = 1
    lt[1, 2] = float("nan")
    lr[3, 0] = 0.2  # a positive log-prob is not a log-prob
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_batch_normalize=True, on_invalid="reject",
                                  rollout_rs="token_k2", rollout_rs_threshold=0.3)
    res = compute_rollout_correction(lt, lr, mask, cfg)
    assert res.response_mask[1].sum() == 0 and res.response_mask[3].sum() == 0
    assert res.metrics["rollout_corr/invalid_seq_count"] == 2
    assert res.metrics["rollout_corr/invalid_token_count"] == 2
    assert all(math.isfinite(v) for v in res.metrics.values()) and torch.isfinite(res.weights).all()
    check_against_reference(res, lt, lr, mask, cfg)

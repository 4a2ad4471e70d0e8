"""Objective configuration: verl's ``loss_mode`` migrates, bad names / values / misplaced parameters are named.

Every problem must surface from the job config's validation (``collect_job_config``, what ``megatron-rl check``
and the launcher run before any process starts) with its dotted key. Run:
``pytest tests/unit/test_objectives_config.py``.
"""
import pytest

from megatron_rl.config.load import build_job_config
from megatron_rl.plan import job_errors
from megatron_rl.correction import RolloutCorrectionConfig
from megatron_rl.losses import PolicyLossConfig
from megatron_rl.losses.registry import LOSS_TYPES, MODE_PARAMETERS, mode_parameter_errors, objective_summary

VERL_GSPO = {"algorithm": {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0,
                                                  "rollout_rs": "token_k3", "rollout_rs_threshold": 0.01}},
             "actor": {"policy_loss": {"loss_mode": "gspo", "clip_ratio_low": 0.0003, "clip_ratio_high": 0.0004,
                                       "loss_agg_mode": "seq-mean-token-mean", "clip_cov_ratio": 0.0002,
                                       "ppo_kl_coef": 0.1}}}


def problems(tree):
    cfg, errors = build_job_config(tree)
    return cfg, errors + [e for e in job_errors(cfg, 1) if "policy_loss" in e or "rollout_correction" in e]


def test_verl_gspo_config_with_rollout_correction_loads():
    """verl's own defaults of other modes' parameters (clip_cov_ratio 0.0002, ppo_kl_coef 0.1) are accepted."""
    cfg, errs = problems(VERL_GSPO)
    assert errs == []
    assert cfg.algorithm.rollout_correction.loss_type == "gspo"
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    assert cfg.actor.policy_loss.clip_ratio_high == 0.0004


@pytest.mark.parametrize("mode", [m for m in LOSS_TYPES if m not in ("dro", "m2po")])
def test_every_loss_mode_name_is_accepted(mode):
    cfg, errs = problems({"actor": {"policy_loss": {"loss_mode": mode}}})
    assert errs == [] and cfg.algorithm.rollout_correction.loss_type == mode


@pytest.mark.parametrize("name,near", [("gspoo", "gspo"), ("ppo", "ppo_clip"), ("geomean", "geo_mean"),
                                       ("cipso", "cispo")])
def test_unknown_name_names_the_nearest(name, near):
    _, errs = problems({"actor": {"policy_loss": {"loss_mode": name}}})
    assert len(errs) == 1 and "actor.policy_loss.loss_mode" in errs[0] and f"did you mean {near!r}" in errs[0]
    _, errs = problems({"algorithm": {"rollout_correction": {"loss_type": name}}})
    assert any("loss_type" in e and f"did you mean {near!r}" in e for e in errs), errs


def test_loss_mode_with_bypass_mode_and_conflicts_are_errors():
    _, errs = problems({"actor": {"policy_loss": {"loss_mode": "gspo"}},
                        "algorithm": {"rollout_correction": {"bypass_mode": True}}})
    assert len(errs) == 1 and "bypass_mode" in errs[0] and "'gspo'" in errs[0]
    cfg, errs = problems({"actor": {"policy_loss": {"loss_mode": "vanilla"}},
                          "algorithm": {"rollout_correction": {"bypass_mode": True, "loss_type": "reinforce"}}})
    assert errs == [] and cfg.algorithm.rollout_correction.loss_type == "reinforce"
    _, errs = problems({"actor": {"policy_loss": {"loss_mode": "gspo"}},
                        "algorithm": {"rollout_correction": {"loss_type": "cispo"}}})
    assert len(errs) == 1 and "conflicts" in errs[0]
    _, errs = problems({"actor": {"policy_loss": {"loss_mode": "bypass_mode"}}})
    assert len(errs) == 1 and "rollout_correction.bypass_mode is true" in errs[0]
    with pytest.raises(ValueError, match="cannot run with bypass_mode"):
        RolloutCorrectionConfig(bypass_mode=True, loss_type="geo_mean")


@pytest.mark.parametrize("key,value,mode", [("tau_pos", 2.0, "gspo"), ("clip_cov_ratio", 0.01, "kl_cov"),
                                            ("dro_beta", 0.1, "vanilla"), ("clip_ratio_high", 0.28, "sapo"),
                                            ("m2_threshold", 0.1, "ppo_clip"), ("clip_ratio_c", 10.0, "gspo")])
def test_parameter_for_the_wrong_mode_is_named(key, value, mode):
    _, errs = problems({"actor": {"policy_loss": {"loss_mode": mode, key: value}}})
    assert len(errs) == 1 and errs[0].startswith(f"actor.policy_loss.{key}:") and repr(mode) in errs[0], errs
    for reader in MODE_PARAMETERS[key]:     # the loss types that read it accept it
        errors = mode_parameter_errors(reader, PolicyLossConfig(**{key: value}))
        assert not any(e.startswith(f"actor.policy_loss.{key}:") for e in errors), (reader, errors)


@pytest.mark.parametrize("mode,key", [("dro", "dro_beta"), ("m2po", "m2_threshold")])
def test_required_parameter_is_named(mode, key):
    _, errs = problems({"actor": {"policy_loss": {"loss_mode": mode}}})
    assert errs == [f"actor.policy_loss.{key}: required by loss_type {mode!r} (no default)"]
    _, errs = problems({"actor": {"policy_loss": {"loss_mode": mode, key: 0.5}}})
    assert errs == []


@pytest.mark.parametrize("kw,match", [({"tau_pos": 0.0}, "tau_pos must be > 0"),
                                      ({"tau_neg": -1.0}, "tau_neg must be > 0"),
                                      ({"clip_cov_ratio": 1.5}, r"clip_cov_ratio must be in \(0, 1\]"),
                                      ({"kl_cov_ratio": 0.0}, r"kl_cov_ratio must be in \(0, 1\]"),
                                      ({"clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, "clip_cov_lb"),
                                      ({"dro_beta": 0.0}, "dro_beta must be > 0"),
                                      ({"m2_threshold": -1.0}, "m2_threshold must be > 0"),
                                      ({"opsm_delta": -0.1}, "opsm_delta must be >= 0"),
                                      ({"ppo_kl_coef": float("nan")}, "ppo_kl_coef must be a finite number"),
                                      ({"clip_cov_seed": -1}, "clip_cov_seed must be an integer"),
                                      ({"loss_agg_mode": "token_sum"}, "did you mean 'token-sum'")])
def test_out_of_range_values_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kw)
    _, errs = problems({"actor": {"policy_loss": kw}})
    assert errs and all(e.startswith("actor.policy_loss") for e in errs), errs


def test_verl_actor_level_keys_get_a_hint():
    _, errs = problems({"actor": {"tau_pos": 1.0, "loss_mode": "gspo", "clip_ratio_c": 3.0}})
    assert sorted(errs) == sorted([
        "actor.tau_pos: unknown key (this project's key is actor.policy_loss.tau_pos)",
        "actor.clip_ratio_c: unknown key (this project's key is actor.policy_loss.clip_ratio_c)",
        "actor.loss_mode: unknown key (this project's key is algorithm.rollout_correction.loss_type (verl's "
        "actor.policy_loss.loss_mode is moved there on load))"])


def test_check_line_names_the_objective_and_its_parameters():
    cfg, _ = problems(VERL_GSPO)
    line = objective_summary("gspo", False, cfg.actor.policy_loss)
    assert line == ("objective: gspo (decoupled; clip_ratio_low=0.0003, clip_ratio_high=0.0004; "
                    "loss_agg_mode=seq-mean-token-mean)")
    assert "tau_pos=1.0, tau_neg=1.05" in objective_summary("sapo", False, PolicyLossConfig())

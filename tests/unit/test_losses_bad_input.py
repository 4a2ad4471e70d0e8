"""Bad input to megatron_rl.losses raises ValueError naming what is wrong and where.
Run: ``pytest tests/unit/test_losses_bad_input.py``."""
import pytest
import torch

from megatron_rl.config.load import ConfigError, job_config_from_dict
from megatron_rl.losses import (LossBatch, LossDenominators, PolicyLoss, PolicyLossConfig, aggregate_loss,
                                compute_policy_loss, global_denominators, kl_penalty, objective)
from test_losses_reference import make_batch


def call(d, cfg=None, **kw):
    args = dict(is_weights=d["weights"], loss_type="ppo_clip")
    args.update(kw)
    loss = PolicyLoss.of(args.pop("loss_type"), cfg or PolicyLossConfig())
    return compute_policy_loss(loss, LossBatch(d["logp"], d["old"], d["adv"], d["mask"], **args))


@pytest.fixture
def d():
    b = make_batch(0, B=4, T=6, empty_rows=())
    b["mask"] = torch.ones(4, 6, dtype=torch.float64)
    return b


@pytest.mark.parametrize("name", ["old", "adv", "mask", "weights"])
def test_shape_mismatch_names_tensor_and_shapes(d, name):
    d[name] = d[name][:, :5]
    arg = {"old": "old_log_probs", "adv": "advantages", "mask": "response_mask", "weights": "is_weights"}[name]
    with pytest.raises(ValueError, match=rf"{arg} has shape \(4, 5\) but log_probs has shape \(4, 6\)"):
        call(d)


def test_ref_shape_mismatch(d):
    with pytest.raises(ValueError, match=r"ref_log_probs has shape \(3, 6\)"):
        call(d, PolicyLossConfig(kl_loss_coef=0.1), ref_log_probs=d["ref"][:3])


def test_not_2d(d):
    with pytest.raises(ValueError, match=r"log_probs must be 2-D.*\(24,\)"):
        compute_policy_loss(PolicyLoss.of("ppo_clip", PolicyLossConfig()),
                            LossBatch(d["logp"].flatten(), d["old"].flatten(), d["adv"].flatten(),
                                      d["mask"].flatten()))


@pytest.mark.parametrize("name,arg", [("logp", "log_probs"), ("old", "old_log_probs"),
                                      ("adv", "advantages"), ("weights", "is_weights")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_names_tensor_count_position(d, name, arg, bad):
    d[name][1, 2] = bad
    d[name][3, 0] = bad
    with pytest.raises(ValueError, match=rf"{arg} has NaN/inf values.*2 of 24.*first at position \(1, 2\)"):
        call(d)


def test_nan_in_masked_position_is_allowed(d):
    d["mask"][2, 4] = 0
    d["logp"][2, 4] = float("nan")
    d["old"][2, 4] = float("nan")
    d["weights"][2, 4] = float("inf")
    lp = d["logp"].clone().requires_grad_()
    out = compute_policy_loss(PolicyLoss.of("ppo_clip", PolicyLossConfig()),
                              LossBatch(lp, d["old"], d["adv"], d["mask"], is_weights=d["weights"]))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all() and lp.grad[2, 4] == 0


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, float("nan")])
def test_mask_not_binary(d, value):
    d["mask"][0, 3] = value
    with pytest.raises(ValueError, match=r"response_mask must contain only 0 and 1: 1 of 24.*\(0, 3\)"):
        call(d)


def test_positive_log_probs(d):
    d["logp"][2, 1] = 0.5
    with pytest.raises(ValueError, match=r"log_probs has positive log-probabilities.*1 of 24.*\(2, 1\)"):
        call(d)
    d["logp"][2, 1] = 1e-4         # rounding noise above 0 is tolerated
    call(d)


def test_negative_weights(d):
    d["weights"][3, 5] = -0.1
    with pytest.raises(ValueError, match=r"is_weights has negative values.*\(3, 5\)"):
        call(d)


def test_integer_dtype(d):
    with pytest.raises(ValueError, match=r"advantages must be a floating-point tensor, got dtype torch.int64"):
        compute_policy_loss(PolicyLoss.of("ppo_clip", PolicyLossConfig()),
                            LossBatch(d["logp"], d["old"], d["adv"].long(), d["mask"]))


def test_kl_without_ref(d):
    with pytest.raises(ValueError, match=r"ref_log_probs is required.*kl_loss_coef=0.1"):
        call(d, PolicyLossConfig(kl_loss_coef=0.1))


def test_config_type(d):
    with pytest.raises(ValueError, match="config must be a PolicyLossConfig"):
        compute_policy_loss(PolicyLoss.of("ppo_clip", {"clip_ratio_low": 0.2}),
                            LossBatch(d["logp"], d["old"], d["adv"], d["mask"]))


@pytest.mark.parametrize("kw,msg", [
    (dict(loss_agg_mode="token_mean"), r"loss_agg_mode .*'token_mean' \(did you mean 'token-mean'\?\)"),
    (dict(kl_loss_type="k4"), r"kl_loss_type must be one of"),
    (dict(pg_loss_agg_mode="mean"), r"pg_loss_agg_mode must be one of"),
    (dict(clip_ratio_low=-0.1), r"clip_ratio_low must be >= 0 \(>= 1: no lower clip\), got -0.1"),
    (dict(clip_ratio_high=-0.1), r"clip_ratio_high must be >= 0, got -0.1"),
    (dict(clip_ratio_c=1.0), r"clip_ratio_c must be > 1 \(or None to disable dual-clip\), got 1.0"),
    (dict(clip_ratio_c=float("nan")), r"clip_ratio_c must be a finite number, got nan"),
    (dict(clip_ratio_high="0.2"), r"clip_ratio_high must be a finite number, got '0.2'"),
    (dict(loss_scale_factor=0), r"loss_scale_factor must be > 0, got 0"),
    (dict(kl_loss_coef=-1), r"kl_loss_coef must be >= 0, got -1"),
])
def test_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        PolicyLossConfig(**kw)


def test_loss_type_is_an_argument_with_a_hint(d):
    with pytest.raises(ValueError, match=r"loss_type must be one of .*got 'ppo' \(did you mean 'ppo_clip'\?\)"):
        call(d, loss_type="ppo")
    with pytest.raises(TypeError, match="loss_type"):
        PolicyLossConfig(loss_type="reinforce")  # not a field: one owner, the correction config


def test_from_dict_rejects_loss_type_naming_its_owner():
    """A user's actor.policy_loss.loss_type used to be silently overwritten by the correction's."""
    with pytest.raises(ValueError, match=r"loss_type: not a policy_loss setting; it has one owner, "
                                         r"algorithm\.rollout_correction\.loss_type \(move "
                                         r"actor\.policy_loss\.loss_type: 'reinforce' to "
                                         r"algorithm\.rollout_correction\.loss_type\)"):
        PolicyLossConfig.from_dict({"loss_type": "reinforce", "clip_ratio": 0.2})


def test_job_config_rejects_policy_loss_loss_type_naming_both_keys():
    with pytest.raises(ConfigError, match=r"actor\.policy_loss\.loss_type.*algorithm\.rollout_correction\.loss_type"):
        job_config_from_dict({"actor": {"policy_loss": {"loss_type": "reinforce"}}})


def test_from_dict():
    cfg = PolicyLossConfig.from_dict({"clip_ratio": 0.3, "clip_ratio_high": 0.4, "use_kl_loss": False,
                                      "kl_loss_coef": 0.5, "loss_agg_mode": "seq-mean-token-mean"})
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.kl_loss_coef) == (0.3, 0.4, 0.0)
    with pytest.raises(ValueError, match=r"unknown key 'clip_ratio_hi' \(did you mean 'clip_ratio_high'\?\)"):
        PolicyLossConfig.from_dict({"clip_ratio_hi": 0.3})


def test_kl_penalty_bad_type_and_shape():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"kl_type must be one of .*got 'full'"):
        kl_penalty(x, x, "full")
    with pytest.raises(ValueError, match=r"ref_log_probs has shape \(2, 2\) but log_probs has shape \(2, 3\)"):
        kl_penalty(x, x[:, :2], "k3")


def test_select_loss_inputs_errors(d):
    with pytest.raises(ValueError, match="old_log_probs is None but bypass_mode=False"):
        objective("ppo_clip").loss_inputs(False, d["old"], None, None)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        objective("grpo").loss_inputs(True, d["old"], None, None)


def test_denominator_and_aggregation_errors(d):
    m = d["mask"]
    with pytest.raises(ValueError, match=r"LossDenominators.num_tokens must be a finite number >= 0, got -1"):
        aggregate_loss(d["adv"], m, "token-mean", LossDenominators(num_tokens=-1, num_seqs=2))
    with pytest.raises(ValueError, match=r"LossDenominators.num_seqs must be a scalar"):
        aggregate_loss(d["adv"], m, "seq-mean-token-sum", LossDenominators(1, torch.ones(2)))
    with pytest.raises(ValueError, match=r"loss_agg_mode must be one of"):
        aggregate_loss(d["adv"], m, "sum", None)
    with pytest.raises(ValueError, match=r"seq_valid_tokens must have shape \(4,\), got \(3,\)"):
        aggregate_loss(d["adv"], m, "seq-mean-token-mean", None, seq_valid_tokens=torch.ones(3))
    with pytest.raises(ValueError, match=r"response_masks\[1\] must be a 2-D"):
        global_denominators([m, m[0]])
    with pytest.raises(ValueError, match=r"response_masks is empty"):
        global_denominators([])

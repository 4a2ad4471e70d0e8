"""The table of named jobs the tests build (``megatron_rl.testing.jobs``): a Python value written as an override
reads back as the same value and type through the config's YAML; every row builds; the layout / knob helpers
land on megatron's keys; a bad short name or a missing HF directory is refused naming it."""
import pytest

from megatron_rl.config.load import apply_overrides
from megatron_rl.testing.actor_reference import PPO_LOSS, TOKEN_IS
from megatron_rl.testing.jobs import JOBS, job_tree, knobs, layout, named_job, setting


@pytest.mark.parametrize("value", [1e-06, 1.0e-3, 2.0, 64, 0, None, True, False, "seq-mean-token-mean", "0.3_3.0",
                                   "yes", "null", [1, 2.5], {"rollout_is": "token", "rollout_is_threshold": 2.0}])
def test_setting_reads_back_as_the_same_value(value):
    got = apply_overrides({}, [setting("actor.k", value)])["actor"]["k"]
    assert got == value and type(got) is type(value)


def test_a_dict_setting_replaces_the_whole_value_and_a_dotted_one_merges():
    tree = apply_overrides({}, [setting("actor.policy_loss", PPO_LOSS), "actor.policy_loss.loss_agg_mode=token-mean"])
    assert tree["actor"]["policy_loss"] == dict(PPO_LOSS, loss_agg_mode="token-mean")
    tree = apply_overrides(tree, [setting("actor.policy_loss", {"clip_ratio_low": 0.1})])
    assert tree["actor"]["policy_loss"] == {"clip_ratio_low": 0.1}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_every_row_builds(name, dense_model):
    cfg = named_job(name, hf=dense_model)
    assert cfg.actor.load_hf == dense_model
    tree = job_tree(name, "trainer.steps=7", hf=dense_model)
    assert tree["trainer"]["steps"] == 7      # the test's own overrides come last and win


def test_actor_ppo_is_the_reference_train_step(dense_model):
    cfg = named_job("actor_ppo", *knobs(tp=2, pp=2, vpp=2, mbs=1, sequence_packing=True,
                                        extra={"recompute_granularity": "full"}), hf=dense_model)
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
            cfg.parallel.virtual_pipeline_model_parallel_size) == (2, 2, 2)
    assert cfg.actor.micro_batch_size == 1 and cfg.actor.sequence_packing is True
    assert cfg.model.extra == {"recompute_granularity": "full"}
    assert cfg.actor.policy_loss.loss_agg_mode == PPO_LOSS["loss_agg_mode"]
    assert cfg.algorithm.rollout_correction.rollout_is == TOKEN_IS["rollout_is"]


def test_bad_helper_input_is_refused_by_name():
    with pytest.raises(TypeError, match="'tpp'"):
        layout(tpp=2)
    with pytest.raises(ValueError, match="'actor'.*hf="):
        named_job("actor")

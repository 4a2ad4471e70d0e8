"""Job config loading: YAML + dotted overrides, typed sections, errors naming dotted keys."""
import pytest

from megatron_rl.config import ConfigError, apply_overrides, load_job_config
from megatron_rl.correction import RolloutCorrectionConfig

MODEL = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=256"]


def test_overrides_parse_yaml_values_and_exponent_floats():
    tree = apply_overrides({}, ["actor.lr=1e-4", "trainer.resume=true", "rollout.sglang_urls=[a, b]",
                                "actor.load_hf=null", "data.task_kwargs.max_digits=3"])
    assert tree["actor"]["lr"] == 1e-4 and isinstance(tree["actor"]["lr"], float)
    assert tree["trainer"]["resume"] is True and tree["rollout"]["sglang_urls"] == ["a", "b"]
    assert tree["actor"]["load_hf"] is None and tree["data"]["task_kwargs"] == {"max_digits": 3}


def test_yaml_file_and_overrides(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("model: {num_layers: 4, hidden_size: 64, num_attention_heads: 4, vocab_size: 256}\n"
                 "parallel: {tensor_model_parallel_size: 2, pipeline_model_parallel_size: 2}\n"
                 "actor: {lr: 3e-4, policy_loss: {clip_ratio: 0.3}}\n"
                 "algorithm: {rollout_correction: {rollout_is: token, rollout_is_threshold: 2.0}}\n"
                 "data: {prompts_per_step: 4}\n")
    cfg = load_job_config(str(p), ["actor.lr=5e-5"], world_size=4)
    assert cfg.actor.lr == 5e-5 and cfg.actor.policy_loss.clip_ratio_low == 0.3
    assert cfg.algorithm.rollout_correction == RolloutCorrectionConfig.decoupled_token_is()
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.to_dict()["actor"]["lr"] == 5e-5


@pytest.mark.parametrize("overrides, match", [
    (["actor.lrr=1"], r"actor\.lrr: unknown key \(did you mean 'lr'\?\)"),
    (["trainr.steps=1"], r"unknown section 'trainr' \(did you mean 'trainer'\?\)"),
    (["algorithm.rollout_correction.rollout_is=tokens"], r"algorithm\.rollout_correction: .*rollout_is: 'tokens'"),
    (["algorithm.rollout_correction.rollout_is_treshold=2"], r"did you mean 'rollout_is_threshold'"),
    (["rollout.temperature=0"], r"rollout\.temperature: must be > 0"),
    (["rollout.n_samples_per_prompt=1"], r"grpo needs >= 2 samples"),
    (["rollout.engine=vllm"], r"rollout\.engine: 'vllm'"),
    (["data.task=file"], r"data\.path: required"),
    (["data.prompts_per_step=3"], r"data\.prompts_per_step: 3 is not divisible by the data-parallel size 2"),
    (["parallel.tensor_model_parallel_size=3"], r"parallel: "),
    (["actor.policy_loss.clip_ratio_lo=0.1"], r"actor\.policy_loss: .*clip_ratio_lo"),
])
def test_bad_values_are_named_before_any_process_group(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_job_config(None, MODEL + overrides, world_size=2)


def test_all_violations_listed_at_once():
    with pytest.raises(ConfigError) as ei:
        load_job_config(None, MODEL + ["rollout.temperature=-1", "actor.lr=0", "trainer.steps=0"], world_size=1)
    msg = str(ei.value)
    assert "rollout.temperature" in msg and "actor.lr" in msg and "trainer.steps" in msg


def test_missing_model_is_reported():
    with pytest.raises(ConfigError, match="model: missing"):
        load_job_config(None, [], world_size=1)

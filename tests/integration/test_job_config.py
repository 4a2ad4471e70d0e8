"""Job config loading: YAML + dotted overrides, typed sections, errors naming dotted keys."""
import subprocess
import sys

import pytest

from megatron_rl.config import ConfigError, apply_overrides
from megatron_rl.plan import load_job_config
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
    (["parallel.tensor_model_parallel_size=3"],
     r"parallel\.tensor_model_parallel_size: model\.num_attention_heads=4 is not divisible by "
     r"parallel\.tensor_model_parallel_size=3"),
    (["actor.policy_loss.clip_ratio_lo=0.1"], r"actor\.policy_loss\.clip_ratio_lo: unknown key \(did you mean "
                                              r"'clip_ratio_low'\?\)"),
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


def _errors(overrides, world_size=2):
    with pytest.raises(ConfigError) as ei:
        load_job_config(None, MODEL + overrides, world_size=world_size)
    return str(ei.value).split("\n  - ")[1:]


def test_every_value_is_type_checked_with_its_dotted_key():
    errs = _errors(["actor.lr=abc", "trainer.steps=ten", "trainer.save_interval=true",
                    "parallel.tensor_model_parallel_size=two", "model.num_layers=2.5", "rollout.sglang_urls=5",
                    "actor.policy_loss.clip_ratio_high=wide", "cluster.nodes=many"])
    assert sorted(errs) == sorted([
        "actor.lr: expected a number, got 'abc' (str)",
        "trainer.steps: expected an integer, got 'ten' (str)",
        "trainer.save_interval: expected an integer, got True (bool)",
        "parallel.tensor_model_parallel_size: expected an integer, got 'two' (str)",
        "model.num_layers: expected an integer, got 2.5 (float)",
        "rollout.sglang_urls: expected a list of strings, got 5 (int)",
        "actor.policy_loss.clip_ratio_high: expected a number, got 'wide' (str)",
        "cluster.nodes: expected an integer, got 'many' (str)"])


def test_integers_are_accepted_for_float_fields():
    cfg = load_job_config(None, MODEL + ["actor.lr=1", "rollout.temperature=2"], world_size=1)
    assert cfg.actor.lr == 1.0 and isinstance(cfg.actor.lr, float) and isinstance(cfg.rollout.temperature, float)


def test_all_unknown_keys_are_reported_with_hints_for_verl_and_megatron_names():
    errs = _errors(["actor.learning_rate=1e-5", "actor.lr_warmup_steps_ratio=0.1", "trainer.ppo_epochs=2",
                    "parallel.adam_beta1=1", "actor.zzz=1", "trainer.stepz=3"])
    assert "actor.learning_rate: unknown key (this project's key is actor.lr)" in errs
    assert any(e.startswith("actor.lr_warmup_steps_ratio: unknown key (this project's key is actor.lr_warmup_fraction")
               for e in errs)
    assert "trainer.ppo_epochs: unknown key (this project's key is actor.ppo_epochs)" in errs
    assert "parallel.adam_beta1: unknown key (it belongs to actor.adam_beta1 / critic.adam_beta1)" in errs
    assert any(e.startswith("actor.zzz: unknown key (valid keys: lr, ") for e in errs)
    assert "trainer.stepz: unknown key (did you mean 'steps'?)" in errs
    assert len(errs) == 6


def test_unknown_sections_and_bad_overrides_all_reported(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("lr: 1\nactor_rollou_ref: {}\nmodel: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, "
                 "vocab_size: 256}\n")
    with pytest.raises(ConfigError) as ei:
        load_job_config(str(p), ["trainr.steps=1", "novalue"], world_size=1)
    msg = str(ei.value)
    assert "trainr" in msg and "'novalue': expected key.sub=value" in msg
    assert "lr: unknown section (it is a key of actor.lr / critic.lr)" in msg
    assert "actor_rollou_ref: unknown section" in msg
    p.write_text("actor_rollout_ref: {actor: {optim: {lr: 1.0e-6}}}\ndata: {train_batch_size: 8}\n")
    with pytest.raises(ConfigError) as ei:   # a verl file: one problem, pointing to the migration
        load_job_config(str(p), [], world_size=1)
    assert str(ei.value).count("\n  - ") == 1 and "megatron-rl migrate verl" in str(ei.value)


def test_dense_model_world_size_error_names_keys_without_an_expert_line():
    errs = _errors(["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"], world_size=6)
    assert errs[0].startswith("world size: 6 ranks are not divisible by parallel.tensor_model_parallel_size x "
                              "parallel.pipeline_model_parallel_size x parallel.context_parallel_size = 2x2x1 = 4")
    assert not any("expert" in e for e in errs), errs


def test_moe_model_keeps_the_expert_layout_line():
    errs = _errors(["model.num_moe_experts=4", "model.ffn_hidden_size=64", "parallel.expert_model_parallel_size=4",
                    "data.prompts_per_step=6"], world_size=6)
    assert any(e.startswith("world size:") and "parallel.expert_model_parallel_size" in e for e in errs), errs


def test_cluster_section():
    cfg = load_job_config(None, MODEL + ["cluster.nodes=2", "cluster.gpus_per_node=4", "cluster.device=cpu",
                                         "cluster.gpu_memory_gb=80"], world_size=1)
    assert cfg.cluster.world_size == 8 and cfg.cluster.device == "cpu" and cfg.cluster.gpu_memory_gb == 80.0
    assert cfg.to_dict()["cluster"]["nodes"] == 2
    errs = _errors(["cluster.device=tpu", "cluster.nodes=0"])
    assert "cluster.device: 'tpu' is not one of cuda, cpu" in errs and "cluster.nodes: must be >= 1, got 0" in errs


def test_missing_model_dir_does_not_hide_other_problems():
    with pytest.raises(ConfigError) as ei:
        load_job_config(None, ["actor.load_hf=/nonexistent/model", "parallel.tensor_model_parallel_size=3",
                               "actor.lr=-1"], world_size=4)
    errs = str(ei.value).split("\n  - ")[1:]
    assert errs[0] == "actor.load_hf: '/nonexistent/model' is not a directory"
    assert any(e.startswith("world size: 4 ranks are not divisible") for e in errs)
    assert "actor.lr: must be > 0, got -1.0" in errs
    assert not any(e.startswith("model: missing") for e in errs)


def test_config_load_and_validate_import_no_circle():
    """The plain loader (config/load.py) imports nothing of the plan, not even inside a function; the validating
    loader (plan/load.py) imports it and the job file at module level (imports point down, no loop)."""
    import ast
    import os

    import megatron_rl as pkg

    def imports(rel):
        tree = ast.parse(open(os.path.join(os.path.dirname(pkg.__file__), rel)).read())
        top = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
        every = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        return top, every

    validate_top, validate_all = imports(os.path.join("plan", "load.py"))
    load_top, load_all = imports(os.path.join("config", "load.py"))
    assert not any(m.startswith("megatron_rl.plan") for m in load_all)
    assert "megatron_rl.config.load" in validate_top and "megatron_rl.config.job" in validate_top
    assert load_all - load_top <= {"megatron_rl.convert"}
    r = subprocess.run([sys.executable, "-c", "import megatron_rl.plan.load"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr

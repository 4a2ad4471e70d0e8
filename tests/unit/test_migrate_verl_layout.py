"""``migrate verl`` on verl's layout and multi-turn keys (issue 46): uneven pipeline stages and activation
recomputation map to parallel.* / actor.recompute_* with verl's meaning; a multi-turn / tool job is refused.

Real jobs from verl's examples (tests/data/verl/, each citing its source file and commit): the DeepSeek-V3 671B
GRPO job (61 layers on PP 16, 4 on the first stage and 1 on the last, full recompute) and the GSM8K multi-turn
tool job with its tool config. References: megatron-core's own ``get_num_layers_to_build`` on a TransformerConfig
built with verl's override values (what verl gives megatron-core), and verl's files.
"""
from __future__ import annotations

import os

import pytest
import torch
import yaml

from megatron_rl.cli.migrate import merge_overrides
from megatron_rl.plan import collect_job_config
from megatron_rl.config.hints import unknown_key_message
from megatron_rl.config.load import yaml_load
from megatron_rl.config.migrate_verl import UNCHANGED, migrate_verl
from megatron_rl.config.verl_keys import MAPPED, UNSUPPORTED

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DATA = os.path.join(ROOT, "tests", "data", "verl")
DSV3 = "grpo_deepseek671b_math_megatron_80gb.yaml"
MULTI_TURN = "gsm8k_multiturn_megatron_grpo.yaml"
OTC = "actor_rollout_ref.actor.megatron.override_transformer_config"
MT = "actor_rollout_ref.rollout.multi_turn"


def _load(name):
    with open(os.path.join(DATA, name)) as fh:
        return yaml_load(fh)


def _with_base(name):
    return merge_overrides(_load("ppo_megatron_trainer.yaml"), _load(name))


def _entry(m, key):
    [e] = [e for e in m.entries if e.key == key]
    return e


def _job_file(tmp_path, tree, model):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(dict(tree, model=model), sort_keys=False))
    return str(path)


def test_deepseek_uneven_stages_and_recompute_map_and_pass_check(tmp_path):
    """verl's DeepSeek-V3 job -> this project's job with its stages and recompute, accepted by check at the
    job's 256 GPUs; the TransformerConfig the actor builds gives every stage megatron-core's layer count for
    verl's values."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.models.builder import make_transformer_config
    from megatron_rl.ops.memory import MemoryOptions, memory_plan
    from megatron_rl.plan.sizing import memory_job

    m = migrate_verl(_with_base(DSV3))
    for key, target in ((f"{OTC}.num_layers_in_first_pipeline_stage", "parallel.num_layers_in_first_pipeline_stage"),
                        (f"{OTC}.num_layers_in_last_pipeline_stage", "parallel.num_layers_in_last_pipeline_stage"),
                        (f"{OTC}.recompute_granularity", "actor.recompute_granularity"),
                        (f"{OTC}.recompute_method", "actor.recompute_method"),
                        (f"{OTC}.recompute_num_layers", "actor.recompute_num_layers")):
        e = _entry(m, key)
        assert e.kind == MAPPED and e.targets == {target: e.value}, (key, e.kind, e.detail)
    # verl's default recompute_modules (core_attn) has no effect without selective recomputation
    assert _entry(m, f"{OTC}.recompute_modules").kind == UNCHANGED
    with open(os.path.join(ROOT, "configs", "deepseek_v3_671b_64x8.yaml")) as fh:
        model = yaml.safe_load(fh)["model"]  # the published DeepSeek-V3 shapes (the HF directory is the user's)
    local = ["actor.load_hf=null", "data.path=examples/math_tiny/train.jsonl",
             "data.val_files=examples/math_tiny/train.jsonl", "trainer.run_dir=runs/dsv3",
             "trainer.epochs=null"]  # the stand-in file is smaller than one of verl's batches
    cfg, problems = collect_job_config(_job_file(tmp_path, m.tree, model), local, world_size="cluster")
    assert problems == [], problems
    assert cfg.cluster.world_size == 256
    assert (cfg.actor.recompute_granularity, cfg.actor.recompute_method, cfg.actor.recompute_num_layers) == \
        ("full", "uniform", 1)

    over = _load(DSV3)["actor_rollout_ref"]["actor"]["megatron"]
    pp, first, last = (over["pipeline_model_parallel_size"], over["override_transformer_config"][
        "num_layers_in_first_pipeline_stage"], over["override_transformer_config"]["num_layers_in_last_pipeline_stage"])
    verl_cfg = TransformerConfig(num_layers=61, hidden_size=64, num_attention_heads=8, pipeline_model_parallel_size=pp,
                                 pipeline_dtype=torch.bfloat16,
                                 num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    expected = [get_num_layers_to_build(verl_cfg, pp_rank=r) for r in range(pp)]
    assert expected[0] == 4 and expected[-1] == 1 and sum(expected) == 61
    ours = make_transformer_config(cfg.model, cfg.parallel)
    assert [get_num_layers_to_build(ours, pp_rank=r) for r in range(pp)] == expected
    assert ours.recompute_granularity is None  # the actor passes actor.recompute_* (tests/integration)
    assert cfg.parallel.stage_layer_counts(61) == expected
    plan = memory_plan(memory_job(cfg, 256), MemoryOptions(recompute=cfg.actor.recompute_granularity))
    assert [len(s.layers) for s in plan.stages] == expected


def test_uneven_stage_hints_name_the_parallel_keys():
    """A verl user who writes verl's names into this project's sections is sent to the keys check accepts."""
    for section in ("actor", "model"):
        msg = unknown_key_message(section, "num_layers_in_first_pipeline_stage", ["lr"])
        assert "this project's key is parallel.num_layers_in_first_pipeline_stage" in msg, msg
        assert "model.extra" not in msg
    assert "this project's key is actor.recompute_granularity" in unknown_key_message("model", "recompute_granularity",
                                                                                      ["num_layers"])


@pytest.mark.parametrize("granularity,method,kind", [("full", "block", MAPPED), ("selective", "uniform", UNCHANGED),
                                                      (None, "uniform", UNCHANGED)])
def test_recompute_method_follows_megatron(granularity, method, kind):
    """megatron-core reads recompute_method / recompute_num_layers with full recomputation only, and
    recompute_modules with selective only."""
    tree = {"actor_rollout_ref": {"actor": {"megatron": {"override_transformer_config": {
        "recompute_granularity": granularity, "recompute_method": method, "recompute_num_layers": 2,
        "recompute_modules": ["core_attn", "mlp"]}}}}}
    m = migrate_verl(tree)
    assert _entry(m, f"{OTC}.recompute_method").kind == kind
    assert _entry(m, f"{OTC}.recompute_num_layers").kind == kind
    modules = _entry(m, f"{OTC}.recompute_modules")
    assert modules.kind == (MAPPED if granularity == "selective" else UNCHANGED)
    if granularity == "selective":
        assert m.tree["actor"]["recompute_modules"] == ["core_attn", "mlp"]


def test_fsdp_gradient_checkpointing_is_full_recompute():
    """verl's FSDP actor checkpoints every decoder layer (HF gradient checkpointing): full / uniform / 1."""
    m = migrate_verl(merge_overrides(_load("ppo_trainer.yaml"), _load("dapo_minimal.yaml")))
    e = _entry(m, "actor_rollout_ref.model.enable_gradient_checkpointing")
    assert e.value is True and e.kind == MAPPED
    assert e.targets == {"actor.recompute_granularity": "full", "actor.recompute_method": "uniform",
                         "actor.recompute_num_layers": 1}


def test_multi_turn_tool_job_is_refused_naming_its_tools(monkeypatch):
    """verl's GSM8K multi-turn tool job: never a single-turn job without an error. multi_turn.enable is not
    supported (the report names the tool class and function from verl's tool config and what to write); the
    turn and token limits carry verl's meaning."""
    monkeypatch.chdir(ROOT)  # verl resolves tool_config_path from its working directory
    tree = _load(MULTI_TURN)
    tree["actor_rollout_ref"]["rollout"]["multi_turn"]["tool_config_path"] = "tests/data/verl/gsm8k_tool_config.yaml"
    m = migrate_verl(merge_overrides(_load("ppo_megatron_trainer.yaml"), tree))
    e = _entry(m, f"{MT}.enable")
    assert e.kind == UNSUPPORTED
    tools = yaml_load(open(os.path.join(DATA, "gsm8k_tool_config.yaml")))["tools"]
    assert [t["class_name"] for t in tools] == ["verl.tools.gsm8k_tool.Gsm8kTool"]
    assert "calc_gsm8k_reward (verl.tools.gsm8k_tool.Gsm8kTool)" in e.detail
    assert "SINGLE-TURN" in e.detail and "multi_turn.env" in e.detail and "ToolEnvironment" in e.detail
    assert any(e.detail in line for line in m.report())
    # verl ends a trajectory after 5 assistant turns or at response_length (1024) response tokens
    assert m.tree["multi_turn"] == {"max_turns": 5, "max_total_tokens": 1024, "max_tokens_per_turn": 1024}
    # verl's defaults that a ToolEnvironment does not do are named (verl runs 1 call per turn, cuts responses)
    assert _entry(m, f"{MT}.max_parallel_calls").kind == UNSUPPORTED
    assert _entry(m, f"{MT}.max_tool_response_length").kind == UNSUPPORTED
    assert _entry(m, f"{MT}.format").kind == UNCHANGED  # hermes: the format parsed here


def test_multi_turn_without_a_readable_tool_config_is_still_refused():
    m = migrate_verl(_load(MULTI_TURN))  # the path verl reads from its own root
    e = _entry(m, f"{MT}.enable")
    assert e.kind == UNSUPPORTED and "examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml" in e.detail
    assert "not readable here" in e.detail


@pytest.mark.parametrize("assistant,user,turns", [(None, None, 512), (None, 2, 3), (4, 1, 2), (3, 9, 3)])
def test_turn_limits_follow_verl(assistant, user, turns):
    """verl stops after an assistant turn once max_assistant_turns assistant or max_user_turns user / tool turns
    happened (null: no limit); without either the response budget bounds it (each turn >= 1 token)."""
    tree = {"actor_rollout_ref": {"rollout": {"response_length": 512, "multi_turn": {
        "enable": True, "max_assistant_turns": assistant, "max_user_turns": user}}}}
    m = migrate_verl(tree)
    assert m.tree["multi_turn"]["max_turns"] == turns
    assert _entry(m, f"{MT}.enable").kind == UNSUPPORTED


def test_single_turn_and_tool_agent_loop():
    m = migrate_verl({"actor_rollout_ref": {"rollout": {"multi_turn": {"enable": False, "max_assistant_turns": 5},
                                                        "agent": {"default_agent_loop": "tool_agent"}}}})
    assert _entry(m, f"{MT}.enable").kind == UNCHANGED
    assert _entry(m, f"{MT}.max_assistant_turns").kind == UNCHANGED and "multi_turn" not in m.tree
    assert _entry(m, "actor_rollout_ref.rollout.agent.default_agent_loop").kind == UNSUPPORTED

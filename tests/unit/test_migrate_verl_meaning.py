"""``megatron-rl migrate verl`` carries verl's meaning (issue 46) on verl's own example jobs (tests/data/verl).

Each expectation is read off verl's files and code, never off this project's output: the step count from verl's
dataloader (``torch.utils.data.DataLoader`` with verl's batch size and ``drop_last``, as verl's
``ray_trainer._create_dataloader`` builds it), the objectives from the transcription of verl's ``core_algos.py``
(tests/policy_objectives_reference.py), the defaults from verl's generated configs (bundled), the token budget from
verl's Megatron engine (``max_token_len_per_gpu x context_parallel_size``: its ``prepare_micro_batches``).
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import yaml

from megatron_rl.cli import main as cli_main
from megatron_rl.plan import collect_job_config
from megatron_rl.config.load import build_job_config, yaml_load
from megatron_rl.config.migrate_verl import UNCHANGED, migrate_verl, with_verl_defaults
from megatron_rl.config.verl_versions import NEWEST, VERL_VERSIONS, defaults_path, verl_defaults
from megatron_rl.losses import LossBatch, PolicyLoss, PolicyLossConfig, compute_policy_loss
from tests import policy_objectives_reference as ref
from tests.unit.test_losses_reference import make_batch
from tests.unit.test_prompt_order import PER_STEP, _cfg, _job_parts

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "verl")


def _load(name):
    with open(os.path.join(DATA, name)) as fh:
        return yaml_load(fh)


def _migrate(name_or_tree, version=NEWEST):
    tree = _load(name_or_tree) if isinstance(name_or_tree, str) else name_or_tree
    merged, said = with_verl_defaults(tree, version)
    return migrate_verl(merged, version, said)


def _entry(m, key):
    [e] = [e for e in m.entries if e.key == key]
    return e


# ---------------------------------------------------------------------------------------------- 1. exit status
def test_a_value_verl_means_otherwise_exits_3_naming_the_key_and_the_decision(tmp_path, capsys):
    """verl's CISPO example trains on two files; data.path reads one: exit 3, nothing written, the key and what to
    do named; --allow-changes writes it (listing it) with exit 0; an unreadable file stays exit 2."""
    src, out = os.path.join(DATA, "cispo_qwen3_8b_fsdp.yaml"), tmp_path / "job.yaml"
    assert cli_main(["migrate", "verl", src, "-o", str(out)]) == 3
    err = capsys.readouterr().err
    assert "data.train_files = ['~/data/gsm8k/train.parquet', '~/data/math/train.parquet']" in err
    assert "concatenate them" in err and "--allow-changes" in err and not out.exists()
    assert cli_main(["migrate", "verl", src, "-o", str(out), "--allow-changes"]) == 0
    text = out.read_text()
    assert "1 value(s) differ from verl's behaviour" in text and "data.train_files" in text
    assert cli_main(["migrate", "verl", str(tmp_path / "missing.yaml")]) == 2
    # verl's rollout-correction example carries over whole: exit 0
    assert cli_main(["migrate", "verl", os.path.join(DATA, "rollout_corr_rloo_qwen2_5_7b_fsdp.yaml"),
                     "-o", str(out)]) == 0


# ---------------------------------------------------------------------------------------------- 2. verl's defaults
@pytest.mark.parametrize("version", VERL_VERSIONS)
def test_keys_the_file_does_not_set_take_verls_defaults_of_that_version(version):
    """The rollout-correction example sets neither weight decay, gradient clipping nor the KL loss type: they are
    verl's defaults (its generated FSDP config of that version), not this project's. Its REINFORCE loss (bypass
    mode) reads no clip ratio: verl's default clip_ratio_high is not written."""
    d = verl_defaults(version, "fsdp")["actor_rollout_ref"]["actor"]
    m = _migrate("rollout_corr_rloo_qwen2_5_7b_fsdp.yaml", version)
    a = m.tree["actor"]
    assert a["weight_decay"] == d["optim"]["weight_decay"] == 0.01  # this project's default is 0.0
    assert "clip_ratio_high" not in a["policy_loss"] and d["clip_ratio_high"] == 0.2
    assert a["policy_loss"]["kl_loss_type"] == d["kl_loss_type"]
    assert a["clip_grad"] == d["optim"]["clip_grad"]
    assert m.version == version and f"verl {version}'s _generated_ppo_trainer.yaml" in m.base
    # the bundled files are verl's, with their source named
    for strategy in ("megatron", "fsdp"):
        with open(defaults_path(version, strategy)) as fh:
            head = fh.read(800)
        assert "Licensed under the Apache License, Version 2.0" in head
        assert ("1dda039b9c6311889a9c9a26040677e1254814f9" if version == "main" else "verl-0.9.1") in head


# ---------------------------------------------------------------------------------------------- 3. epochs
def _verl_steps(rows, batch, epochs):
    """verl: len(train_dataloader) x total_epochs, the dataloader batching ``batch`` prompts with drop_last."""
    return len(torch.utils.data.DataLoader(range(rows), batch_size=batch, drop_last=True)) * epochs


def test_total_epochs_become_verls_step_count_from_the_data_file(tmp_path, capsys):
    """Hy3's GRPO job: total_epochs 1000, train_batch_size 128, no total_training_steps. The migrated job counts
    verl's steps from the data file when it is built (300 rows: 2 batches per epoch with drop_last)."""
    m = _migrate("grpo_hy3_megatron_cp8.yaml")
    assert m.tree["trainer"]["epochs"] == 1000 and "steps" not in m.tree["trainer"]
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(300)))
    tree = {"data": {"task": "file", "path": str(rows), "prompts_per_step": m.tree["data"]["prompts_per_step"]},
            "trainer": {"epochs": m.tree["trainer"]["epochs"]}}
    cfg, errors = build_job_config(tree)
    assert errors == [] and cfg.trainer.steps == _verl_steps(300, 128, 1000) == 2000
    # with dynamic sampling, a draw is verl's gen_batch_size (filter_groups.prompts_per_round here)
    tree["algorithm"] = {"filter_groups": {"enable": True, "metric": "seq_reward", "prompts_per_round": 96}}
    cfg, errors = build_job_config(tree)
    assert errors == [] and cfg.trainer.steps == _verl_steps(300, 96, 1000)
    # never both: an explicit trainer.steps with epochs is named
    tree["trainer"]["steps"] = 5
    _, errors = build_job_config(tree)
    assert [e for e in errors if e.startswith("trainer.epochs:")] and "trainer.steps 5" in errors[0]


# ---------------------------------------------------------------------------------------------- 4. objectives
def test_cispo_clip_ratio_low_10_is_accepted_and_means_no_lower_clip(tmp_path):
    """verl's CISPO recipe sets clip_ratio_low 10 on purpose (1 - 10 < 0 < ratio: no lower clip). The migrated
    config passes check and its loss is verl's CISPO loss (core_algos.compute_policy_loss_cispo)."""
    m = _migrate("cispo_qwen3_8b_fsdp.yaml")
    pl = m.tree["actor"]["policy_loss"]
    assert pl["clip_ratio_low"] == 10 and pl["clip_ratio_high"] == 0.2
    assert m.tree["algorithm"]["rollout_correction"]["loss_type"] == "cispo"
    out = tmp_path / "job.yaml"
    out.write_text(yaml.safe_dump(m.tree))
    local = ["actor.load_hf=null", "data.path=examples/math_tiny/train.jsonl", "trainer.epochs=null",
             "data.val_files=examples/math_tiny/train.jsonl", "model.num_layers=2", "model.hidden_size=64",
             "model.ffn_hidden_size=128", "model.num_attention_heads=4", "model.vocab_size=128"]
    cfg, problems = collect_job_config(str(out), local, world_size="cluster")
    assert not [p for p in problems if "policy_loss" in p], problems
    cfg_loss = PolicyLossConfig(clip_ratio_low=10, clip_ratio_high=0.2)
    d = make_batch(3)
    ours = compute_policy_loss(PolicyLoss.of("cispo", cfg_loss),
                               LossBatch(d["logp"], d["old"], d["adv"], d["mask"])).pg_loss
    theirs, _ = ref.cispo(d["old"], d["logp"], d["adv"], d["mask"], "token-mean",
                          ref.Cfg(clip_ratio_low=10, clip_ratio_high=0.2))
    torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match="clip_ratio_low must be >= 0"):
        PolicyLossConfig(clip_ratio_low=-0.1)


def test_gspo_clip_ratio_c_is_reported_as_ignored_not_refused():
    """verl's GSPO reads clip_ratio_low / high only; the example's clip_ratio_c 10 has no effect there."""
    m = _migrate("gspo_qwen3moe_30b_megatron.yaml")
    e = _entry(m, "actor_rollout_ref.actor.clip_ratio_c")
    assert e.kind == UNCHANGED and "ignored by verl's gspo objective" in e.detail
    assert "clip_ratio_c" not in m.tree["actor"]["policy_loss"]
    assert m.tree["actor"]["policy_loss"]["clip_ratio_low"] == 3e-4


@pytest.mark.parametrize("version", VERL_VERSIONS)
def test_gspo_aggregation_follows_the_verl_version(version):
    """verl main (after 0.9.1) aggregates GSPO's policy loss seq-mean-token-mean whatever loss_agg_mode says
    (core_algos.py at 1dda039b); 0.9.1 reads loss_agg_mode. The KL loss keeps loss_agg_mode in both."""
    tree = _load("gspo_qwen3moe_30b_megatron.yaml")
    tree["actor_rollout_ref"]["actor"]["loss_agg_mode"] = "token-mean"
    pl = _migrate(tree, version).tree["actor"]["policy_loss"]
    assert pl["loss_agg_mode"] == "token-mean"
    pg_mode = "seq-mean-token-mean" if version == "main" else "token-mean"
    assert pl.get("pg_loss_agg_mode", "token-mean") == pg_mode
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean",
                           pg_loss_agg_mode=pl.get("pg_loss_agg_mode"))
    d = make_batch(5)
    ours = compute_policy_loss(PolicyLoss.of("gspo", cfg), LossBatch(d["logp"], d["old"], d["adv"], d["mask"])).pg_loss
    theirs, _ = ref.gspo(d["old"], d["logp"], d["adv"], d["mask"], pg_mode,
                         ref.Cfg(clip_ratio_low=0.2, clip_ratio_high=0.28))
    torch.testing.assert_close(ours, theirs)


# ---------------------------------------------------------------------------------------------- 5. dynamic sampling
def test_gen_batch_size_is_prompts_per_round_and_exhaustion_raises():
    """verl's DAPO e2e recipe read as verl-recipe's DAPO trainer (trainer.use_v1: false; main_ppo's v1 trainer is
    the next section's): gen_batch_size 1024 prompts per round, train_batch_size 256; that trainer raises after
    max_num_gen_batches rounds (verl-recipe dapo/dapo_ray_trainer.py)."""
    tree = _load("dapo_minimal.yaml")
    tree["trainer"]["use_v1"] = False
    m = _migrate(tree)
    fg = m.tree["algorithm"]["filter_groups"]
    assert fg["prompts_per_round"] == 1024 and m.tree["data"]["prompts_per_step"] == 256
    assert fg["on_exhausted"] == "error"
    assert "raises" in _entry(m, "algorithm.filter_groups.enable").detail


@pytest.mark.parametrize("block", ["reward.reward_kwargs", "reward_model.reward_kwargs"])
def test_verl_091_dapo_overlong_buffer_under_reward_kwargs_maps(block):
    """verl 0.9.1's reward loop DAPO manager (verl/experimental/reward_loop/reward_manager/dapo.py) reads the penalty
    from ``config.reward.reward_kwargs.overlong_buffer_cfg`` and ``.max_resp_len`` (the legacy manager from
    ``reward_model.reward_kwargs``): they map to data.overlong_buffer_len / overlong_penalty_factor; a max_resp_len
    other than data.max_response_length (what the penalty counts from here) is a decision, not a silent change."""
    top, sub = block.split(".")
    kwargs = {"overlong_buffer_cfg": {"enable": True, "len": 4096, "penalty_factor": 0.5, "log": False},
              "max_resp_len": 20480}
    verl = {"data": {"max_response_length": 20480}, "actor_rollout_ref": {"actor": {"strategy": "megatron"}},
            top: {sub: kwargs, "reward_manager": {"name": "dapo"}} if top == "reward" else {sub: kwargs}}
    m = migrate_verl(with_verl_defaults(verl, "0.9.1")[0], "0.9.1")
    assert (m.tree["data"]["overlong_buffer_len"], m.tree["data"]["overlong_penalty_factor"]) == (4096, 0.5)
    assert not [e.key for e in m.differences() if e.key.startswith(block)]
    kwargs["max_resp_len"] = 16384
    m = migrate_verl(with_verl_defaults(verl, "0.9.1")[0], "0.9.1")
    (e,) = [e for e in m.differences() if e.key.startswith(block)]
    assert e.key == f"{block}.max_resp_len" and "data.max_response_length" in e.detail
    if top == "reward":   # verl 0.9.1's naive reward-loop manager (its default) reads no overlong_buffer_cfg
        verl["reward"]["reward_manager"]["name"] = "naive"
        m = migrate_verl(with_verl_defaults(verl, "0.9.1")[0], "0.9.1")
        assert "overlong_buffer_len" not in m.tree["data"]
        assert not [e.key for e in m.differences() if e.key.startswith(block)]
        assert "only its dapo reward manager applies it" in _entry(m, f"{block}.overlong_buffer_cfg.len").detail
        verl["reward"]["reward_manager"]["name"] = "dapo"
    kwargs["overlong_buffer_cfg"]["enable"] = False   # no penalty: max_resp_len has no effect in verl
    m = migrate_verl(with_verl_defaults(verl, "0.9.1")[0], "0.9.1")
    assert not [e.key for e in m.differences() if e.key.startswith(block)]


def test_each_round_draws_prompts_per_round_prompts(tmp_path):
    """The engine is asked for prompts_per_round prompts each round (not data.prompts_per_step)."""
    cfg = _cfg(tmp_path, 13, "algorithm.filter_groups.prompts_per_round=6")
    task, gen, engine = _job_parts(cfg)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            batch = gen.generate(engine, 0, "step-0")
    finally:
        gen.close()
        task.close()
    assert engine.calls and all(len(c) == 6 for c in engine.calls)
    assert batch.num_rows == PER_STEP * cfg.rollout.n_samples_per_prompt


# ---------------------------------------------------------------------------------------------- 6. token budget
def test_dynamic_batch_token_budget_multiplies_by_context_parallelism():
    """Hy3 on CP 8 with ppo_max_token_len_per_gpu 30720: verl's engine packs 30720 x 8 tokens per micro-batch."""
    m = _migrate("grpo_hy3_megatron_cp8.yaml")
    assert m.tree["parallel"]["context_parallel_size"] == 8
    assert m.tree["actor"]["max_tokens_per_micro_batch"] == 30720 * 8


# ---------------------------------------------------------------------------------------------- 7. FSDP
def test_an_fsdp_job_gets_the_distributed_optimizer_and_says_so():
    m = _migrate("cispo_qwen3_8b_fsdp.yaml")
    assert m.tree["actor"]["use_distributed_optimizer"] is True
    e = _entry(m, "actor_rollout_ref.actor.strategy")
    assert e.value == "fsdp" and "distributed optimizer" in e.detail
    assert "distributed optimizer" in "\n".join(m.report())


# ---------------------------------------------------------------------------------------------- 8. review (rv-mig)
@pytest.mark.parametrize("version", VERL_VERSIONS)
def test_v1_trainer_dynamic_sampling_is_not_read_as_the_dapo_recipes(version):
    """verl 0.9.1 / main run main_ppo's v1 trainer by default (trainer.use_v1: true in both generated configs). Its
    DAPO filtering (v1/trainer_base.py ``_init_dataloader`` / ``_resolve_filter_groups_metric``) overrides
    data.gen_batch_size to 1, ignores max_num_gen_batches (it warns) and refills without limit, and counts
    ``len(train_dataset) // train_batch_size`` steps per epoch. The DAPO e2e job's gen_batch_size 1024 and
    max_num_gen_batches 10 therefore do not mean prompts per round / a bound there: migrate must not write them as
    such (4x fewer steps per epoch, a job that stops where verl goes on) but ask. With trainer.use_v1: false
    (verl-recipe's DAPO trainer, which draws gen_batch_size prompts per round and raises after
    max_num_gen_batches rounds) they map as before."""
    assert verl_defaults(version, "fsdp")["trainer"]["use_v1"] is True
    m = _migrate("dapo_minimal.yaml", version)
    differ = {e.key: e.detail for e in m.differences()}
    assert "overridden to 1" in differ["data.gen_batch_size"]
    assert "ignores" in differ["algorithm.filter_groups.max_num_gen_batches"]
    assert "prompts_per_round" not in m.tree["algorithm"]["filter_groups"]
    assert "max_num_gen_batches" not in m.tree["algorithm"]["filter_groups"]
    tree = _load("dapo_minimal.yaml")
    tree["trainer"]["use_v1"] = False
    m = _migrate(tree, version)
    fg = m.tree["algorithm"]["filter_groups"]
    assert fg["prompts_per_round"] == 1024 and fg["max_num_gen_batches"] == 10 and fg["on_exhausted"] == "error"
    assert not [e for e in m.differences() if "gen_batch" in e.key]


def test_v1_gen_batch_size_without_filtering_keeps_verls_steps_per_epoch(tmp_path):
    """Without filter_groups verl's v1 trainer fetches gen_batch_size prompts at a time but trains
    train_batch_size per step, ``steps_per_epoch = len(train_dataset) // train_batch_size``: gen_batch_size changes
    nothing a step means (it was refused with the advice to set train_batch_size to it, which would)."""
    tree = _load("grpo_hy3_megatron_cp8.yaml")
    tree["data"]["gen_batch_size"] = 64
    m = _migrate(tree)
    e = _entry(m, "data.gen_batch_size")
    assert e.kind == UNCHANGED and "train_batch_size" in e.detail
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(300)))
    job = {"data": {"task": "file", "path": str(rows), "prompts_per_step": m.tree["data"]["prompts_per_step"]},
           "trainer": {"epochs": m.tree["trainer"]["epochs"]}, "algorithm": m.tree.get("algorithm", {})}
    cfg, errors = build_job_config(job)
    assert errors == [] and cfg.trainer.steps == (300 // 128) * 1000


def test_model_engine_picks_verls_megatron_defaults():
    """verl main's run scripts choose the Megatron actor with the Hydra choice ``model_engine=megatron``
    (examples/grpo_trainer/run_moonlight_16b_a3b_megatron.sh at 1dda039b, tests/data/verl): the file is read over
    verl's Megatron defaults and the key is no unknown. A file that says only ``model_engine: megatron`` is not
    read as an FSDP job (distributed optimizer "from FSDP", verl's FSDP defaults)."""
    m = _migrate("grpo_moonlight_16b_megatron.yaml")
    assert "_generated_ppo_megatron_trainer.yaml" in m.base
    assert m.differences() == [], [(e.key, e.detail) for e in m.differences()]
    assert _entry(m, "model_engine").kind == UNCHANGED
    assert m.tree["parallel"]["pipeline_model_parallel_size"] == 3
    bare = {"model_engine": "megatron", "actor_rollout_ref": {"model": {"path": "/m"}}}
    m = _migrate(bare)
    assert "_generated_ppo_megatron_trainer.yaml" in m.base
    assert _entry(m, "actor_rollout_ref.actor.strategy").value == "megatron"
    assert "use_distributed_optimizer" in m.tree["actor"]  # verl's Megatron default (true), not FSDP's note
    assert _entry(m, "actor_rollout_ref.actor.megatron.use_distributed_optimizer").kind == "mapped"
    other = _migrate({"model_engine": "veomni", "actor_rollout_ref": {"model": {"path": "/m"}}})
    assert _entry(other, "model_engine").kind == "not supported yet"
    assert "not bundled" in _entry(other, "model_engine").detail


def test_relative_paths_are_resolved_where_verl_opens_them(tmp_path, monkeypatch):
    """verl opens data.train_files / val_files, its reward file and default_local_dir relative to the directory it
    is launched from (verl's rollout-correction multi-RS example: data/train.parquet, checkpoints/...); a migrated
    file's paths resolve from the file's own directory (docs/running.md). Written as they are, -o elsewhere moves
    every one of them (the checkpoints silently). migrate resolves them against the directory it runs in and says
    so; HF hub ids stay."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    m = _migrate("rollout_corr_multi_rs_qwen2_5_7b_fsdp.yaml")
    assert m.tree["data"]["path"] == str(tmp_path / "data" / "train.parquet")
    assert m.tree["data"]["val_files"] == str(tmp_path / "data" / "test.parquet")
    run_dir = m.tree["trainer"]["run_dir"]
    assert os.path.isabs(run_dir) and run_dir.startswith(str(tmp_path / "checkpoints"))
    assert m.tree["actor"]["load_hf"] == "Qwen/Qwen2.5-7B"
    assert "directory migrate ran in" in _entry(m, "data.train_files").detail
    out = tmp_path / "elsewhere" / "job.yaml"
    out.parent.mkdir()
    assert cli_main(["migrate", "verl", os.path.join(DATA, "rollout_corr_multi_rs_qwen2_5_7b_fsdp.yaml"),
                     "-o", str(out)]) == 0
    cfg, _ = collect_job_config(str(out), ["actor.load_hf=null"], world_size="cluster")
    assert cfg.data.path == str(tmp_path / "data" / "train.parquet")
    assert cfg.trainer.run_dir == run_dir


def test_agent_loop_files_are_refused_not_dropped():
    """verl main's rollout.agent.agent_loop_config_path registers agent loops that rows naming them run (its
    agent_loop.py), and agent.custom_async_server.path replaces its rollout server: both change what a rollout is.
    They were "no meaning here" (exit 0, single-turn training); now each is refused by name. Unset (verl's
    defaults, null) they change nothing."""
    tree = _load("grpo_moonlight_16b_megatron.yaml")
    assert not _migrate(tree).differences()
    tree["actor_rollout_ref"]["rollout"]["agent"] = {"agent_loop_config_path": "agent_loops.yaml",
                                                     "custom_async_server": {"path": "srv.py", "name": "Srv"}}
    differ = {e.key for e in _migrate(tree).differences()}
    assert differ == {"actor_rollout_ref.rollout.agent.agent_loop_config_path",
                      "actor_rollout_ref.rollout.agent.custom_async_server.path",
                      "actor_rollout_ref.rollout.agent.custom_async_server.name"}


def test_routing_replay_is_read_where_verls_engine_reads_it():
    """verl 0.9.1 / main decide routing replay from ``actor.megatron.router_replay.mode`` only (engine_workers.py:
    megatron -> that key, any other actor -> disabled); ``actor.router_replay`` is not read. verl's R3 example
    (examples/router_replay at 1dda039b) sets the Megatron key: it maps to r3 without a conflict with the unread
    key's default. An FSDP job that sets the unread key keeps verl's none."""
    m = _migrate("grpo_router_replay_r3_qwen3_30b_megatron.yaml")
    assert m.tree["actor"]["routing_replay"] == "r3"
    assert not [e for e in m.differences() if "router_replay" in e.key]
    e = _entry(m, "actor_rollout_ref.actor.router_replay.mode")
    assert e.kind == UNCHANGED and e.value == "disabled"
    fsdp = _load("rollout_corr_multi_rs_qwen2_5_7b_fsdp.yaml")
    fsdp["actor_rollout_ref"]["actor"]["router_replay"] = {"mode": "R3"}
    m = _migrate(fsdp)
    assert m.tree["actor"].get("routing_replay", "none") == "none"
    assert "no effect" in _entry(m, "actor_rollout_ref.actor.router_replay.mode").detail

"""``megatron-rl migrate verl`` on verl's own configs (tests/data/verl: verl's generated Megatron and FSDP trainer
configs, and three of its example run scripts written as YAML).

The expected values come from verl's documented semantics, read off the verl files by hand (not from the
table): ``optim.lr`` is the actor's learning rate, ``data.train_batch_size`` counts prompts per step and
``rollout.n`` is the group size, ``ppo_mini_batch_size`` counts prompts per optimizer step (verl multiplies it by
``n``), ``ppo_micro_batch_size_per_gpu`` counts rows per micro-batch per GPU, ``ppo_max_token_len_per_gpu`` is a
per-GPU token budget used only with ``use_dynamic_bsz``, ``use_remove_padding`` packs rows, and the rollout's
``tensor_model_parallel_size`` is the inference engine's own.
"""
from __future__ import annotations

import os

import pytest
import yaml

from megatron_rl.cli import main as cli_main
from megatron_rl.plan import collect_job_config
from megatron_rl.config.interpolation import resolve_interpolations
from megatron_rl.config.load import yaml_load
from megatron_rl.config.migrate_verl import CONFLICT, UNCHANGED, UNKNOWN, UNRESOLVED, merge_overrides, migrate_verl
from megatron_rl.config.verl_keys import MAPPED, NO_MEANING, SERVER, UNSUPPORTED
from megatron_rl.config.verl_versions import NEWEST, verl_defaults

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "verl")
MEGATRON_BASE = os.path.join(DATA, "ppo_megatron_trainer.yaml")
FSDP_BASE = os.path.join(DATA, "ppo_trainer.yaml")
#: example -> the verl config its run script overrides
EXAMPLES = {"grpo_qwen2_7b_math_megatron.yaml": MEGATRON_BASE, "grpo_qwen3moe_30b_megatron.yaml": MEGATRON_BASE,
            "dapo_minimal.yaml": FSDP_BASE}
#: example -> the verl values this project does not carry (migrate exits 3 naming them; read off the files by hand:
#: two training files)
DIFFER = {"grpo_qwen2_7b_math_megatron.yaml": {"data.train_files"},
          "grpo_qwen3moe_30b_megatron.yaml": set(),
          "dapo_minimal.yaml": set()}
#: the published HF shapes of each example's model, as model: overrides (the HF directory is on the user's cluster)
SHAPES = {
    "grpo_qwen2_7b_math_megatron.yaml": dict(num_layers=28, hidden_size=3584, ffn_hidden_size=18944,
                                             num_attention_heads=28, num_query_groups=4, vocab_size=152064,
                                             add_qkv_bias=True, untie_embeddings_and_output_weights=True),
    "grpo_qwen3moe_30b_megatron.yaml": dict(num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
                                            num_attention_heads=32, num_query_groups=4, kv_channels=128,
                                            vocab_size=151936, qk_layernorm=True, num_moe_experts=128,
                                            moe_router_topk=8, moe_ffn_hidden_size=768,
                                            untie_embeddings_and_output_weights=True),
    "dapo_minimal.yaml": dict(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                              num_query_groups=2, vocab_size=151936, add_qkv_bias=True),
}


#: verl keys other rows of the table are being changed for (memory offload, layout): not asserted here
OWNED_ELSEWHERE = ("actor_rollout_ref.actor.optim.override_optimizer_config.",
                   "actor_rollout_ref.actor.megatron.override_transformer_config.")


def _load(name):
    with open(os.path.join(DATA, name)) as fh:
        return yaml_load(fh)


def _leaves(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _entry(m, key):
    [e] = [e for e in m.entries if e.key == key]
    return e


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(DATA)  # the job files
                                  if f.endswith(".yaml") and not f.endswith("_tool_config.yaml")))
def test_every_key_is_mapped_or_listed_with_its_reason(name):
    tree = _load(name)
    m = migrate_verl(tree)
    resolved, _ = resolve_interpolations(tree)
    assert sorted(e.key for e in m.entries) == sorted(_leaves(resolved)), "one entry per key of the file"
    assert not m.of_kind(UNKNOWN, CONFLICT), [(e.key, e.detail) for e in m.of_kind(UNKNOWN, CONFLICT)]
    for e in m.entries:
        assert e.kind in (MAPPED, UNCHANGED, UNSUPPORTED, NO_MEANING, SERVER, UNRESOLVED)
        assert e.detail or e.kind == MAPPED, e.key
        assert e.targets or e.kind != MAPPED or e.rule.convert is not None, e.key
    # verl's generated configs leave the rollout engine to the run script (Hydra's ???): the one unresolved key
    assert [e.key for e in m.of_kind(UNRESOLVED)] == (["actor_rollout_ref.rollout.name"]
                                                      if name.startswith("ppo_") else [])
    report = "\n".join(m.report())
    for e in m.of_kind(UNSUPPORTED, SERVER, NO_MEANING, UNRESOLVED):
        assert e.detail in report


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_migrated_example_passes_check(name, tmp_path):
    """The example as verl runs it (its overrides on verl's config) -> `megatron-rl migrate verl --base` ->
    this project's loader and validation at the file's cluster size, with the paths that only exist on the
    user's cluster (the model directory, replaced by the model's published shapes, and the data / validation
    files) given."""
    out = tmp_path / "job.yaml"
    argv = ["migrate", "verl", os.path.join(DATA, name), "--base", EXAMPLES[name], "-o", str(out)]
    m = migrate_verl(merge_overrides(_load(os.path.basename(EXAMPLES[name])), _load(name)))
    differ = {e.key for e in m.differences()}
    assert {k for k in differ if not k.startswith(tuple(OWNED_ELSEWHERE))} == DIFFER[name], differ
    assert cli_main(argv) == (3 if differ else 0)
    assert out.exists() == (not differ)  # nothing written while values differ
    assert cli_main(argv + ["--allow-changes"]) == 0
    text = out.read_text()
    assert text.startswith("# Migrated from the verl config") and "not mapped" in text
    local = ["actor.load_hf=null", "data.path=examples/math_tiny/train.jsonl", "trainer.epochs=null"]
    local += ["data.val_files=examples/math_tiny/train.jsonl"] if "val_files:" in text else []
    local += [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in SHAPES[name].items()]
    cfg, problems = collect_job_config(str(out), local, world_size="cluster")
    assert problems == [], problems
    assert cfg.cluster.world_size == 8 and cfg.rollout.engine == "sglang"


def test_grpo_moe_recipe_maps_as_verl_means_it():
    verl = _load("grpo_qwen3moe_30b_megatron.yaml")
    m = migrate_verl(verl)
    t = m.tree
    a = verl["actor_rollout_ref"]
    assert t["actor"]["lr"] == a["actor"]["optim"]["lr"] == 1e-6
    assert t["actor"]["weight_decay"] == 0.1
    # prompts per step and group size; mini-batches = 512 prompts / 128 prompts per mini-batch
    assert t["data"]["prompts_per_step"] == 512 and t["rollout"]["n_samples_per_prompt"] == 16
    assert t["actor"]["ppo_mini_batches"] == 4
    assert t["actor"]["micro_batch_size"] == 2
    assert t["actor"]["max_tokens_per_micro_batch"] == 10240  # use_dynamic_bsz: true
    assert t["rollout"]["max_new_tokens"] == 8192 and t["data"]["max_prompt_length"] == 2048
    assert t["data"]["overlong_prompts"] == "truncate"  # verl's truncation: left keeps the last tokens
    assert t["data"]["overlong_buffer_len"] == 4096 and t["data"]["overlong_penalty_factor"] == 1.0
    assert t["actor"]["policy_loss"] == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 10.0,
                                         "loss_agg_mode": "token-mean"}  # use_kl_loss false: no kl_loss_coef
    # the trainer's layout is actor.megatron's; the rollout TP (4) is the SGLang servers'
    assert t["parallel"]["tensor_model_parallel_size"] == 1 and t["parallel"]["expert_model_parallel_size"] == 8
    tp = _entry(m, "actor_rollout_ref.rollout.tensor_model_parallel_size")
    assert tp.kind == SERVER and "launch/sglang_server.sh --tp" in tp.detail and "SGLANG_TP" in tp.detail
    assert _entry(m, "actor_rollout_ref.rollout.gpu_memory_utilization").kind == SERVER
    # verl's between-phase offloads free memory only for its own colocated engine (said, docs/memory.md); its
    # megatron optimizer CPU offload is megatron's here too
    offload = _entry(m, "actor_rollout_ref.actor.megatron.param_offload")
    assert offload.kind == NO_MEANING and "train step's peak is the same" in offload.detail
    assert t["actor"]["optimizer_cpu_offload"] is True and t["actor"]["optimizer_offload_fraction"] == 1.0
    # verl steps its scheduler once per training step (megatron_workers.update_actor), this project once per
    # optimizer step: 10 training steps of 4 mini-batches (1 epoch) = 40
    assert t["actor"]["lr_warmup_steps"] == 40 and t["actor"]["lr_decay_style"] == "constant"
    # the launch script's TEST_FILE is unset: val_files is [''], so nothing is validated and test_freq does nothing
    assert _entry(m, "data.val_files").kind == UNCHANGED
    freq = _entry(m, "trainer.test_freq")
    assert freq.kind == UNCHANGED and "without data.val_files" in freq.detail and "test_freq" not in t["trainer"]


def test_validation_keys_map_as_verl_means_them():
    """verl's validation: val_files (a list of two), test_freq, val_before_train (verl's default true) and the
    val_kwargs sampling map key by key; the -1 / null "off" values set nothing."""
    m = migrate_verl(_load("grpo_qwen2_7b_math_megatron.yaml"))
    t = m.tree
    home = os.path.expanduser("~")  # verl opens its ~/data/... defaults with ~ expanded; the paths here are read as given
    assert t["data"]["val_files"] == [f"{home}/data/gsm8k/test.parquet", f"{home}/data/math/test.parquet"]
    assert t["trainer"]["test_freq"] == 5
    assert "val_max_samples" not in t["data"]
    full = migrate_verl(_load("ppo_megatron_trainer.yaml"))
    assert full.tree["data"]["path"] == f"{home}/data/rlhf/gsm8k/train.parquet"
    assert full.tree["rollout"]["val_kwargs"] == {"do_sample": False, "temperature": 0, "top_p": 1.0, "top_k": -1,
                                                  "n": 1}
    assert _entry(full, "data.val_max_samples").kind == UNCHANGED  # -1: every row
    moe = migrate_verl(_load("grpo_qwen3moe_30b_megatron.yaml"))
    assert moe.tree["rollout"]["val_kwargs"] == {"temperature": 1.0, "top_p": 0.7, "top_k": -1, "do_sample": True,
                                                 "n": 1}


def test_greedy_val_kwargs_n_repeats_one_response_and_migrates_as_n_1():
    """verl with val_kwargs.do_sample false decodes greedily and repeats that response n times (the same val
    metrics as n 1); n > 1 there is an error here, so it is not carried over -- unless do_sample is true."""
    verl = {"data": {"val_files": "v.jsonl"},
            "actor_rollout_ref": {"rollout": {"val_kwargs": {"do_sample": False, "n": 4}}}}
    m = migrate_verl(verl)
    assert "n" not in m.tree["rollout"]["val_kwargs"]
    e = _entry(m, "actor_rollout_ref.rollout.val_kwargs.n")
    assert e.kind == UNCHANGED and "one response repeated" in e.detail
    verl["actor_rollout_ref"]["rollout"]["val_kwargs"].update(do_sample=True)   # at verl's temperature 0: greedy
    m = migrate_verl(verl)
    assert m.tree.get("rollout", {}).get("val_kwargs", {}) == {}
    assert "decodes greedily" in _entry(m, "actor_rollout_ref.rollout.val_kwargs.do_sample").detail
    verl["actor_rollout_ref"]["rollout"]["val_kwargs"].update(temperature=0.6)
    assert migrate_verl(verl).tree["rollout"]["val_kwargs"] == {"do_sample": True, "temperature": 0.6, "n": 4}


def test_full_megatron_config_maps_its_defaults():
    verl = _load("ppo_megatron_trainer.yaml")
    m = migrate_verl(verl)
    t = m.tree
    assert t["actor"]["sequence_packing"] is True  # actor.megatron.use_remove_padding: true
    assert t["actor"]["bf16"] is True and t["actor"]["use_distributed_optimizer"] is True
    assert (t["actor"]["adam_beta1"], t["actor"]["adam_beta2"]) == (0.9, 0.999)
    assert "max_tokens_per_micro_batch" not in t["actor"]  # use_dynamic_bsz: false
    assert _entry(m, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu").kind == UNCHANGED
    # verl's rollout_correction block pastes as it is; its loss_type only counts in bypass mode, the objective
    # is actor.policy_loss.loss_mode (vanilla)
    block = dict(verl["algorithm"]["rollout_correction"])
    block.pop("loss_type")
    corr = dict(t["algorithm"]["rollout_correction"])
    assert corr.pop("loss_type") == "vanilla" and corr == block
    assert _entry(m, "algorithm.adv_estimator").kind == MAPPED and t["algorithm"]["advantage_estimator"] == "gae"
    # verl's critic keys the critic here reads are carried onto critic.*; the worker settings have no meaning here
    carried = {"critic.optim.lr": "lr", "critic.optim.weight_decay": "weight_decay", "critic.optim.clip_grad":
               "clip_grad", "critic.ppo_epochs": "ppo_epochs", "critic.cliprange_value": "cliprange_value",
               "critic.loss_agg_mode": "loss_agg_mode"}
    bad = [(e.key, e.kind) for e in m.entries if e.key.startswith("critic.") and e.key not in carried
           and e.kind not in (NO_MEANING, UNCHANGED)]
    assert not bad, bad
    for key, ours in carried.items():
        assert _entry(m, key).kind == MAPPED and t["critic"][ours] == _entry(m, key).value, key
    # interpolations resolved within the file: ${oc.select:data.max_prompt_length,512}, a path with two refs
    assert _entry(m, "actor_rollout_ref.rollout.prompt_length").value == 512
    assert t["trainer"]["run_dir"] == os.path.abspath("checkpoints/verl_examples/gsm8k")  # verl's, from the cwd


def test_fsdp_schedule_keys():
    m = migrate_verl({"actor_rollout_ref": {"actor": {"optim": {"lr": 2e-6, "lr_warmup_steps": -1,
                                                                "lr_warmup_steps_ratio": 0.1,
                                                                "warmup_style": "cosine", "min_lr_ratio": 0.1}}}})
    a = m.tree["actor"]
    assert a["lr_warmup_fraction"] == 0.1 and a["lr_decay_style"] == "cosine"
    assert a["min_lr"] == pytest.approx(2e-7)  # verl's min_lr_ratio x lr
    assert "lr_warmup_steps" not in a  # -1: verl takes the ratio


def test_schedule_keys_follow_each_verl_backend():
    """verl's FSDP actor takes lr_warmup_steps_ratio only when lr_warmup_steps < 0 (0: no warm-up), its Megatron
    actor when <= 0 (verl/workers/fsdp_workers.py, verl/utils/megatron/optimizer.py); its FSDP optimizer config
    replaces lr_scheduler_type by the deprecated warmup_style when that is set (FSDPOptimizerConfig)."""
    def optim(strategy, **keys):
        return migrate_verl({"actor_rollout_ref": {"actor": {"strategy": strategy, "optim": {"lr": 2e-6, **keys}}}})

    fsdp = optim("fsdp", lr_warmup_steps=0, lr_warmup_steps_ratio=0.1)
    assert "lr_warmup_fraction" not in fsdp.tree["actor"] and fsdp.tree["actor"].get("lr_warmup_steps", 0) == 0
    assert _entry(fsdp, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio").kind == UNCHANGED
    megatron = optim("megatron", lr_warmup_steps=0, lr_warmup_steps_ratio=0.1)
    assert megatron.tree["actor"]["lr_warmup_fraction"] == 0.1 and "lr_warmup_steps" not in megatron.tree["actor"]
    assert optim("fsdp", lr_warmup_steps=-1, lr_warmup_steps_ratio=0.1).tree["actor"]["lr_warmup_fraction"] == 0.1
    old_name = optim("fsdp", lr_scheduler_type="constant", warmup_style="cosine")
    assert old_name.tree["actor"]["lr_decay_style"] == "cosine" and not old_name.of_kind(CONFLICT)
    assert optim("fsdp", lr_scheduler_type="cosine", warmup_style=None).tree["actor"]["lr_decay_style"] == "cosine"


def test_fsdp_dapo_recipe():
    m = migrate_verl(_load("dapo_minimal.yaml"))
    t = m.tree
    assert t["actor"]["sequence_packing"] is True  # FSDP's model.use_remove_padding
    assert t["data"]["overlong_buffer_len"] == 128 and t["actor"]["ppo_mini_batches"] == 2  # 256 / 128 prompts
    assert t["trainer"]["steps"] == 1  # total_training_steps wins over total_epochs
    assert _entry(m, "trainer.total_epochs").kind == UNCHANGED
    fg = t["algorithm"]["filter_groups"]  # DAPO's dynamic sampling: verl's keys are ours
    # verl's DAPO trainer draws gen_batch_size (1024) prompts per round and raises after max_num_gen_batches rounds
    assert fg == {"enable": True, "on_exhausted": "error", "prompts_per_round": 1024, "metric": "seq_reward",
                  "max_num_gen_batches": 10}
    # verl's 'acc' (a dict reward's key: verl's math_dapo scorer, DAPO reward files) maps as it is; 0 rounds
    # (unlimited) has no equal here: named, not copied
    m = migrate_verl({"algorithm": {"filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 0}}})
    assert m.tree["algorithm"]["filter_groups"]["metric"] == "acc"
    assert "max_num_gen_batches" not in m.tree["algorithm"]["filter_groups"]
    assert _entry(m, "algorithm.filter_groups.max_num_gen_batches").kind == UNSUPPORTED


def test_interpolations_resolve_within_the_file_or_are_named():
    tree = {"a": {"x": 3, "y": "${.x}", "z": "${oc.select:b.missing,7}", "w": "${oc.select:a.x,9}",
                  "s": "run/${a.x}/${b.name}", "d": "${oc.select:b.nothing,{}}", "sub": {"up": "${..x}"}},
            "b": {"name": "n", "env": "${oc.env:HOME}", "gone": "${b.nope}", "c1": "${b.c2}", "c2": "${b.c1}",
                  "req": "???", "whole": "${a.sub}"}}
    out, bad = resolve_interpolations(tree)
    assert out["a"] == {"x": 3, "y": 3, "z": 7, "w": 3, "s": "run/3/n", "d": {}, "sub": {"up": 3}}
    assert out["b"]["whole"] == {"up": 3}
    assert set(bad) == {"b.env", "b.gone", "b.c1", "b.c2", "b.req"}
    assert "oc.env" in bad["b.env"] and "b.nope" in bad["b.gone"] and "cycle" in bad["b.c1"]
    assert out["b"]["env"] == "${oc.env:HOME}"  # left as written


def test_check_on_a_verl_file_points_to_migrate(capsys):
    path = os.path.join(DATA, "grpo_qwen2_7b_math_megatron.yaml")
    assert cli_main(["check", path]) == 2
    err = capsys.readouterr().err
    assert f"megatron-rl migrate verl {path}" in err and "unknown section" not in err
    assert err.count("\n") == 1, err


def test_migrate_writes_yaml_to_stdout_and_the_report_to_stderr(capsys, tmp_path):
    recipe = _load("dapo_minimal.yaml")  # read as verl-recipe's DAPO trainer (main_ppo's v1 trainer: exit 3)
    recipe["trainer"]["use_v1"] = False
    src = tmp_path / "dapo.yaml"
    src.write_text(yaml.safe_dump(recipe))
    assert cli_main(["migrate", "verl", str(src)]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["rollout"]["n_samples_per_prompt"] == 4
    # the file's 46 keys over verl's generated FSDP defaults (the file's strategy): every key of that config
    merged, _ = resolve_interpolations(merge_overrides(verl_defaults(NEWEST, "fsdp"), recipe))
    assert err.startswith(f"{len(_leaves(merged))} verl keys: ")
    assert "0 value(s) differ from verl's behaviour" in err
    assert f"read as verl {NEWEST}; keys the file does not set: verl {NEWEST}'s _generated_ppo_trainer.yaml" in err


def test_two_verl_keys_writing_one_key_differently_is_a_conflict():
    m = migrate_verl({"actor_rollout_ref": {"rollout": {"response_length": 256}}, "data": {"max_response_length": 512}})
    assert m.tree["rollout"]["max_new_tokens"] == 256  # the first wins
    c = _entry(m, "data.max_response_length")
    assert c.kind == CONFLICT and "rollout.max_new_tokens is already 256" in c.detail


def test_cli_errors_name_the_file(tmp_path, capsys):
    """A --base or config that is not a mapping, and an output path that cannot be written: one error line naming
    the file, exit code 2, nothing written (no traceback)."""
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    verl = os.path.join(DATA, "rollout_corr_rloo_qwen2_5_7b_fsdp.yaml")  # migrates with exit 0
    cases = [(["--base", str(listing)], f"--base {listing}: not a verl config"),
             ([str(listing), "--base", FSDP_BASE], f"{listing}: not a verl config"),
             ([verl, "-o", str(tmp_path / "no_dir" / "job.yaml")], f"cannot write {tmp_path / 'no_dir' / 'job.yaml'}")]
    for args, message in cases:
        argv = ["migrate", "verl"] + (args if args[0] != "--base" else [verl] + args)
        assert cli_main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
        assert out == ""


def test_hydra_composition_and_use_kl_loss_alone():
    """A recipe written as Hydra composition (``defaults:``, ``hydra:``) names them with the reason instead of
    'unknown'; ``use_kl_loss: true`` without ``kl_loss_coef`` applies verl's default coefficient 0.001 (verl's
    trainer configs), not this project's 0 (no KL loss)."""
    def actor(**keys):
        return {"hydra": {"searchpath": ["file://verl/trainer/config"]}, "defaults": ["ppo_trainer", "_self_"],
                "actor_rollout_ref": {"actor": keys}}

    m = migrate_verl(actor(use_kl_loss=True))
    assert not m.of_kind(UNKNOWN)
    assert _entry(m, "defaults").kind == NO_MEANING and "--base" in _entry(m, "defaults").detail
    assert _entry(m, "hydra.searchpath").kind == NO_MEANING
    assert m.tree["actor"]["policy_loss"]["kl_loss_coef"] == 0.001
    assert migrate_verl(actor(use_kl_loss=True, kl_loss_coef=0.01)).tree["actor"]["policy_loss"] == {
        "kl_loss_coef": 0.01}
    assert "actor" not in migrate_verl(actor(use_kl_loss=False, kl_loss_coef=0.01)).tree

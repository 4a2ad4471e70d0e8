"""verl's model overrides carry over: ``actor.megatron.override_transformer_config.*`` (what verl passes to
megatron-core's TransformerConfig) becomes ``model.extra.*``, and ``model.override_config.model_config.*`` (put
over the HF config) the model: key of the same meaning; a ``model:`` section without shapes is put over
``actor.load_hf``'s config, as verl puts both over its HF config. The references are the verl file's own values
and the HF config.json written here with transformers (Qwen3-30B-A3B's published shapes)."""
import os

import pytest
import yaml

from megatron_rl.cli.migrate import merge_overrides
from megatron_rl.plan import collect_job_config
from megatron_rl.config.load import build_job_config, yaml_load
from megatron_rl.config.migrate_verl import migrate_verl
from megatron_rl.config.verl_keys import MAPPED

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "verl")
OTC = "actor_rollout_ref.actor.megatron.override_transformer_config"


def _qwen3_moe_hf(path):
    """An HF directory with Qwen3-30B-A3B's published config (no weights: the plan reads shapes only)."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                   num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                   rope_theta=1000000.0, rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8,
                   moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False).save_pretrained(path)
    return str(path)


def _recipe():
    with open(os.path.join(DATA, "grpo_qwen3moe_30b_megatron.yaml")) as fh, \
            open(os.path.join(DATA, "ppo_megatron_trainer.yaml")) as base:
        verl = merge_overrides(yaml_load(base), yaml_load(fh))
    return verl, migrate_verl(verl)


def test_transformer_overrides_and_hf_overrides_map_to_the_model_section(tmp_path):
    verl, m = _recipe()
    overrides = verl["actor_rollout_ref"]["actor"]["megatron"]["override_transformer_config"]
    carried = {k: v for k, v in overrides.items() if v is not None and not k.startswith("recompute")
               and k not in ("attention_backend",)}
    assert carried, "the recipe sets TransformerConfig overrides"
    for name, value in carried.items():
        [e] = [e for e in m.entries if e.key == f"{OTC}.{name}"]
        assert e.kind == MAPPED and e.targets == {f"model.extra.{name}": value}, (name, e.kind, e.detail)
    hf_over = verl["actor_rollout_ref"]["model"]["override_config"]["model_config"]
    assert m.tree["model"]["max_position_embeddings"] == hf_over["max_position_embeddings"] == 10240
    assert m.tree["model"]["extra"] == carried

    hf = _qwen3_moe_hf(tmp_path / "hf")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(m.tree, sort_keys=False))
    local = [f"actor.load_hf={hf}", "data.path=examples/math_tiny/train.jsonl", "data.val_files=null",
             "trainer.epochs=null"]  # the stand-in file is smaller than one of verl's batches
    cfg, problems = collect_job_config(str(job), local, world_size="cluster")
    assert problems == [], problems
    with open(os.path.join(hf, "config.json")) as fh:
        import json
        hf_cfg = json.load(fh)
    # the HF config's shapes, verl's overrides over them
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_moe_experts, cfg.model.moe_router_topk) == (
        hf_cfg["num_hidden_layers"], hf_cfg["hidden_size"], 128, hf_cfg["num_experts_per_tok"])
    assert cfg.model.max_position_embeddings == 10240 != hf_cfg["max_position_embeddings"]
    assert {k: cfg.model.extra[k] for k in carried} == carried


def test_a_model_section_without_shapes_needs_load_hf_and_a_full_one_wins(tmp_path):
    hf = _qwen3_moe_hf(tmp_path / "hf")
    _, errors = build_job_config({"model": {"extra": {"apply_rope_fusion": True}}})
    assert any(e.startswith("model.num_layers: required") for e in errors), errors
    full = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)
    cfg, errors = build_job_config({"model": full, "actor": {"load_hf": hf}})
    assert not [e for e in errors if e.startswith("model.")], errors
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (2, 64)  # the file's shapes, not the HF config's
    cfg, errors = build_job_config({"model": {"max_position_embeddings": 8192, "bogus": 1},
                                    "actor": {"load_hf": hf}})
    assert any("model.bogus" in e for e in errors), errors


@pytest.mark.parametrize("name, ours", [("rope_theta", "rotary_base"), ("rms_norm_eps", "norm_epsilon")])
def test_hf_names_map_to_the_model_key_of_the_same_meaning(name, ours):
    m = migrate_verl({"actor_rollout_ref": {"model": {"override_config": {"model_config": {name: 123.0}}}}})
    assert m.tree["model"][ours] == 123.0


def test_the_worked_example_of_docs_migration(tmp_path):
    """docs/migration.md's walk: verl's Qwen3-30B-A3B Megatron job migrates with nothing left to decide (exit 0),
    plans over the 80 GB default and fits the 96 GB GPUs its script was written for."""
    from megatron_rl.testing.cli import run_cli

    r = run_cli("migrate", "verl", os.path.abspath(os.path.join(DATA, "grpo_qwen3moe_30b_megatron.yaml")),
                "-o", "job.yaml", cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 value(s) differ from verl's behaviour" in r.stdout
    hf = _qwen3_moe_hf(tmp_path / "Qwen3-30B-A3B-Base")
    data = os.path.abspath(os.path.join(DATA, "..", "..", "..", "examples", "math_tiny", "train.jsonl"))
    args = ["check", "job.yaml", f"actor.load_hf={hf}", f"data.path={data}", "trainer.epochs=null", "--strict"]
    r = run_cli(*args, cwd=str(tmp_path))
    assert r.returncode == 3 and "does NOT FIT" in r.stdout + r.stderr, r.stdout + r.stderr
    r = run_cli(*args, "cluster.gpu_memory_gb=96", cwd=str(tmp_path))
    assert r.returncode == 0 and "config OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("key, value", [("num_layers", 2), ("ffn_hidden_size", 32), ("num_moe_experts", 8)])
def test_a_partial_model_section_cannot_change_load_hf_tensor_shapes(tmp_path, key, value):
    """A ``model:`` section put over ``actor.load_hf``'s config may not change a tensor shape of the checkpoint:
    the actor's loader refuses that job only when it builds (megatron_rl.convert.check_model_config_matches),
    while ``check`` planned its memory for the overridden shapes and passed. Refused at config load, naming the key
    and the checkpoint's value; a non-shape override still passes."""
    hf = _qwen3_moe_hf(tmp_path / "hf")
    _, errors = build_job_config({"model": {key: value}, "actor": {"load_hf": hf}})
    hits = [e for e in errors if e.startswith(f"model.{key}:")]
    assert hits and "actor.load_hf" in hits[0], errors
    cfg, errors = build_job_config({"model": {"rotary_base": 5e5}, "actor": {"load_hf": hf}})
    assert not [e for e in errors if e.startswith("model.")] and cfg.model.rotary_base == 5e5, errors


@pytest.mark.parametrize("key", ["num_layers", "ffn_hidden_size", "num_moe_experts", "kv_channels"])
def test_model_extra_cannot_change_a_tensor_shape(tmp_path, key):
    """``model.extra`` (verl's override_transformer_config) went into megatron's TransformerConfig over the model:
    keys, so ``extra.num_layers`` built another model than the one ``check`` planned (and, with actor.load_hf, than
    the checkpoint's: refused only by the loader). A shape in model.extra is an error naming the model: key."""
    hf = _qwen3_moe_hf(tmp_path / "hf")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": {"extra": {key: 2}}, "actor": {"load_hf": hf}}))
    _, problems = collect_job_config(str(job), [], world_size=1)
    hits = [p for p in problems if p.startswith(f"model.extra.{key}:")]
    assert hits and f"model.{key}" in hits[0], problems

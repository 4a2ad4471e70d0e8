"""A training checkpoint of the RL loop exports to a HF directory transformers loads, at any layout.

Each case loads a tiny HF model into the actor, takes one train step (so the weights are the trained ones,
not the source), saves the checkpoint the way the RL loop does (``actor.save_checkpoint(run_dir/
checkpoints/step_N, N, {"config": job.to_dict()})``) and records the actor's own log-probs. Then
``megatron-rl convert mcore-to-hf --mcore-dir run_dir/checkpoints/step_N`` (one process, no process group)
writes a HF directory; HF transformers' log-probs on the same tokens must equal the actor's (<= 1e-4, fp32),
at TP2xPP2, PP4xVPP2 and MoE EP2, with config / tokenizer files from the run's ``actor.load_hf``. Without a
HF directory to copy (``actor.load_hf`` gone) the config.json is generated from the saved model config.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_checkpoint_export.py -q``
"""
import dataclasses
import json
import multiprocessing
import os
import shutil

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import MegatronActor, RolloutBatch
from megatron_rl.plan import actor_spec
from megatron_rl.cli import main as cli_main
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, named_job, setting

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tiny_hf_model):
    return {"qwen2": tiny_hf_model("qwen2", seed=41, num_hidden_layers=4),
            "deep": tiny_hf_model("qwen2", seed=43, num_hidden_layers=8),
            "moe": tiny_hf_model("qwen3_moe", seed=42)}


def _model_by_hand(hf_dir):
    """The ``model:`` section of ``hf_dir`` written out from its config.json here (not through the project's HF
    reading, which test_job_model_section_matches_the_hf_reading checks against it)."""
    with open(os.path.join(hf_dir, "config.json")) as fh:
        cfg = json.load(fh)
    # the model section written out by hand from config.json (not through the project's HF reading)
    model = dict(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                 num_attention_heads=cfg["num_attention_heads"], num_query_groups=cfg["num_key_value_heads"],
                 vocab_size=cfg["vocab_size"], ffn_hidden_size=cfg["intermediate_size"],
                 kv_channels=cfg.get("head_dim"), max_position_embeddings=cfg["max_position_embeddings"],
                 rotary_base=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {})["rope_theta"]),
                 norm_epsilon=cfg["rms_norm_eps"], add_qkv_bias=cfg["model_type"] == "qwen2",
                 qk_layernorm=cfg["model_type"] == "qwen3_moe",
                 untie_embeddings_and_output_weights=not cfg["tie_word_embeddings"])
    if cfg["model_type"] == "qwen3_moe":
        model.update(num_moe_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                     moe_router_topk=cfg["num_experts_per_tok"],
                     moe_ffn_hidden_size=cfg["moe_intermediate_size"], moe_router_load_balancing_type="none",
                     moe_router_pre_softmax=not cfg["norm_topk_prob"])
    return model


def _batch(vocab, length=None):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 2, 4, 2)]
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 6, 2, 4)]
    if length is not None:  # VPP needs one micro-batch length
        responses = [r + [1] * (length - len(p) - len(r)) for p, r in zip(prompts, responses)]
    return RolloutBatch.from_sequences(prompts, responses)


def _rank_train_save(rank, world, job, batch, ckpt):
    try:
        initialize_model_parallel(job.parallel, seed=3, model=job.model)
        actor = MegatronActor(actor_spec(job))
        old, _ = actor.compute_log_probs(batch, 1.0)
        actor.train_step(batch, old, torch.tensor([1.0, -1.0, 0.5, -0.5]), batch.response_mask, None, 1.0)
        actor.save_checkpoint(ckpt, 1, {"config": job.to_dict()})
        lp, _ = actor.compute_log_probs(batch, 1.0)
        return lp, old
    finally:
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(5)


def _hf_log_probs(hf_dir, batch):
    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = m(input_ids=batch.tokens).logits[:, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)


CASES = [("qwen2", dict(tp=2, pp=2), 4), ("deep", dict(pp=4, vpp=2), 4), ("moe", dict(ep=2), 2)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("key,layout,world", CASES, ids=["tp2pp2", "pp4vpp2", "moe-ep2"])
def test_training_checkpoint_exports_to_hf(models, tmp_path, key, layout, world):
    job = named_job("actor", setting("model", _model_by_hand(models[key])), "actor.lr=1e-2",
                    *knobs(mbs=1 if layout.get("vpp") else 2, **layout), hf=models[key])
    batch = _batch(job.model.vocab_size, length=12 if layout.get("vpp") else None)
    ckpt = str(tmp_path / "run" / "checkpoints" / "step_1")
    lp, old = run_ranks(_rank_train_save, world, job, batch, ckpt, timeout=200)[0]
    valid = batch.response_mask.bool()
    assert (lp - old)[valid].abs().max() > 1e-3, "the train step did not change the model"
    out = str(tmp_path / "hf")
    assert cli_main(["convert", "mcore-to-hf", "--mcore-dir", ckpt, "--out", out]) == 0
    assert (lp.double() - _hf_log_probs(out, batch))[valid].abs().max() <= 1e-4
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # from the run's actor.load_hf
        assert os.path.isfile(os.path.join(out, name)), name
    if key == "qwen2":  # the run's HF directory is gone: a generated config.json
        shutil.rmtree(models[key] + "_moved", ignore_errors=True)
        os.rename(models[key], models[key] + "_moved")
        try:
            with pytest.warns(UserWarning, match="generated from the saved model config"):
                assert cli_main(["convert", "mcore-to-hf", "--mcore-dir", ckpt, "--out", str(tmp_path / "gen")]) == 0
        finally:
            os.rename(models[key] + "_moved", models[key])
        assert (lp.double() - _hf_log_probs(str(tmp_path / "gen"), batch))[valid].abs().max() <= 1e-4


def test_missing_checkpoint_is_one_error_line(tmp_path, capsys):
    os.makedirs(tmp_path / "step_3")
    with open(tmp_path / "step_3" / "latest", "w") as fh:
        fh.write("3")
    rc = cli_main(["convert", "mcore-to-hf", "--mcore-dir", str(tmp_path / "step_3"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "step 3" in err


def test_job_model_section_matches_the_hf_reading(models):
    """The hand-written model sections above are what the project's HF reading gives (guards the test)."""
    from megatron_rl.convert import model_config_for_checkpoint

    for key in models:
        got = dataclasses.asdict(named_job("actor", setting("model", _model_by_hand(models[key])),
                                           hf=models[key]).model)
        want = dataclasses.asdict(model_config_for_checkpoint(models[key]))
        diff = {k: (got[k], want[k]) for k in want
                if k not in ("init_method_std", "moe_layer_freq") and got[k] != want[k]}
        assert not diff, diff

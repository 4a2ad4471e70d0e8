"""Tests for megatron_rl.testing.tiny_hf: offline, deterministic tiny HF checkpoints that load in transformers.

Run: OMP_NUM_THREADS=1 pytest tests/unit/test_tiny_hf.py
"""
import hashlib
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_rl.testing.tiny_hf import ARCHS, build_tiny_hf_model  # noqa: E402


def _digests(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(Path(path).iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_builds_loadable_model_deterministically(tmp_path, arch):
    a = build_tiny_hf_model(tmp_path / "a", arch=arch, seed=0)
    b = build_tiny_hf_model(tmp_path / "b", arch=arch, seed=0)
    c = build_tiny_hf_model(tmp_path / "c", arch=arch, seed=1)
    da, db, dc = _digests(a), _digests(b), _digests(c)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(da)
    assert da == db, "same seed must give byte-identical files"
    assert da["model.safetensors"] != dc["model.safetensors"], "seed must change the weights"
    assert da["tokenizer.json"] == dc["tokenizer.json"], "tokenizer does not depend on the seed"

    tok = transformers.AutoTokenizer.from_pretrained(a)
    model = transformers.AutoModelForCausalLM.from_pretrained(a)
    assert model.config.model_type == arch
    assert next(model.parameters()).dtype == torch.float32
    text = "reverse 12345 -> 54321"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < model.config.vocab_size for i in ids)
    assert tok.eos_token_id == model.config.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_overrides_apply_and_bad_overrides_are_named(tmp_path):
    p = build_tiny_hf_model(tmp_path / "m", arch="llama", num_hidden_layers=3, vocab_size=400,
                            tie_word_embeddings=True)
    cfg = transformers.AutoConfig.from_pretrained(p)
    assert (cfg.num_hidden_layers, cfg.vocab_size, cfg.tie_word_embeddings) == (3, 400, True)
    model = transformers.AutoModelForCausalLM.from_pretrained(p)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    with pytest.raises(ValueError, match="not_a_field"):
        build_tiny_hf_model(tmp_path / "x", arch="qwen2", not_a_field=1)
    with pytest.raises(ValueError, match="vocab_size=10"):
        build_tiny_hf_model(tmp_path / "y", arch="qwen2", vocab_size=10)
    with pytest.raises(ValueError, match="arch='gpt9'"):
        build_tiny_hf_model(tmp_path / "z", arch="gpt9")


def test_qwen3_moe_has_routed_experts(tmp_path):
    p = build_tiny_hf_model(tmp_path / "moe", arch="qwen3_moe", num_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(p)
    names = [n for n, _ in model.named_parameters()]
    assert any("mlp.gate" in n for n in names), names
    assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2

"""Build a tiny Hugging Face causal-LM checkpoint (model + tokenizer) fully offline, deterministically.

Used by the CPU tasks' chat model (``tasks.chat_model``) and by tests that need a real HF directory — HF <->
Megatron conversion, the SGLang server, the embedded engine — without any model-hub access. The tokenizer is a
byte-level BPE trained with ``tokenizers`` on a small built-in corpus (digits, letters, arithmetic and a few
English words) and wrapped in ``PreTrainedTokenizerFast``; the model is a randomly initialised ``transformers``
model (fp32 weights saved as safetensors) seeded with ``seed``. Same arguments -> byte-identical files.

Usage::

    from megatron_rl.convert.tiny_hf import build_tiny_hf_model   # also megatron_rl.testing.tiny_hf
    path = build_tiny_hf_model(tmp_path / "tiny", arch="qwen2", seed=0, num_hidden_layers=3)

``arch="deepseek_v3"`` is a tiny DeepSeek-V3 with the real config keys: 3 layers (the first dense), MLA with
small ranks (q_lora 24, kv_lora 16, nope 16, rope 8, v 12) and YaRN RoPE, 8 routed experts in 2 groups
(top-2 from the best group) + 1 shared expert, sigmoid routing with ``routed_scaling_factor`` 2.5 and a
random (seeded) ``e_score_correction_bias`` — transformers initialises it to zeros, which would leave the
bias path untested.

Command line: ``python -m megatron_rl.convert.tiny_hf OUT_DIR [--arch qwen2|llama|qwen3_moe|deepseek_v3]
[--seed 0]`` (or ``python -m megatron_rl.testing.tiny_hf``).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from megatron_rl.convert.random_model import write_random_hf_model

#: Architectures ``build_tiny_hf_model`` can build.
ARCHS = ("qwen2", "llama", "qwen3_moe", "deepseek_v3")

#: Special tokens of the tiny tokenizer; ``<|endoftext|>`` is BOS, EOS and PAD.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: Default BPE vocabulary size (256 byte tokens + special tokens + merges).
DEFAULT_TOKENIZER_VOCAB = 384

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.02,
    tie_word_embeddings=False,
)
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": dict(_COMMON),
    "llama": dict(_COMMON),
    "qwen3_moe": dict(
        _COMMON,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        mlp_only_layers=[],
    ),
    "deepseek_v3": dict(
        _COMMON,
        num_hidden_layers=3,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
}


def _corpus() -> list[str]:
    """A deterministic training corpus for the BPE: digit strings, letters, arithmetic, a few words."""
    lines = []
    words = ("copy reverse sort add the answer is question input output number digits "
             "hello world yes no true false sum of and then result").split()
    for i in range(400):
        a, b = (i * 7919) % 1000, (i * 104729) % 1000
        digits = str((i * 2654435761) % 10**8).zfill(8)
        lines.append(f"{words[i % len(words)]} {a} + {b} = {a + b}")
        lines.append(f"reverse {digits} -> {digits[::-1]}")
        lines.append(f"sort {digits} -> {''.join(sorted(digits))}")
        lines.append(" ".join(words[(i + k) % len(words)] for k in range(6)))
    lines.append("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,:;!?()[]{}<>+-*/=")
    return lines


def build_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = DEFAULT_TOKENIZER_VOCAB):
    """Train a byte-level BPE tokenizer offline, save it to ``out_dir`` and return the
    ``PreTrainedTokenizerFast`` (``<|endoftext|>`` is bos/eos/pad; ``len(tok) == vocab_size`` at most)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"tokenizer vocab_size={vocab_size} must be >= {256 + len(SPECIAL_TOKENS)} "
                         "(256 byte tokens + special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
        model_max_length=512,
    )
    fast.save_pretrained(str(out_dir))
    return fast


def tiny_config(arch: str, vocab_size: int, **overrides):
    """The tiny ``transformers`` config for ``arch`` (see ``_ARCH_DEFAULTS``), with ``overrides`` applied.
    Unknown override keys raise ``ValueError`` naming the key."""
    from transformers import DeepseekV3Config, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {ARCHS}")
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig,
           "deepseek_v3": DeepseekV3Config}[arch]
    kwargs = dict(_ARCH_DEFAULTS[arch])
    kwargs.update(vocab_size=vocab_size)
    known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {})) | set(kwargs)
    for key in overrides:
        if key not in known:
            raise ValueError(f"unknown config override {key!r} for arch={arch!r} ({cls.__name__})")
    kwargs.update(overrides)
    return cls(**kwargs)


def build_tiny_hf_model(out_dir: str | os.PathLike, arch: str = "qwen2", seed: int = 0,
                        tokenizer_vocab_size: int = DEFAULT_TOKENIZER_VOCAB, **overrides) -> str:
    """Build a tiny random-weight HF causal LM plus its tokenizer in ``out_dir`` and return the path.

    Args:
        out_dir: directory to create (may exist; files in it are overwritten).
        arch: ``"qwen2"``, ``"llama"`` or ``"qwen3_moe"``.
        seed: seeds the weight initialisation; same arguments give byte-identical files.
        tokenizer_vocab_size: size of the trained BPE vocabulary.
        **overrides: config fields to override (e.g. ``num_hidden_layers=3``, ``vocab_size=512``,
            ``tie_word_embeddings=True``). ``vocab_size`` defaults to the tokenizer's size and may
            only be larger (padded rows, as in real checkpoints).

    Weights are saved in fp32 (``model.safetensors``) by ``convert.random_model.write_random_hf_model``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(out, tokenizer_vocab_size)
    n_tok = len(tok)
    vocab_size = overrides.pop("vocab_size", n_tok)
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {n_tok} tokens")
    eos = tok.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    overrides.setdefault("bos_token_id", eos)
    overrides.setdefault("eos_token_id", eos)
    overrides.setdefault("pad_token_id", eos)
    path = write_random_hf_model(tiny_config(arch, vocab_size, **overrides), out, seed)
    if arch == "deepseek_v3":
        _randomize_expert_bias(path, seed)
    return path


def _randomize_expert_bias(path: str, seed: int) -> None:
    """Give every ``e_score_correction_bias`` seeded values of the size of the sigmoid-score gaps (so it
    changes which experts are selected) and rewrite the safetensors file."""
    import torch
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    g = torch.Generator().manual_seed(seed + 1000)
    for k in sorted(sd):
        if k.endswith("e_score_correction_bias"):
            sd[k] = (0.05 * torch.randn(sd[k].shape, generator=g)).to(sd[k].dtype)
    save_file(sd, f, metadata={"format": "pt"})


def main(argv=None) -> None:
    """Command-line entry point: build a tiny model and print its path."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--arch", default="qwen2", choices=ARCHS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(build_tiny_hf_model(a.out_dir, arch=a.arch, seed=a.seed))


if __name__ == "__main__":
    main()

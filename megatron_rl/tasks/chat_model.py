"""A tiny chat model for the reasoning-task path on CPU: the tiny HF Qwen2 of ``megatron_rl.convert.tiny_hf``
(random weights, byte-level BPE with ``<|im_start|>`` / ``<|im_end|>``) plus a ChatML chat template.

The template is Qwen's ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, and with
``add_generation_prompt`` ``<|im_start|>assistant\\n`` — followed by an empty ``<think>\\n\\n</think>\\n\\n``
block when ``enable_thinking=False`` is passed (as Qwen3's template does), so ``data.chat_template_kwargs``
visibly reaches the template. ``<|im_end|>`` is the EOS (tokenizer, config.json and
generation_config.json), as in Qwen's instruct checkpoints. Learning is not expected from this model:
it exists so configs/math_tiny_cpu.yaml runs the whole verl-format / chat template / math-verify path.

Usage::

    path = build_chat_model("runs/math_tiny_cpu/init_model", seed=0)
    path = ensure_chat_model("runs/math_tiny_cpu/init_model")       # builds only if missing

Command line: ``python -m megatron_rl.tasks.chat_model OUT_DIR [--seed 0]``.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from megatron_rl.convert.tiny_hf import build_tiny_hf_model
from megatron_rl.tokenizer import load_tokenizer

#: Qwen-style ChatML template (``enable_thinking=False`` adds an empty think block, as Qwen3's does).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
#: The end-of-turn token, used as EOS.
EOS_TOKEN = "<|im_end|>"


def add_chat_template(model_dir: str | os.PathLike) -> str:
    """Give the tokenizer in ``model_dir`` the ChatML template and ``<|im_end|>`` as EOS, and make the
    model's config.json / generation_config.json stop at ``<|im_end|>``; return ``model_dir``."""
    out = Path(model_dir)
    tok = load_tokenizer(out)
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    if eos is None or eos == tok.unk_token_id:
        raise ValueError(f"{out}: the tokenizer has no {EOS_TOKEN!r} token to end a chat turn")
    tok.chat_template = CHATML_TEMPLATE
    tok.eos_token = EOS_TOKEN
    tok.save_pretrained(str(out))
    for name in ("config.json", "generation_config.json"):
        p = out / name
        if p.is_file():
            data = json.loads(p.read_text())
            data["eos_token_id"] = eos
            p.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return str(out)


def build_chat_model(out_dir: str | os.PathLike, seed: int = 0, **overrides) -> str:
    """Build the tiny Qwen2 + BPE tokenizer (``build_tiny_hf_model``, ``overrides`` passed on) into
    ``out_dir`` with the chat template; return the path. Same arguments -> identical files."""
    path = build_tiny_hf_model(out_dir, arch="qwen2", seed=seed, **overrides)
    return add_chat_template(path)


def ensure_chat_model(out_dir: str | os.PathLike, seed: int = 0, **overrides) -> str:
    """``out_dir`` if it already holds a model with a chat template, else ``build_chat_model`` (an existing
    model is never overwritten)."""
    out = Path(out_dir)
    has_weights = (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file()
    tok_cfg = out / "tokenizer_config.json"
    templated = (out / "chat_template.jinja").is_file() or (
        tok_cfg.is_file() and "chat_template" in json.loads(tok_cfg.read_text()))
    if (out / "config.json").is_file() and has_weights and templated:
        return str(out)
    return build_chat_model(out, seed=seed, **overrides)


def main(argv=None) -> None:
    """Command-line entry point: build the chat model unless ``OUT_DIR`` already holds one; print its path."""
    p = argparse.ArgumentParser(description="Build a tiny Qwen2 chat model (ChatML template) for the math task.")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(ensure_chat_model(a.out_dir, seed=a.seed))


if __name__ == "__main__":
    main()

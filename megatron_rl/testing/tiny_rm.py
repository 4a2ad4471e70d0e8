"""A tiny random scalar reward model for tests: an HF ``Qwen2`` / ``Llama`` ``ForSequenceClassification``
(``num_labels: 1``, no pad token: HF's own forward then scores the last token of an unpadded row) with the tiny
BPE tokenizer and a chat template of its own (``RM_TEMPLATE``, unlike the policy's ChatML).

    path = build_tiny_rm(tmp_path / "rm", arch="qwen2", seed=0)
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_rl.convert.tiny_hf import build_tiny_tokenizer, tiny_config

#: The tiny RM's chat template: ``[role] content`` per message, ``<|endoftext|>`` at the end.
RM_TEMPLATE = ("{%- for m in messages %}{{- '[' + m['role'] + '] ' + m['content'] + '\\n' }}{%- endfor %}"
               "{{- '<|endoftext|>' }}")


def build_tiny_rm(out_dir: str | os.PathLike, arch: str = "qwen2", seed: int = 0, score_std: float = 1.0) -> str:
    """Write the tiny RM to ``out_dir`` and return its path (``score_std``: the score head's init std, so scores
    differ visibly between responses)."""
    from transformers import AutoModelForSequenceClassification  # heavy: test helpers only

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(out)
    tok.chat_template = RM_TEMPLATE
    tok.save_pretrained(str(out))
    config = tiny_config(arch, len(tok))
    config.num_labels = 1
    config.pad_token_id = None
    config.architectures = [{"qwen2": "Qwen2", "llama": "Llama"}[arch] + "ForSequenceClassification"]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config).float()
    with torch.no_grad():
        model.score.weight.normal_(0.0, score_std)
    model.save_pretrained(str(out))
    return str(out)

"""One loader for the tokenizer of a checkpoint directory: ``load_tokenizer(path)``.

``transformers.AutoTokenizer`` picks the tokenizer class from the model type for some families (qwen2, ...)
even when the directory's ``tokenizer_config.json`` declares the generic fast backend
(``TokenizersBackend`` / ``PreTrainedTokenizerFast``) and ``tokenizer.json`` defines a different
tokenizer. The project's task models are such a case: a char/word-level tokenizer saved beside a Qwen2
config, which ``AutoTokenizer`` silently turned into a BPE ``Qwen2Tokenizer`` that dropped the task word
("copy:12=" encoded as ":12="). Here, a directory that declares the generic backend and has a
``tokenizer.json`` is loaded from that file exactly; every other directory goes through ``AutoTokenizer``.
(Task models built now also load correctly with plain ``AutoTokenizer``: the char tokenizer declares its
multi-character words as added tokens, see ``megatron_rl.tasks.char_tokenizer``.)
Every place that loads a tokenizer (the RL loop, ``megatron-rl check``, ``megatron-rl data inspect``, the
task-model builders) calls this function.
"""
from __future__ import annotations

import json
import os

__all__ = ["load_tokenizer", "GENERIC_BACKENDS"]

GENERIC_BACKENDS = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""``tokenizer_class`` values that mean "the tokenizer is what tokenizer.json says"."""


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in ``path`` (see the module docstring)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = str(path)
    cfg_file = os.path.join(path, "tokenizer_config.json")
    declared = None
    if os.path.isfile(cfg_file):
        with open(cfg_file) as fh:
            declared = json.load(fh).get("tokenizer_class")
    if declared in GENERIC_BACKENDS and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)

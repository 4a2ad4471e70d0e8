"""The tiny character-level tokenizer of the synthetic digit tasks, and a builder for a task model directory.

A ``tokenizers`` WordLevel vocabulary (pad, eos, unk, digits, ``:`` ``=`` ``+`` space, the task names as single
tokens; the ``lookup`` task adds ``lookup`` ``?`` ``>``), built offline and deterministic. The rule to keep: every
id the padded model vocabulary can emit has a visible token (``RESERVED``), and every token is also saved as an
added token, so ``transformers.AutoTokenizer`` on the exported directory encodes and decodes exactly as this
tokenizer does. Why both rules exist, and the model sizes ``build_task_model`` defaults to:
docs/synthetic_tasks.md.

    path = build_task_model("runs/tiny/model", task="copy", seed=0, hidden_size=128, num_layers=2)
    path = ensure_task_model("runs/tiny/model")         # builds only if missing (repairs an old tokenizer)

Command line: ``python -m megatron_rl.tasks OUT_DIR [--task copy] [--seed 0] [--hidden-size 128]
[--num-layers 2]``.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from megatron_rl.convert.random_model import write_random_hf_model

#: Special tokens, in id order: PAD=0, EOS=1, UNK=2.
SPECIAL = ("<pad>", "<eos>", "<unk>")
#: Task-name tokens of the digit tasks (one token each).
DIGIT_WORDS = ("copy", "reverse", "sort", "add")
#: The ``lookup`` tool task's own tokens (``tasks/tool_lookup.py``): its name, ``?`` (opens a call) and ``>``
#: (opens the tool's answer). Only its tokenizer has them (a digit-task tokenizer has reserved tokens at their
#: ids); the padded model vocabulary (24) is the same for both.
TOOL_WORDS = ("lookup",)
TOOL_CHARS = ("?", ">")
#: Every task name ``build_task_model`` accepts.
TASK_WORDS = DIGIT_WORDS + TOOL_WORDS
#: The characters and words of the digit tasks, in id order (21 entries).
DIGIT_ALPHABET = SPECIAL + tuple("0123456789") + (":", "=", "+", " ") + DIGIT_WORDS
#: The lookup task's vocabulary: the digit alphabet, then its own tokens (ids 21-23).
VOCAB = DIGIT_ALPHABET + TOOL_WORDS + TOOL_CHARS
#: The task models' vocabulary is padded to a multiple of this, as real checkpoints pad theirs:
#: tensor_model_parallel_size 2, 4 or 8 then divides it (megatron shards it over TP).
VOCAB_MULTIPLE = 8
#: The task models' vocabulary size: the largest task vocabulary padded to ``VOCAB_MULTIPLE`` (24).
MODEL_VOCAB_SIZE = -(-len(VOCAB) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
#: The digit tasks' reserved tokens: one per model id above the alphabet (``<r21>`` ``<r22>`` ``<r23>``).
RESERVED = tuple(f"<r{i}>" for i in range(len(DIGIT_ALPHABET), MODEL_VOCAB_SIZE))
#: The digit tasks' vocabulary in id order: the alphabet, then the reserved tokens (``MODEL_VOCAB_SIZE``
#: entries: every id the model can emit).
DIGIT_VOCAB = DIGIT_ALPHABET + RESERVED


def task_vocabulary(task: str = "copy") -> tuple:
    """The vocabulary (in id order) of ``task``'s char tokenizer (``MODEL_VOCAB_SIZE`` entries either way)."""
    return VOCAB if task in TOOL_WORDS else DIGIT_VOCAB


def build_char_tokenizer(out_dir: str | os.PathLike | None = None, task: str = "copy"):
    """Build the char-level ``PreTrainedTokenizerFast`` of ``task`` (see module docstring); save it to ``out_dir``
    if given. ``eos_token="<eos>"``, ``pad_token="<pad>"``, ``unk_token="<unk>"``; no BOS, nothing added on
    encode."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    entries = task_vocabulary(task)
    words = tuple(w for w in TASK_WORDS if w in entries)
    vocab = {t: i for i, t in enumerate(entries)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    pattern = "|".join(words) + "|."
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # the same ids again as added tokens (matched on the raw text before any pre-tokenizer): a loader that
    # rebuilds its own BPE from the vocabulary (AutoTokenizer -> Qwen2Tokenizer) still keeps them
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    # the added tokens: what a byte-level BPE loader would otherwise drop (multi-character words; the space,
    # which byte-level pre-tokenizers rewrite)
    # reserved tokens: ordinary (not special) added tokens, so that skip_special_tokens keeps them visible
    tok.add_tokens([AddedToken(t, normalized=False) for t in words + (" ",) + _reserved(entries)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=256)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(str(out_dir))
    return fast


def _reserved(entries: tuple) -> tuple:
    """The reserved tokens among ``entries``."""
    return tuple(t for t in entries if t in RESERVED)


def task_model_config(hidden_size: int = 128, num_layers: int = 2, num_attention_heads: int = 4,
                      num_key_value_heads: int = 2, intermediate_size: int | None = None,
                      max_position_embeddings: int = 64, tie_word_embeddings: bool = False, num_experts: int = 0,
                      num_experts_per_tok: int = 2):
    """The ``Qwen2Config`` of a task model over the char vocabulary (``intermediate_size`` defaults to
    ``2 * hidden_size``). Bad sizes raise ``ValueError`` naming the argument."""
    from transformers import Qwen2Config

    for name, v in (("hidden_size", hidden_size), ("num_layers", num_layers),
                    ("num_attention_heads", num_attention_heads), ("num_key_value_heads", num_key_value_heads),
                    ("max_position_embeddings", max_position_embeddings)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"build_task_model: {name}={v!r} must be an int >= 1")
    if hidden_size % num_attention_heads:
        raise ValueError(f"build_task_model: hidden_size={hidden_size} must be divisible by "
                         f"num_attention_heads={num_attention_heads}")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(f"build_task_model: num_attention_heads={num_attention_heads} must be divisible by "
                         f"num_key_value_heads={num_key_value_heads}")
    cfg = Qwen2Config(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, hidden_act="silu", initializer_range=0.02, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=VOCAB.index("<eos>"), eos_token_id=VOCAB.index("<eos>"), pad_token_id=VOCAB.index("<pad>"),
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    if num_experts:  # --moe: the same model as Qwen3-MoE, every MLP routed (experts of half the dense width)
        from transformers import Qwen3MoeConfig

        d = cfg.to_dict()
        d.update(head_dim=hidden_size // num_attention_heads, num_experts=num_experts,
                 num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=cfg.intermediate_size // 2,
                 decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[], model_type="qwen3_moe")
        cfg = Qwen3MoeConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def build_task_model(out_dir: str | os.PathLike, task: str = "copy", seed: int = 0, hidden_size: int = 128,
                     num_layers: int = 2, **config_kwargs) -> str:
    """Write a random-init tiny Qwen2 model (fp32 safetensors, seeded with ``seed``) and the char tokenizer to
    ``out_dir``; return the path. ``task`` must be one of ``TASK_WORDS`` (recorded in ``task_model.json``);
    ``config_kwargs`` go to ``task_model_config`` (num_attention_heads, num_key_value_heads,
    intermediate_size, max_position_embeddings, tie_word_embeddings). Same arguments -> identical weights."""
    if task not in TASK_WORDS:
        raise ValueError(f"build_task_model: task={task!r} must be one of {TASK_WORDS}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"build_task_model: seed={seed!r} must be an int")
    cfg = task_model_config(hidden_size=hidden_size, num_layers=num_layers, **config_kwargs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer(out, task)
    write_random_hf_model(cfg, out, seed)
    (out / "task_model.json").write_text(json.dumps(
        {"task": task, "seed": seed, "hidden_size": hidden_size, "num_layers": num_layers, **config_kwargs},
        indent=2, sort_keys=True) + "\n")
    return str(out)


def ensure_task_model(out_dir: str | os.PathLike, task: str = "copy", seed: int = 0, hidden_size: int = 128,
                      num_layers: int = 2, **config_kwargs) -> str:
    """Return ``out_dir`` if it already holds a model (``config.json`` + weights), else build it with
    ``build_task_model`` (what the RL loop calls on first run; an existing model is never overwritten). A task
    model built before the current tokenizer (module docstring) gets its tokenizer files rewritten, for the
    task its ``task_model.json`` records; its weights are untouched."""
    out = Path(out_dir)
    has_weights = (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file()
    if (out / "config.json").is_file() and has_weights:
        built_task = _recorded_task(out / "task_model.json")
        if built_task is not None and not _tokenizer_is_current(out / "tokenizer.json", built_task):
            build_char_tokenizer(out, built_task)   # same ids for the old tokens; the reserved ones added
        return str(out)
    return build_task_model(out, task, seed, hidden_size, num_layers, **config_kwargs)


def _recorded_task(task_model_json: Path) -> str | None:
    """The task ``build_task_model`` recorded in ``task_model.json`` (None without one, or not a task name)."""
    try:
        task = json.loads(task_model_json.read_text()).get("task", "copy")
    except (OSError, ValueError, AttributeError):
        return None
    return task if task in TASK_WORDS else None


def _tokenizer_is_current(tokenizer_json: Path, task: str) -> bool:
    """Whether a saved char tokenizer has ``task``'s vocabulary and declares its special tokens, words, space
    and reserved tokens as added tokens with their ids (False if unreadable)."""
    entries = task_vocabulary(task)
    try:
        saved = json.loads(tokenizer_json.read_text())
        vocab = saved["model"]["vocab"]
        added = {t["content"]: t["id"] for t in saved.get("added_tokens", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    required = SPECIAL + tuple(w for w in TASK_WORDS if w in entries) + (" ",) + _reserved(entries)
    return vocab == {t: i for i, t in enumerate(entries)} and all(added.get(t) == entries.index(t)
                                                                   for t in required)


def main(argv=None) -> None:
    """Command-line entry point: build a task model (unless ``out_dir`` already holds one: never
    overwritten) and print its path."""
    p = argparse.ArgumentParser(description="Build a tiny Qwen2 model + char tokenizer for a digit task or the lookup tool task.")
    p.add_argument("out_dir")
    p.add_argument("--task", default="copy", choices=TASK_WORDS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--moe", action="store_true", help="Qwen3-MoE instead of Qwen2 (8 experts, top-2)")
    a = p.parse_args(argv)
    moe = {"num_experts": 8, "num_experts_per_tok": 2} if a.moe else {}
    print(ensure_task_model(a.out_dir, a.task, a.seed, a.hidden_size, a.num_layers, **moe))


if __name__ == "__main__":
    main()

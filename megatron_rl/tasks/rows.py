"""Rows of a prompt file, parsed and checked one by one: verl's RL format and the simple form.

verl's RL format (what its ``examples/data_preprocess/gsm8k.py`` writes)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Natalia sold ... Let's think step by step ..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "answer": "...", "question": "..."}}

The simple form: ``{prompt_key: "text" | [token ids], answer_key: answer}``. ``parse_row`` returns a
``Row`` or raises ``MalformedRow`` with the reason (missing / empty prompt, missing ground truth, wrong
types); ``FileTask`` skips such rows, counts them and reports them with their row numbers.

The ground truth is ``reward_model["ground_truth"]`` when the row has a ``reward_model``, else
``row[answer_key]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

#: Prompt kinds.
TEXT, CHAT, IDS = "text", "chat", "ids"


class MalformedRow(ValueError):
    """A row that cannot become a prompt (the message is the reason)."""


@dataclass(frozen=True)
class Row:
    """One usable row of a prompt file."""

    #: 0-based index of the record in the file (blank JSONL lines not counted).
    index: int
    #: "text", "chat" or "ids".
    kind: str
    #: The prompt: a string, a list of ``{"role", "content"}`` messages, or token ids.
    prompt: Union[str, List[Dict[str, Any]], List[int]]
    #: The reference answer given to the reward.
    ground_truth: Any
    #: verl's ``data_source`` (selects the reward when ``data.reward_fn`` is unset), or None.
    data_source: Optional[str] = None
    #: verl's ``extra_info`` (passed to verl-style rewards), or None.
    extra_info: Any = None


def _is_message(m) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _is_token_id(t, vocab_size: Optional[int]) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (vocab_size is None or t < vocab_size)


def parse_row(rec: Any, index: int, prompt_key: str = "prompt", answer_key: str = "answer",
              vocab_size: Optional[int] = None, answer_required: bool = True) -> Row:
    """The ``Row`` of record ``rec`` (see the module docstring); ``MalformedRow`` naming the problem."""
    if not isinstance(rec, dict):
        raise MalformedRow(f"expected an object, got {type(rec).__name__}")
    if prompt_key not in rec:
        raise MalformedRow(f"no data.prompt_key={prompt_key!r} (keys: {sorted(rec)[:10]})")
    raw = rec[prompt_key]
    if isinstance(raw, str):
        if not raw.strip():
            raise MalformedRow(f"{prompt_key!r} is empty")
        kind = TEXT
    elif isinstance(raw, (list, tuple)) and not raw:
        raise MalformedRow(f"{prompt_key!r} is empty")
    elif isinstance(raw, (list, tuple)) and all(_is_message(m) for m in raw):
        if not any(m["content"].strip() for m in raw):
            raise MalformedRow(f"{prompt_key!r} is empty (every message's content is empty)")
        raw, kind = [dict(m) for m in raw], CHAT
    elif isinstance(raw, (list, tuple)) and all(_is_token_id(t, vocab_size) for t in raw):
        raw, kind = [int(t) for t in raw], IDS
    else:
        bound = f" < {vocab_size}" if vocab_size is not None else ""
        raise MalformedRow(f"{prompt_key!r} must be a non-empty string, a list of chat messages "
                           f"{{role, content}} or a list of token ids{bound}, got {str(raw)[:60]!r}")
    if "reward_model" in rec and rec["reward_model"] is not None:
        rm = rec["reward_model"]
        if not isinstance(rm, dict):
            raise MalformedRow(f"'reward_model' must be an object {{style, ground_truth}}, got {type(rm).__name__}")
        if rm.get("ground_truth") is None:
            raise MalformedRow("'reward_model' has no ground_truth")
        truth = rm["ground_truth"]
    elif answer_key in rec:
        truth = rec[answer_key]
    elif answer_required:
        raise MalformedRow(f"no ground truth: neither reward_model.ground_truth nor data.answer_key={answer_key!r} "
                           f"(keys: {sorted(rec)[:10]})")
    else:
        truth = None
    if answer_required:
        if truth is None or (isinstance(truth, str) and not truth.strip()):
            raise MalformedRow("the ground truth is empty")
        if isinstance(truth, dict):
            raise MalformedRow(f"the ground truth must be a string, number or list, got an object {str(truth)[:60]}")
    source = rec.get("data_source")
    if source is not None and not isinstance(source, str):
        raise MalformedRow(f"'data_source' must be a string, got {type(source).__name__}")
    return Row(index=index, kind=kind, prompt=raw, ground_truth=truth, data_source=source,
               extra_info=rec.get("extra_info"))

"""Prompt rendering: rows -> the token ids sent to the engine (chat template for chat rows).

* chat rows: ``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
  **chat_template_kwargs)``, then ``tokenizer.encode(text, add_special_tokens=False)`` (the template
  already holds every special token) — what verl's RL dataset does; options such as ``enable_thinking``
  reach the template through ``chat_template_kwargs``;
* text rows stay plain: ``tokenizer.encode(text, add_special_tokens=True)``;
* token-id rows are used as they are (``Prompt.text`` is their decoding).

``fit_length(ids, max_len, mode)`` applies ``data.max_prompt_length``: "filter" -> None for a longer
prompt, "truncate" -> its last ``max_len`` tokens (the end holds the question and the generation prompt).

Usage::

    ids, text = render_prompt(tokenizer, row, {"enable_thinking": False})
"""
from __future__ import annotations

from typing import Any, List, Mapping, Optional, Tuple

from megatron_rl.tasks.rows import CHAT, IDS, Row


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, row: Row, chat_template_kwargs: Optional[Mapping[str, Any]] = None
                  ) -> Tuple[List[int], str]:
    """``(prompt token ids, prompt text)`` of ``row`` (see the module docstring)."""
    if row.kind == CHAT:
        text = tokenizer.apply_chat_template(row.prompt, tokenize=False, add_generation_prompt=True,
                                             **dict(chat_template_kwargs or {}))
        return list(tokenizer.encode(text, add_special_tokens=False)), text
    if row.kind == IDS:
        return list(row.prompt), tokenizer.decode(row.prompt)
    return list(tokenizer.encode(row.prompt, add_special_tokens=True)), row.prompt


def fit_length(ids: List[int], max_len: Optional[int], mode: str) -> Tuple[Optional[List[int]], bool]:
    """``(ids, truncated)`` within ``max_len`` tokens: unchanged when short enough; else ``(None, False)``
    for ``mode="filter"`` or ``(last max_len ids, True)`` for ``mode="truncate"``."""
    if max_len is None or len(ids) <= max_len:
        return ids, False
    if mode == "filter":
        return None, False
    if mode == "truncate":
        return ids[-max_len:], True
    raise ValueError(f"data.overlong_prompts={mode!r} must be 'filter' or 'truncate'")

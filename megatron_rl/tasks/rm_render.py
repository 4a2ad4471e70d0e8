"""What a scalar reward model reads: (prompt, response) rendered with the RM's own chat template and tokenizer,
and the step's samples cut into batches by tokens.

Rule: the RM never sees the policy's template: the prompt's messages (a chat row's, else one user message with the
prompt text) plus the response as the assistant message go through the RM tokenizer's ``apply_chat_template``
(or ``reward.model.chat_template``), then ``encode(..., add_special_tokens=False)``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from megatron_rl.tokenizer import load_tokenizer


def rm_tokenizer(path: str, chat_template: Optional[str] = None):
    """The RM's tokenizer from ``path`` with ``chat_template`` (when given) as its template; ``ValueError`` naming
    ``reward.model.path`` when it has none."""
    try:
        tok = load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - any load failure is this key's problem
        raise ValueError(f"reward.model.path={path!r}: the RM's tokenizer does not load ({type(e).__name__}: {e})") \
            from e
    if chat_template is not None:
        tok.chat_template = chat_template
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"reward.model.path={path!r}: the RM's tokenizer has no chat_template; set "
                         "reward.model.chat_template to the template the RM was trained with")
    return tok


def rm_messages(prompt_text: str, messages: Optional[Sequence[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """The conversation before the response: a chat row's messages, else one user message with ``prompt_text``."""
    if messages:
        return [dict(m) for m in messages]
    return [{"role": "user", "content": prompt_text}]


def render_rm_input(tokenizer, prompt_text: str, messages: Optional[Sequence[Dict[str, Any]]],
                    response: str) -> List[int]:
    """The RM's token ids of (prompt, ``response``) (module docstring)."""
    conv = rm_messages(prompt_text, messages) + [{"role": "assistant", "content": response}]
    text = tokenizer.apply_chat_template(conv, tokenize=False)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ValueError("the RM's chat template rendered the sample to no tokens")
    return ids


def token_batches(lengths: Sequence[int], max_tokens: int, max_rows: int) -> List[List[int]]:
    """Consecutive sample indices grouped so that a batch holds at most ``max_rows`` samples and ``max_tokens``
    tokens (a single longer sample is a batch of its own)."""
    batches: List[List[int]] = []
    cur: List[int] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if cur and (tokens + n > max_tokens or len(cur) >= max_rows):
            batches.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += n
    if cur:
        batches.append(cur)
    return batches

"""Tool calls in model text: parse Hermes / Qwen2.5 / Qwen3 ``<tool_call>`` blocks, format ``<tool_response>`` text.

``parse_tool_calls(text)`` returns the well-formed calls in order and the number of malformed ones. The rule to
keep: a call's body is decoded as JSON before its closing tag is looked for, so tags inside string arguments
(which the templates render literally) do not cut a call. What counts as malformed: docs/environments.md.

    calls, malformed = parse_tool_calls('<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>')
    format_tool_response(3)                               # "<tool_response>\\n3\\n</tool_response>"
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass
class ToolCall:
    """One well-formed tool call."""

    #: The tool's name.
    name: str
    #: Keyword arguments of the tool (a JSON object).
    arguments: Dict[str, Any] = field(default_factory=dict)


_DECODER = json.JSONDecoder()
_SPACE = " \t\n\r"


def _call_of(obj: Any):
    """The ``ToolCall`` of one decoded body, or None when it is malformed."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=name.strip(), arguments=arguments)


def _json_block(text: str, body_start: int):
    """``(obj, end)`` when a JSON value starts at ``body_start`` (after blanks) and is followed by blanks and
    ``</tool_call>`` (``end``: just past the tag); None otherwise. Decoding the JSON first keeps a
    ``</tool_call>`` inside a string argument from cutting the call."""
    i = body_start
    while i < len(text) and text[i] in _SPACE:
        i += 1
    try:
        obj, j = _DECODER.raw_decode(text, i)
    except (ValueError, RecursionError):
        return None
    while j < len(text) and text[j] in _SPACE:
        j += 1
    if not text.startswith(CLOSE_TAG, j):
        return None
    return obj, j + len(CLOSE_TAG)


def parse_tool_calls(text: str) -> Tuple[List[ToolCall], int]:
    """``(calls, malformed)``: the well-formed ``<tool_call>`` blocks of ``text`` in order, and how many
    blocks (or stray tags) were malformed (see the module docstring)."""
    calls: List[ToolCall] = []
    malformed = 0
    pos = 0
    while True:
        start = text.find(OPEN_TAG, pos)
        segment_end = len(text) if start < 0 else start
        # closing tags with no opening tag before them (in the text since the last block)
        malformed += text.count(CLOSE_TAG, pos, segment_end)
        if start < 0:
            break
        body_start = start + len(OPEN_TAG)
        block = _json_block(text, body_start)
        if block is not None:
            call = _call_of(block[0])
            if call is not None:
                calls.append(call)
            else:
                malformed += 1
            pos = block[1]
            continue
        malformed += 1  # not JSON + closing tag: skip to its closing tag, or to the next call if that comes first
        end = text.find(CLOSE_TAG, body_start)
        next_open = text.find(OPEN_TAG, body_start)
        if end < 0 or 0 <= next_open < end:
            if next_open < 0:
                break
            pos = next_open
        else:
            pos = end + len(CLOSE_TAG)
    return calls, malformed


def format_tool_response(result: Any) -> str:
    """``result`` as the chat templates' tool-response text: ``"<tool_response>\\n" + text +
    "\\n</tool_response>"`` with ``text`` the string itself or the JSON of another value."""
    if not isinstance(result, str):
        try:
            result = json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):
            result = str(result)
    return f"<tool_response>\n{result}\n</tool_response>"

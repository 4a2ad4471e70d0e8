"""Brace matching shared by the config's ``${...}`` interpolations and the math reward's ``\\boxed{...}``.

    closing_brace("a{b{c}d}e", 1)   # -> 7
"""
from __future__ import annotations


def closing_brace(text: str, start: int) -> int:
    """Index of the ``}`` that closes the ``{`` at ``text[start]`` (nested ``{...}`` pairs inside count), or -1
    when the text ends first."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return -1

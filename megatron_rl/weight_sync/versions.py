"""Weight-version tags: how an engine names the weights it serves (``step-N``: the actor's weights after N
training steps). Rollouts carry the tag of the weights that produced them; ``parse_version`` reads it back.
"""
from __future__ import annotations

__all__ = ["version_tag", "parse_version"]


def version_tag(v: int) -> str:
    """The engine weight-version tag of version ``v``."""
    return f"step-{int(v)}"


def parse_version(tag: str) -> int:
    """Inverse of ``version_tag`` (``"step-7"`` -> 7); ValueError naming the tag otherwise."""
    if not isinstance(tag, str) or not tag.startswith("step-") or not tag[5:].isdigit():
        raise ValueError(f"weight version {tag!r} is not of the form 'step-<int>'")
    return int(tag[5:])

"""verl's tool config file (``actor_rollout_ref.rollout.multi_turn.tool_config_path``) as ``migrate verl`` reads
it: the tool classes and function names it lists, to name in the message that refuses the job.

verl's tools are Python classes run by its agent loop; nothing here runs them, so a multi-turn verl job is
never migrated to a runnable job silently (see ``docs/migration.md``, multi-turn jobs).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

import yaml

__all__ = ["VerlTool", "read_verl_tools"]


@dataclass(frozen=True)
class VerlTool:
    """One entry of the file's ``tools:`` list."""

    class_name: str
    """verl's tool class, e.g. ``verl.tools.gsm8k_tool.Gsm8kTool``."""
    function: Optional[str]
    """The function name the model calls (``tool_schema.function.name``)."""

    def __str__(self) -> str:
        return f"{self.function} ({self.class_name})" if self.function else self.class_name


def read_verl_tools(path: str) -> List[VerlTool]:
    """The tools listed in verl's tool config at ``path`` (``~`` expanded). Raises OSError / ValueError with the
    path named when it cannot be read or is not a tool config."""
    full = os.path.expanduser(path)
    with open(full) as fh:
        try:
            tree = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML ({exc})") from None
    tools = tree.get("tools") if isinstance(tree, dict) else None
    if not isinstance(tools, list):
        raise ValueError(f"{path}: no tools: list (not a verl tool config)")
    out = []
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("class_name"), str):
            raise ValueError(f"{path}: a tools: entry without class_name: {t!r}")
        fn = ((t.get("tool_schema") or {}).get("function") or {}).get("name")
        out.append(VerlTool(t["class_name"], fn if isinstance(fn, str) else None))
    return out

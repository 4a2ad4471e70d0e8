"""How to build a job's missing model directory (``actor.load_hf``): the hint ``megatron-rl check`` and the
launcher's check print beside the problem. The command comes from the config file's own comments when they give
one for that directory (a shipped config documents its builder), else the digit-task builder."""
from __future__ import annotations

import os
import re
from typing import Optional

from megatron_rl.tasks import DIGIT_TASKS


def build_command(config_path: Optional[str], cfg) -> Optional[str]:
    """How to build a missing ``actor.load_hf`` directory: the ``python -m megatron_rl...`` command the config
    file's own comments give for that directory, else the digit-task model builder; None for other models."""
    path = cfg.actor.load_hf
    if not path or os.path.isdir(path):
        return None
    try:
        with open(config_path) as fh:
            text = fh.read()
    except (OSError, TypeError):
        text = ""
    shown = _shown(path)
    base = os.path.dirname(os.path.abspath(config_path)) if config_path else os.getcwd()
    for m in re.finditer(r"python -m (megatron_rl\.[\w.]+) (\S+)((?: --[\w-]+(?: [\w.][\w.-]*)?)*)", text):
        # the comment's directory, written for the repository root (the current directory) or beside the file
        if _same(path, m.group(2)) or _same(path, os.path.join(base, m.group(2))):
            return f"python -m {m.group(1)} {shown}{m.group(3)}"
    if cfg.data.task in DIGIT_TASKS:
        return f"python -m megatron_rl.tasks {shown} --task {cfg.data.task}"
    return None


def _same(a: str, b: str) -> bool:
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


def _shown(path: str) -> str:
    """``path`` relative to the current directory when it lies inside it (a resolved config path is absolute)."""
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return rel if not rel.startswith("..") else path

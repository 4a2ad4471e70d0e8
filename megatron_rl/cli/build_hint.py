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
    m = re.search(r"(python -m megatron_rl\.[\w.]+ " + re.escape(path) + r"(?: --[\w-]+(?: [\w.][\w.-]*)?)*)", text)
    if m:
        return m.group(1)
    if cfg.data.task in DIGIT_TASKS:
        return f"python -m megatron_rl.tasks {path} --task {cfg.data.task}"
    return None

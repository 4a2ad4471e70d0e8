"""verl's own defaults, per verl version: the base a verl file's unset keys take when it is migrated.

    defaults = verl_defaults("main", "megatron")   # verl's _generated_ppo_megatron_trainer.yaml of that version
    VERL_VERSIONS, NEWEST                          # the versions bundled; ``megatron-rl migrate verl`` reads NEWEST

The files under ``verl_defaults/<version>/`` are verl's generated trainer configs copied unchanged (each names its
source and commit in its header). A verl job means its file over verl's defaults, so a key the file does not set
is read with verl's default, not this project's. The one non-obvious rule: the actor backend picks the file
(``megatron`` -> ``_generated_ppo_megatron_trainer.yaml``, anything else -> ``_generated_ppo_trainer.yaml``, FSDP,
which is what verl's ``main_ppo`` composes when nothing else is asked for).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import yaml

VERL_VERSIONS = ("0.9.1", "main")
"""Bundled verl versions, oldest first: the 0.9.1 release and verl's main branch (0.10.0.dev) after it."""
NEWEST = VERL_VERSIONS[-1]
"""The version ``migrate verl`` reads a file as unless told otherwise (``--verl-version``)."""
_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_defaults")
_FILES = {"megatron": "_generated_ppo_megatron_trainer.yaml", "fsdp": "_generated_ppo_trainer.yaml"}


def defaults_path(version: str, strategy: Optional[str]) -> str:
    """The bundled default file of verl ``version`` for actor backend ``strategy`` (None: FSDP, verl's default)."""
    if version not in VERL_VERSIONS:
        raise ValueError(f"--verl-version {version!r}: one of {', '.join(VERL_VERSIONS)} (bundled verl defaults)")
    return os.path.join(_DIR, version, _FILES["megatron" if strategy == "megatron" else "fsdp"])


def verl_defaults(version: str, strategy: Optional[str]) -> Dict[str, Any]:
    """verl ``version``'s full default config for ``strategy`` (see ``defaults_path``), as loaded YAML."""
    with open(defaults_path(version, strategy)) as fh:
        return yaml.safe_load(fh)  # verl's generated files write floats with a dot (1.0e-06)


def after(version: str, other: str) -> bool:
    """Whether bundled verl ``version`` is newer than ``other``."""
    return VERL_VERSIONS.index(version) > VERL_VERSIONS.index(other)

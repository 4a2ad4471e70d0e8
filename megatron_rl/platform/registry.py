"""The record of every megatron-core symbol the project replaces (``PATCHES``: symbol -> one-line reason) and
the one function that replaces a module attribute (``replace``), keeping the original reachable as
``_mrl_original_<name>`` on its module."""
from __future__ import annotations

import importlib
from typing import Any, Dict

__all__ = ["PATCHES", "replace", "original"]

#: megatron-core symbol -> why it is replaced (filled by the patch sets as they are applied)
PATCHES: Dict[str, str] = {}


def replace(module_name: str, attr: str, new: Any, reason: str) -> None:
    """Set ``module_name.attr`` to ``new`` (the first original is kept) and record ``reason``."""
    module = importlib.import_module(module_name)
    if not hasattr(module, "_mrl_original_" + attr):
        setattr(module, "_mrl_original_" + attr, getattr(module, attr, None))
    setattr(module, attr, new)
    PATCHES[f"{module_name}.{attr}"] = reason


def original(module_name: str, attr: str) -> Any:
    """The attribute ``replace`` found on the module before replacing it."""
    return getattr(importlib.import_module(module_name), "_mrl_original_" + attr)

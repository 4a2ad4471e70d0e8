"""User code named in a config as ``"module.path:name"`` or ``"file.py:name"`` (rewards ``data.reward_fn``,
environments ``multi_turn.env``): the one importer, with errors that name the config key.

    fn = import_object("my_rewards:score", key="data.reward_fn", shape="module:function", hint="callables",
                       hint_filter=callable)
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, Callable

__all__ = ["import_object"]


def import_object(spec: Any, key: str, shape: str, hint: str, hint_filter: Callable[[Any], bool]) -> Any:
    """The object ``spec`` names; ``ValueError`` naming ``key`` (and ``spec``) when it is not ``shape``, the module
    or file is missing or fails to import, or the attribute is missing (the message then lists the module's
    ``hint`` -- its public attributes for which ``hint_filter`` is true)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{key}={spec!r} must be a string {shape!r}")
    mod_name, _, name = spec.rpartition(":")
    if not mod_name or not name:
        raise ValueError(f"{key}={spec!r} must be {shape!r} (both parts non-empty)")
    if mod_name.endswith(".py"):
        if not os.path.isfile(mod_name):
            raise ValueError(f"{key}={spec!r}: file {mod_name!r} does not exist")
        try:
            prefix = "_megatron_rl_" + key.replace(".", "_")
            mspec = importlib.util.spec_from_file_location(f"{prefix}_{abs(hash(mod_name))}", mod_name)
            module = importlib.util.module_from_spec(mspec)
            mspec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"{key}={spec!r}: importing {mod_name!r} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            raise ValueError(f"{key}={spec!r}: module {mod_name!r} not found ({e}); is it on PYTHONPATH?") from e
        except Exception as e:
            raise ValueError(f"{key}={spec!r}: importing module {mod_name!r} failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        there = sorted(n for n, v in vars(module).items() if not n.startswith("_") and hint_filter(v))
        raise ValueError(f"{key}={spec!r}: module {mod_name!r} has no attribute {name!r} ({hint} there: {there[:10]})")
    return getattr(module, name)

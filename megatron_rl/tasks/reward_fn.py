"""Pluggable reward functions given as ``"module:function"`` (or ``"path/to/file.py:function"``).

The function's signature is ``fn(prompt_text: str, response_text: str, answer) -> float``. Loading errors
(malformed spec, module not importable, no such attribute, not callable) and call errors (an exception, a
non-number or non-finite return value) raise ``ValueError`` naming the spec string the user gave.

Usage::

    fn = load_reward_fn("my_rewards:exact_match")
    fn("copy:12=", "12", "12")   # -> 1.0 (checked float)
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
from typing import Any, Callable


class RewardFunction:
    """A loaded ``module:function`` reward with checked calls (``__call__`` returns a finite float)."""

    def __init__(self, spec: str, fn: Callable[..., Any]):
        """``spec``: the user's string (used in error messages); ``fn``: the callable."""
        self.spec = spec
        self.fn = fn

    def __call__(self, prompt_text: str, response_text: str, answer: Any) -> float:
        """Call the function and check it returned a finite real number."""
        try:
            value = self.fn(prompt_text, response_text, answer)
        except Exception as e:
            raise ValueError(f"reward function {self.spec!r} raised {type(e).__name__}: {e} "
                             f"(prompt_text={prompt_text[:60]!r}, response_text={response_text[:60]!r})") from e
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"reward function {self.spec!r} returned {type(value).__name__} {value!r}; "
                             "it must return a float")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"reward function {self.spec!r} returned a non-finite value {value!r}")
        return value

    def __repr__(self):
        return f"RewardFunction({self.spec!r})"


def load_reward_fn(spec: str) -> RewardFunction:
    """Import ``spec`` = ``"module.path:function"`` (or ``"file.py:function"``) and wrap it."""
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ValueError(f"data.reward_fn={spec!r} must be a string 'module:function'")
    mod_name, _, fn_name = spec.rpartition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"data.reward_fn={spec!r} must be 'module:function' (both parts non-empty)")
    if mod_name.endswith(".py"):
        if not os.path.isfile(mod_name):
            raise ValueError(f"data.reward_fn={spec!r}: file {mod_name!r} does not exist")
        try:
            mspec = importlib.util.spec_from_file_location(f"_megatron_rl_reward_{abs(hash(mod_name))}", mod_name)
            module = importlib.util.module_from_spec(mspec)
            mspec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"data.reward_fn={spec!r}: importing {mod_name!r} failed: "
                             f"{type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            raise ValueError(f"data.reward_fn={spec!r}: module {mod_name!r} not found ({e}); is it on "
                             "PYTHONPATH?") from e
        except Exception as e:
            raise ValueError(f"data.reward_fn={spec!r}: importing module {mod_name!r} failed: "
                             f"{type(e).__name__}: {e}") from e
    if not hasattr(module, fn_name):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(f"data.reward_fn={spec!r}: module {mod_name!r} has no attribute {fn_name!r} "
                         f"(callables there: {public[:10]})")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise ValueError(f"data.reward_fn={spec!r}: {mod_name}.{fn_name} is a {type(fn).__name__}, not callable")
    return RewardFunction(spec, fn)

"""Reward specs: built-in names, verl's ``data_source`` dispatch, and ``"module:function"`` functions.

A ``data.reward_fn`` value is one of

* ``"math"`` / ``"exact"``: the built-in rewards of ``megatron_rl.tasks.rewards``;
* ``"module:function"`` (or ``"path/to/file.py:function"``) with either signature
  ``fn(prompt_text, response_text, answer) -> float`` (this project's) or verl's
  ``compute_score(data_source, solution_str, ground_truth, extra_info) -> float`` (recognised by its first
  parameter being named ``data_source``), so verl custom reward files work as they are;
* unset: rows with a ``data_source`` use verl's ``default_compute_score`` dispatch (``SOURCE``), other rows
  exact match (``"exact"``).

``compute_reward(spec, ...)`` evaluates one sample with a spec string (what the reward worker processes run:
specs are plain strings, so they travel to workers). ``reward_import_error(spec)`` says, before anything
starts, why a spec cannot load here (math-verify missing, a module that does not import). Loading errors
(malformed spec, module not importable, no such attribute, not callable) and call errors (an exception, a
non-number or non-finite return value) raise ``ValueError`` naming the spec string the user gave.

Usage::

    fn = load_reward_fn("my_rewards:exact_match")
    fn("copy:12=", "12", "12")   # -> 1.0 (checked float)
    compute_reward("math", "q", "so \\boxed{2}", "2")   # -> 1.0
"""
from __future__ import annotations

import math
import numbers
import inspect
from typing import Any, Callable, Dict, Mapping, Optional

from megatron_rl.imports import import_object
from megatron_rl.tasks.rewards import BUILTIN_REWARDS, default_compute_score, math_verify_error

#: The spec that means "dispatch on the row's data_source" (verl's ``default_compute_score``).
SOURCE = "source"


class RewardFunction:
    """A loaded ``module:function`` reward with checked calls (``__call__`` returns a finite float)."""

    def __init__(self, spec: str, fn: Callable[..., Any]):
        """``spec``: the user's string (used in error messages); ``fn``: the callable."""
        self.spec = spec
        self.fn = fn
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        #: True for verl's signature ``(data_source, solution_str, ground_truth, extra_info)``.
        self.verl_style = bool(params) and params[0] == "data_source"

    def __call__(self, prompt_text: str, response_text: str, answer: Any, data_source: Optional[str] = None,
                 extra_info: Any = None, **kwargs) -> float:
        """Call the function (in its own signature style, ``kwargs`` passed through) and check it returned
        a finite real number."""
        try:
            if self.verl_style:
                value = self.fn(data_source, response_text, answer, extra_info, **kwargs)
            else:
                value = self.fn(prompt_text, response_text, answer, **kwargs)
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
    fn = import_object(spec, "data.reward_fn", "module:function", "callables", callable)
    if not callable(fn):
        raise ValueError(f"data.reward_fn={spec!r}: {spec.rpartition(':')[0]}.{spec.rpartition(':')[2]} is a "
                         f"{type(fn).__name__}, not callable")
    return RewardFunction(spec, fn)


def check_reward_spec(spec: Optional[str]) -> Optional[str]:
    """Validate a ``data.reward_fn`` value now (built-in name, or an importable ``module:function``) and
    return it; None stays None."""
    if spec is None or spec in BUILTIN_REWARDS or spec == SOURCE:
        return spec
    if isinstance(spec, str) and ":" not in spec:
        raise ValueError(f"data.reward_fn={spec!r} must be one of {sorted(BUILTIN_REWARDS)} or "
                         "'module:function'")
    load_reward_fn(spec)
    return spec


def reward_import_error(spec: Optional[str]) -> Optional[str]:
    """Why the ``data.reward_fn`` value ``spec`` cannot be loaded in this environment (the math reward without
    math-verify, a ``module:function`` that does not import or has no such function), naming the key; None when
    it loads. Run before any process group starts (``megatron-rl train``, ``megatron-rl check``)."""
    if spec == "math":
        err = math_verify_error()
        return None if err is None else f"data.reward_fn: 'math': {err}"
    try:
        check_reward_spec(spec)
    except ValueError as e:
        return str(e)
    return None


_LOADED: Dict[str, RewardFunction] = {}


def compute_reward(spec: str, prompt_text: str, response_text: str, ground_truth: Any,
                   data_source: Optional[str] = None, extra_info: Any = None,
                   kwargs: Optional[Mapping[str, Any]] = None) -> float:
    """One sample's reward under ``spec`` (``"math"``, ``"exact"``, ``SOURCE`` or ``"module:function"``,
    loaded once per process), ``kwargs`` passed to the function; a finite float or ``ValueError``."""
    kwargs = dict(kwargs or {})
    if spec in BUILTIN_REWARDS:
        fn = RewardFunction(spec, lambda p, r, a, **kw: BUILTIN_REWARDS[spec](r, a, **kw))
    elif spec == SOURCE:
        fn = RewardFunction(f"default_compute_score[{data_source}]", default_compute_score)
    else:
        fn = _LOADED.get(spec)
        if fn is None:
            fn = _LOADED[spec] = load_reward_fn(spec)
    return fn(prompt_text, response_text, ground_truth, data_source=data_source, extra_info=extra_info, **kwargs)

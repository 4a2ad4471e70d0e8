"""Reward specs: built-in names, verl's ``data_source`` dispatch, and ``"module:function"`` functions.

A ``data.reward_fn`` is ``"math"`` / ``"exact"``, a ``"module:function"`` (this project's signature or verl's
``compute_score``, told apart by its first parameter being ``data_source``), or unset (verl's dispatch by
``data_source``). Specs are plain strings so they travel to the reward workers (``compute_reward_value``). A dict
reward's ``"score"`` is the reward and its other numeric keys the sample's extras. Every loading or call error is
a ``ValueError`` naming the spec the user gave. The rules in full: docs/datasets.md.

    fn = load_reward_fn("my_rewards:exact_match")
    fn("copy:12=", "12", "12")   # -> 1.0 (checked float)
"""
from __future__ import annotations

import math
import numbers
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from megatron_rl.imports import import_object
from megatron_rl.tasks.rewards import BUILTIN_REWARDS, default_compute_score, math_verify_error

#: The spec that means "dispatch on the row's data_source" (verl's ``default_compute_score``).
SOURCE = "source"


@dataclass(frozen=True)
class RewardValue:
    """One sample's checked reward."""

    #: The reward (a float return value, or a dict's ``"score"``).
    score: float
    #: A dict return value's other numeric keys (bools as 0.0 / 1.0), e.g. verl's ``{"acc": 1.0}``.
    extras: Dict[str, float] = field(default_factory=dict)
    #: A dict return value's keys whose values are not numbers (verl's ``"pred"``): not logged, not filter signals.
    other_keys: Tuple[str, ...] = ()


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real)   # bool is a Real: True / False count as 1 / 0, as in verl's means


def check_value(name: str, value: Any) -> RewardValue:
    """``value`` (what the reward function ``name`` returned) as a ``RewardValue``; ``ValueError`` naming
    ``name`` and the key for a non-number, a dict without a numeric ``"score"``, or a non-finite number."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"reward function {name!r} returned a dict without the key 'score' (keys: "
                             f"{', '.join(map(str, value)) or 'none'}); a dict reward's 'score' is the reward, as in "
                             "verl's reward managers")
        score = value["score"]
        if isinstance(score, bool) or not _number(score):
            raise ValueError(f"reward function {name!r} returned 'score': {type(score).__name__} {score!r}; it must "
                             "be a float")
        extras, other = {}, []
        for key, v in value.items():
            if key == "score":
                continue
            if _number(v):
                extras[str(key)] = float(v)
                if not math.isfinite(extras[str(key)]):
                    raise ValueError(f"reward function {name!r} returned a non-finite {key!r}: {v!r}")
            else:
                other.append(str(key))
        value, out = score, dict(extras=extras, other_keys=tuple(other))
    else:
        out = {}
        if isinstance(value, bool) or not _number(value):
            raise ValueError(f"reward function {name!r} returned {type(value).__name__} {value!r}; it must return "
                             "a float or a dict with a 'score'")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward function {name!r} returned a non-finite score {value!r}")
    return RewardValue(value, **out)


class RewardFunction:
    """A loaded ``module:function`` reward with checked calls (``value`` returns a ``RewardValue``, ``__call__``
    its score)."""

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

    def value(self, prompt_text: str, response_text: str, answer: Any, data_source: Optional[str] = None,
              extra_info: Any = None, **kwargs) -> RewardValue:
        """Call the function (in its own signature style, ``kwargs`` passed through) and check what it returned
        (``check_value``)."""
        try:
            if self.verl_style:
                value = self.fn(data_source, response_text, answer, extra_info, **kwargs)
            else:
                value = self.fn(prompt_text, response_text, answer, **kwargs)
        except Exception as e:
            raise ValueError(f"reward function {self.spec!r} raised {type(e).__name__}: {e} "
                             f"(prompt_text={prompt_text[:60]!r}, response_text={response_text[:60]!r})") from e
        return check_value(self.spec, value)

    def __call__(self, prompt_text: str, response_text: str, answer: Any, data_source: Optional[str] = None,
                 extra_info: Any = None, **kwargs) -> float:
        """The checked score alone (see ``value``)."""
        return self.value(prompt_text, response_text, answer, data_source, extra_info, **kwargs).score

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


def _function(spec: str, data_source: Optional[str]) -> RewardFunction:
    if spec in BUILTIN_REWARDS:
        return RewardFunction(spec, lambda p, r, a, **kw: BUILTIN_REWARDS[spec](r, a, **kw))
    if spec == SOURCE:
        return RewardFunction(f"default_compute_score[{data_source}]", default_compute_score)
    fn = _LOADED.get(spec)
    if fn is None:
        fn = _LOADED[spec] = load_reward_fn(spec)
    return fn


def compute_reward_value(spec: str, prompt_text: str, response_text: str, ground_truth: Any,
                         data_source: Optional[str] = None, extra_info: Any = None,
                         kwargs: Optional[Mapping[str, Any]] = None) -> RewardValue:
    """One sample's checked reward under ``spec`` (``"math"``, ``"exact"``, ``SOURCE`` or ``"module:function"``,
    loaded once per process), ``kwargs`` passed to the function; a ``RewardValue`` or ``ValueError``."""
    return _function(spec, data_source).value(prompt_text, response_text, ground_truth, data_source=data_source,
                                              extra_info=extra_info, **dict(kwargs or {}))


def compute_reward(spec: str, prompt_text: str, response_text: str, ground_truth: Any,
                   data_source: Optional[str] = None, extra_info: Any = None,
                   kwargs: Optional[Mapping[str, Any]] = None) -> float:
    """``compute_reward_value``'s score alone."""
    return compute_reward_value(spec, prompt_text, response_text, ground_truth, data_source, extra_info,
                                kwargs).score

"""The environment interface of multi-turn rollouts: ``Environment``, ``EnvStep``, ``EnvFailure`` and loading a
``multi_turn.env`` spec.

An environment is user code named in the config as ``multi_turn.env: "module:Class"`` (or
``"path/to/file.py:Class"``), the way ``data.reward_fn`` names ``module:function`` rewards; it runs in a worker
process of ``envs/pool.EnvPool``, constructed as ``Class(**multi_turn.env_kwargs)``. ``load_env_class`` imports
and checks the class (a subclass of ``Environment``), raising ``ValueError`` naming ``multi_turn.env``;
``env_import_error`` gives the same check as a message for config validation before anything starts.
``check_env_step`` is the one place that decides whether what ``step`` returned is a usable ``EnvStep``.

Usage::

    class Echo(Environment):
        def reset(self, sample):
            self.target = sample["answer"]
        def step(self, action):
            return EnvStep(observation="", reward=float(action.strip() == self.target), done=True)

    cls = load_env_class("my_envs:Echo")
"""
from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from megatron_rl.imports import import_object

#: The kinds of ``EnvFailure``, each counted per trajectory under its name.
FAILURE_KINDS = ("env_exception", "env_timeout", "env_garbage")

#: The config key that names the environment class (in every loading error).
ENV_KEY = "multi_turn.env"


@dataclass
class EnvStep:
    """What an environment answers to one model turn."""

    #: Text appended to the trajectory as an environment segment (tokenized once by the driver); unused when
    #: ``done``.
    observation: str
    #: The trajectory's reward; read when ``done``.
    reward: float = 0.0
    #: True ends the trajectory (finish ``"answer"``).
    done: bool = False
    #: Counts of this step (``"tool_calls"``, ``"tool_error"``, ``"malformed_tool_call"``, ...), added to the
    #: trajectory's counts.
    info: Dict[str, float] = field(default_factory=dict)


@dataclass
class EnvFailure:
    """An environment call that did not give a usable ``EnvStep``; the trajectory ends (finish ``"env_error"``)."""

    #: One of ``FAILURE_KINDS``: ``"env_exception"`` (raised, or its worker died), ``"env_timeout"`` (ran past
    #: the step timeout, or lived in a worker killed for another trajectory's timeout), ``"env_garbage"``
    #: (returned something that is not a valid ``EnvStep``).
    kind: str
    #: What happened, naming the env spec and the trajectory key.
    message: str

    def __post_init__(self):
        if self.kind not in FAILURE_KINDS:
            raise ValueError(f"EnvFailure.kind={self.kind!r} must be one of {FAILURE_KINDS}")


class Environment:
    """One episode's environment; subclass it and name the subclass in ``multi_turn.env``."""

    def reset(self, sample: Dict[str, Any]) -> None:
        """Start an episode for ``sample``, the prompt row (prompt text, answer, meta, seed: plain data)."""
        raise NotImplementedError(f"{type(self).__name__}.reset")

    def step(self, action: str) -> EnvStep:
        """Answer the model's turn ``action`` (its decoded text)."""
        raise NotImplementedError(f"{type(self).__name__}.step")


def check_env_step(value: Any) -> EnvStep:
    """``value`` as a clean ``EnvStep`` (plain str / float / bool / {str: float}), or ``TypeError`` /
    ``ValueError`` saying what is wrong with it (the pool reports that as ``env_garbage``)."""
    if not isinstance(value, EnvStep):
        raise TypeError(f"step returned {type(value).__name__} {_short(value)}, not an EnvStep")
    if not isinstance(value.observation, str):
        raise TypeError(f"EnvStep.observation is {type(value.observation).__name__} {_short(value.observation)}, "
                        "not str")
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise ValueError(f"EnvStep.reward is {type(reward).__name__} {_short(reward)}, not a finite number")
    if not isinstance(value.done, bool):
        raise TypeError(f"EnvStep.done is {type(value.done).__name__} {_short(value.done)}, not bool")
    if not isinstance(value.info, dict):
        raise TypeError(f"EnvStep.info is {type(value.info).__name__}, not a dict")
    info: Dict[str, float] = {}
    for k, v in value.info.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, numbers.Real) \
                or not math.isfinite(float(v)):
            raise ValueError(f"EnvStep.info[{k!r}] = {_short(v)}: info must map str to finite numbers")
        info[k] = float(v)
    return EnvStep(observation=str(value.observation), reward=float(reward), done=bool(value.done), info=info)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def load_env_class(spec: str) -> type:
    """Import ``spec`` = ``"module.path:Class"`` (or ``"file.py:Class"``) and check it is an ``Environment``
    subclass; ``ValueError`` naming ``multi_turn.env`` otherwise."""
    cls = import_object(spec, ENV_KEY, "module:Class", "Environment classes",
                        lambda v: inspect.isclass(v) and issubclass(v, Environment) and v is not Environment)
    if not inspect.isclass(cls) or not issubclass(cls, Environment):
        mod_name, _, cls_name = spec.rpartition(":")
        what = f"class {cls.__name__}" if inspect.isclass(cls) else type(cls).__name__
        raise ValueError(f"{ENV_KEY}={spec!r}: {mod_name}.{cls_name} is a {what}, not a subclass of "
                         "megatron_rl.envs.base.Environment")
    return cls


def env_import_error(spec: Optional[str]) -> Optional[str]:
    """Why the ``multi_turn.env`` value ``spec`` cannot be loaded here, naming the key; None when it loads (or
    is None: single-turn)."""
    if spec is None:
        return None
    try:
        load_env_class(spec)
    except ValueError as e:
        return str(e)
    return None

"""``DataOptions``: the settings of the ``data:`` section that shape a file task's prompts and rewards
after it is built (chat template arguments, prompt length limit, reward workers and timeout).

``FileTask.configure(options)`` applies them (re-rendering prompts only when they changed); the rollout
phase calls it with ``DataOptions.from_config(cfg.data)`` before each step, so they take effect whichever
way the task was built.

Usage::

    task.configure(DataOptions(chat_template_kwargs={"enable_thinking": False}, max_prompt_length=512))
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional

#: What happens to a prompt longer than ``max_prompt_length``.
OVERLONG_PROMPTS = ("filter", "truncate")


@dataclass(frozen=True)
class DataOptions:
    """Prompt rendering and reward-execution settings of a file task (see ``DataConfig`` for each)."""

    #: Extra keyword arguments of ``tokenizer.apply_chat_template`` (e.g. ``enable_thinking``).
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    #: Longest prompt in tokens after the chat template; None: no limit.
    max_prompt_length: Optional[int] = None
    #: "filter" drops longer prompts; "truncate" keeps their last ``max_prompt_length`` tokens.
    overlong_prompts: str = "filter"
    #: Keyword arguments of the reward function.
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)
    #: Reward worker processes (0: in-process, no timeout).
    reward_workers: int = 2
    #: Per-sample reward timeout in seconds.
    reward_timeout_s: float = 10.0

    def __post_init__(self):
        if self.overlong_prompts not in OVERLONG_PROMPTS:
            raise ValueError(f"data.overlong_prompts={self.overlong_prompts!r} must be one of {OVERLONG_PROMPTS}")
        m = self.max_prompt_length
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"data.max_prompt_length={m!r} must be an int >= 1 or null")
        for key in ("chat_template_kwargs", "reward_kwargs"):
            if not isinstance(getattr(self, key), dict):
                raise ValueError(f"data.{key}={getattr(self, key)!r} must be a mapping")

    @classmethod
    def from_config(cls, data) -> "DataOptions":
        """The options of a ``DataConfig`` (fields it lacks keep their defaults)."""
        kw = {f.name: getattr(data, f.name) for f in fields(cls) if hasattr(data, f.name)}
        for key in ("chat_template_kwargs", "reward_kwargs"):
            if key in kw:
                kw[key] = dict(kw[key] or {})
        return cls(**kw)

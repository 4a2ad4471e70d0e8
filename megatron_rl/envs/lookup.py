"""``LookupEnv``: the environment of the ``lookup`` tool task (``megatron_rl/tasks/tool_lookup.py``).

Named as ``multi_turn.env: megatron_rl.envs.lookup:LookupEnv`` (``env_kwargs``: ``call_format`` compact | hermes,
``call_weight``). Each episode's table is the prompt row's (``extra_info``: the key and the table seed), so a call
with the wrong key gets a plausible but wrong value. The two call formats, and the reward: docs/environments.md.

    env = LookupEnv(call_format="compact", call_weight=0.3)
    env.reset(row)                     # row: {"answer": "529", "extra_info": {"key": "37", "table_seed": 11, ...}}
    env.step("?37")                    # EnvStep(observation=">529", info={"tool_calls": 1.0})
    env.step("529")                    # EnvStep(observation="", reward=1.0, done=True)
"""
from __future__ import annotations

import re
from typing import Any, Dict

from megatron_rl.envs.base import EnvStep
from megatron_rl.envs.tool_env import ToolEnvironment
from megatron_rl.tasks.tool_lookup import (
    ANSWER_MARK,
    CALL_MARK,
    answer_credit,
    key_credit,
    lookup_reward,
    table_value,
)

#: The call formats ``LookupEnv`` reads.
CALL_FORMATS = ("compact", "hermes")
#: How the char tokenizer's EOS decodes (stripped from a turn decoded with special tokens).
EOS_TEXT = "<eos>"
#: The observation of a malformed compact call.
MALFORMED_OBSERVATION = ANSWER_MARK + CALL_MARK


class LookupEnv(ToolEnvironment):
    """One lookup episode: answers calls from the row's table, scores the final answer (module docstring)."""

    def __init__(self, call_format: str = "compact", call_weight: float = 0.3):
        """Args:
            call_format: "compact" (``?KEY`` / ``>VALUE``, the char model) or "hermes" (``<tool_call>`` JSON).
            call_weight: share of the reward paid for calling with the right key, in [0, 1].
        """
        if call_format not in CALL_FORMATS:
            raise ValueError(f"multi_turn.env_kwargs.call_format={call_format!r} must be one of {CALL_FORMATS}")
        if isinstance(call_weight, bool) or not isinstance(call_weight, (int, float)) or not 0 <= call_weight <= 1:
            raise ValueError(f"multi_turn.env_kwargs.call_weight={call_weight!r} must be a number in [0, 1]")
        self.call_format, self.call_weight = call_format, float(call_weight)
        self.tools = {"lookup": self.lookup}

    def reset(self, sample: Dict[str, Any]) -> None:
        """Start the episode of a ``LookupTask`` prompt row."""
        super().reset(sample)
        meta = sample.get("extra_info") or {}
        missing = [k for k in ("key", "table_seed", "min_value_digits", "max_value_digits") if k not in meta]
        if missing or "answer" not in sample:
            raise ValueError(f"LookupEnv: the prompt row lacks {missing or ['answer']} (extra_info keys: "
                             f"{sorted(meta)}); it needs a data.task 'lookup' row")
        self.key, self.value = str(meta["key"]), str(sample["answer"])
        self.table_seed = int(meta["table_seed"])
        self.value_digits = (int(meta["min_value_digits"]), int(meta["max_value_digits"]))
        self.call_credit, self.tool_said = 0.0, None

    def lookup(self, key) -> str:
        """The tool: the value of ``key`` in this episode's table (records the call's key credit)."""
        key = str(key)
        if not key.isascii() or not key.isdigit():
            raise ValueError(f"key {key!r} is not a digit string")
        self.call_credit = max(self.call_credit, key_credit(key, self.key))
        self.tool_said = self.value if key == self.key else table_value(self.table_seed, key, *self.value_digits)
        return self.tool_said

    def step(self, action: str) -> EnvStep:
        """A call -> the tool's answer; anything else -> the scored final answer (``done``)."""
        if self.call_format == "hermes":
            return super().step(action)
        # the driver hands over only turns that ended with the stop token (a turn cut by its token limit ends the
        # trajectory there), decoded up to it; a decoder that keeps special tokens leaves the EOS text
        text = action[:-len(EOS_TEXT)] if action.endswith(EOS_TEXT) else action
        if not text.startswith(CALL_MARK):
            return self._answer(text)
        try:
            value = self.lookup(text[len(CALL_MARK):])
        except ValueError:
            return EnvStep(observation=MALFORMED_OBSERVATION, info={"malformed_tool_call": 1.0})
        return EnvStep(observation=ANSWER_MARK + value, info={"tool_calls": 1.0})

    def score(self, answer_text: str) -> float:
        """Hermes final answer: the last digit run after any ``</think>``, scored as a terminated answer."""
        runs = re.findall(r"\d+", answer_text.rpartition("</think>")[2])
        return self._reward(runs[-1] if runs else "")

    def _reward(self, answer: str) -> float:
        return lookup_reward(self.call_credit, answer_credit(answer, self.value, self.tool_said), self.call_weight)

    def _answer(self, answer: str) -> EnvStep:
        return EnvStep(observation="", reward=self._reward(answer), done=True)

"""The ``lookup`` tool task: the answer is a value only a tool knows, so the model must call it, read it, answer.

A multi-turn task small enough for a from-scratch char model on CPU (``configs/tool_tiny_cpu.yaml``); its
environment is ``megatron_rl/envs/lookup.py:LookupEnv``. The table is random per prompt (a ``table_seed`` per
prompt, values from a fixed hash), so only the call can predict a value. The episode, the compact vs Hermes
syntax, the reward's rungs (and why each exists) and the held-out split: docs/environments.md.

    task = LookupTask(tokenizer, min_key_digits=1, max_key_digits=2, heldout_frac=0.1)
    prompts = task.sample(4, random.Random(0))     # Prompt(text="lookup:37=", answer="529", extra_info={...})
"""
from __future__ import annotations

import itertools
import random
import zlib
from typing import Sequence

from megatron_rl.tasks.base import Prompt, Task, response_text
from megatron_rl.tasks.synthetic import is_heldout, sample_outside_heldout, score_text

#: The task's name (``data.task``) and its prompt word.
LOOKUP_TASK = "lookup"
#: The ``data.task_kwargs`` keys the lookup task accepts.
LOOKUP_TASK_OPTIONS = ("min_key_digits", "max_key_digits", "min_value_digits", "max_value_digits", "heldout_frac",
                       "prompt_format")
#: ``prompt_format`` values: the char model's ``lookup:KEY=``, or a chat-template user turn with the tool schema.
PROMPT_FORMATS = ("char", "chat")
#: The tool's JSON schema for chat templates (``tools=[LOOKUP_TOOL]``).
LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look up the value stored under a key in this conversation's table.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "the key (digits)"}},
                   "required": ["key"]}}}
#: The user turn of a chat prompt.
CHAT_QUESTION = ("What is the value stored under key {key} in the table? The table is different in every "
                 "conversation: look it up with the lookup tool, then reply with the value only.")
#: The compact call marker (``?KEY``) and tool-answer marker (``>VALUE``) of the char tokenizer.
CALL_MARK, ANSWER_MARK = "?", ">"


def table_value(table_seed: int, key: str, min_digits: int, max_digits: int) -> str:
    """The value of ``key`` in the table of ``table_seed``: a digit string of ``min_digits``-``max_digits``
    characters drawn from a ``random.Random`` seeded with ``crc32("<table_seed>:<key>")`` (any digit string is a
    key; the same on every machine)."""
    rng = random.Random(zlib.crc32(f"{int(table_seed)}:{key}".encode()))
    k = rng.randint(min_digits, max_digits)
    return "".join(str(rng.randint(0, 9)) for _ in range(k))


def key_credit(called: str, key: str) -> float:
    """Credit of a well-formed call naming ``called`` when the prompt asked for ``key``: 1.0 if equal, else
    ``(1 + fraction of key positions right) / 2`` (``score_text`` without EOS credit over the longer of the two):
    half for making a call at all, the rest for the right key."""
    if called == key:
        return 1.0
    return 0.5 + 0.5 * score_text(called, True, key, partial_credit=True, eos_credit=False)


def score_answer(text: str, terminated: bool, value: str) -> float:
    """Credit of a final answer ``text`` (``terminated``: it ended with EOS) for the true ``value``: 1.0 exact
    and terminated, else the fraction of correct value characters (``score_text`` without EOS credit)."""
    return score_text(text, terminated, value, partial_credit=True, eos_credit=False)


def answer_credit(text: str, value: str, tool_said: str | None) -> float:
    """Credit of a final answer ``text`` (ended with EOS): ``score_answer`` against ``value``, or half of it
    against ``tool_said`` (the tool's last answer in the episode; None: no call) when that is more."""
    own = score_answer(text, True, value)
    return own if tool_said is None else max(own, 0.5 * score_answer(text, True, tool_said))


def lookup_reward(call_credit: float, answer_credit: float, call_weight: float) -> float:
    """The episode reward: ``call_weight * call_credit + (1 - call_weight) * answer_credit``."""
    return call_weight * call_credit + (1.0 - call_weight) * answer_credit


def _check_int(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"data.task_kwargs.{name}={v!r} must be an int >= 1")
    return v


class LookupTask(Task):
    """Prompts ``lookup:<key>=`` whose answer is the value of ``key`` in a per-prompt random table (module
    docstring); the reward of an episode comes from ``envs/lookup.py:LookupEnv``."""

    name = LOOKUP_TASK

    def __init__(self, tokenizer, min_key_digits: int = 1, max_key_digits: int = 2, min_value_digits: int = 1,
                 max_value_digits: int = 2, heldout_frac: float = 0.0, prompt_format: str = "char"):
        """Args:
            tokenizer: encodes the prompt text (the char tokenizer: ``lookup`` ``?`` ``>`` are tokens of it).
            min_key_digits / max_key_digits: key length range, 1 <= min <= max (keys uniform over lengths, then
                digits; leading zeros allowed).
            min_value_digits / max_value_digits: value length range of the tables, 1 <= min <= max.
            heldout_frac: fraction in [0, 0.5] of keys kept out of ``sample`` (``heldout_prompts``); 0: none.
            prompt_format: "char" (``lookup:KEY=``, the char tokenizer) or "chat" (the tokenizer's chat template
                with ``LOOKUP_TOOL``; module docstring).
        """
        super().__init__(tokenizer)
        for (lo_name, lo), (hi_name, hi) in ((("min_key_digits", min_key_digits), ("max_key_digits", max_key_digits)),
                                             (("min_value_digits", min_value_digits),
                                              ("max_value_digits", max_value_digits))):
            if _check_int(lo_name, lo) > _check_int(hi_name, hi):
                raise ValueError(f"data.task_kwargs.{lo_name}={lo} > {hi_name}={hi}")
        if isinstance(heldout_frac, bool) or not isinstance(heldout_frac, (int, float)) \
                or not 0.0 <= heldout_frac <= 0.5:
            raise ValueError(f"data.task_kwargs.heldout_frac={heldout_frac!r} must be a number in [0, 0.5]")
        self.min_key_digits, self.max_key_digits = min_key_digits, max_key_digits
        self.min_value_digits, self.max_value_digits = min_value_digits, max_value_digits
        self.heldout_frac = float(heldout_frac)
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"data.task_kwargs.prompt_format={prompt_format!r} must be one of {PROMPT_FORMATS}")
        self.prompt_format, self.chat_template_kwargs = prompt_format, {}
        if prompt_format == "chat":
            return
        probe = f"{LOOKUP_TASK}:0123456789={CALL_MARK}{ANSWER_MARK}"
        unk = getattr(tokenizer, "unk_token_id", None)
        if unk is not None and unk in tokenizer.encode(probe, add_special_tokens=False):
            raise ValueError(f"task {LOOKUP_TASK!r}: the tokenizer cannot encode {probe!r} (it produced the unknown "
                             "token); build the model with `python -m megatron_rl.tasks OUT --task lookup`")

    def configure(self, options) -> None:
        """Keep ``data.chat_template_kwargs`` for chat prompts (``DataOptions``)."""
        self.chat_template_kwargs = dict(options.chat_template_kwargs or {})

    def _held(self, key: str) -> bool:
        return bool(self.heldout_frac) and is_heldout(LOOKUP_TASK, key, self.heldout_frac)

    def longest_prompt(self) -> Prompt:
        """The prompt of the longest key (``max_key_digits``)."""
        return self.make_prompt("9" * self.max_key_digits, 0)

    def make_prompt(self, key: str, table_seed: int) -> Prompt:
        """The ``Prompt`` asking for ``key`` in the table of ``table_seed``."""
        text = f"{LOOKUP_TASK}:{key}="
        if self.prompt_format == "chat":
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": CHAT_QUESTION.format(key=key)}], tools=[LOOKUP_TOOL], tokenize=False,
                add_generation_prompt=True, **self.chat_template_kwargs)
        value = table_value(table_seed, key, self.min_value_digits, self.max_value_digits)
        return Prompt(prompt_ids=list(self.tokenizer.encode(text, add_special_tokens=False)), answer=value,
                      text=text, data_source=LOOKUP_TASK,
                      extra_info={"key": key, "table_seed": int(table_seed),
                                  "min_value_digits": self.min_value_digits,
                                  "max_value_digits": self.max_value_digits})

    def sample(self, n: int, rng: random.Random) -> list[Prompt]:
        """``n`` prompts drawn with ``rng`` (a key outside the held-out split and a fresh table seed each)."""
        return sample_outside_heldout(LOOKUP_TASK, self.heldout_frac, n, rng, self._draw_key,
                                      lambda key: self.make_prompt(key, rng.randrange(2 ** 31)), "key range")

    def _draw_key(self, rng: random.Random) -> str:
        """A key of uniform length in [min_key_digits, max_key_digits], then uniform digits."""
        k = rng.randint(self.min_key_digits, self.max_key_digits)
        return "".join(str(rng.randint(0, 9)) for _ in range(k))

    def heldout_prompts(self) -> list[Prompt]:
        """One prompt per held-out key (table seed ``crc32(key)``), in a fixed order; ValueError without a
        split."""
        if self.heldout_frac <= 0:
            raise ValueError(f"task {LOOKUP_TASK!r}: no held-out split (data.task_kwargs.heldout_frac is 0)")
        keys = ("".join(t) for k in range(self.min_key_digits, self.max_key_digits + 1)
                for t in itertools.product("0123456789", repeat=k))
        return [self.make_prompt(key, zlib.crc32(key.encode())) for key in keys if self._held(key)]

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        """Single-turn use (no tool): ``score_answer`` of the response against the value — a guess."""
        text, terminated = response_text(self.tokenizer, response_ids, skip_special_tokens=False)
        return score_answer(text, terminated, str(prompt.answer))

"""Built-in verifiable synthetic tasks on digit strings: ``copy``, ``reverse``, ``sort``, ``add``.

Prompts are ``"<task>:<digits>="`` (``add``: ``"add:<a>+<b>="``); the expected response is the answer string
followed by EOS:

    copy:3141=   -> 3141<eos>        reverse:3141= -> 1413<eos>
    sort:3141=   -> 1134<eos>        add:12+345=   -> 357<eos>

Digit strings have a uniformly drawn length in ``[min_digits, max_digits]`` and uniform digits (leading zeros
allowed); ``add`` operands are integers with that many digits each (no leading zeros).

Reward in [0, 1] (the response is decoded up to its first EOS; other special tokens such as PAD are NOT
skipped — they decode to their text, e.g. "<pad>", and count as wrong characters, so they cannot be used to
pad an answer):
  * 1.0 — exact match: the decoded text equals the answer AND the response ended with EOS;
  * otherwise, with ``partial_credit`` (default True): per-position credit against the target sequence
    ``answer characters + [EOS]``: ``matches / max(len(target), len(got))`` where ``got`` is the decoded
    characters plus ``[EOS]`` if the response ended with one, and ``matches`` counts positions ``i`` with
    ``got[i] == target[i]``. Extra or missing characters dilute the credit; it is 1 only for an exact match
    (e.g. answer "12": "12<eos>" -> 1, "12" (no EOS) -> 2/3, "13<eos>" -> 2/3, "1<eos>" -> 1/3, "" -> 0);
  * otherwise 0.0.

Works with any tokenizer that can encode the prompt text (the char tokenizer of ``char_tokenizer`` is the
tiny one used for learning from scratch).

Usage::

    task = DigitTask("copy", tokenizer, min_digits=1, max_digits=3)
    prompts = task.sample(4, random.Random(0))
    task.reward(prompts[0], response_ids)
"""
from __future__ import annotations

import random
from typing import Sequence

from megatron_rl.tasks.base import Prompt, Task, check_rng, response_text

#: The built-in digit tasks.
DIGIT_TASKS = ("copy", "reverse", "sort", "add")


def digit_answer(task: str, digits: str) -> str:
    """The reference answer of ``task`` for the operand string (``add``: ``"a+b"``)."""
    if task == "copy":
        return digits
    if task == "reverse":
        return digits[::-1]
    if task == "sort":
        return "".join(sorted(digits))
    if task == "add":
        a, b = digits.split("+")
        return str(int(a) + int(b))
    raise ValueError(f"unknown digit task {task!r}; expected one of {DIGIT_TASKS}")


def score_text(text: str, terminated: bool, answer: str, partial_credit: bool) -> float:
    """The digit-task reward of a decoded response ``text`` (see the module docstring)."""
    if terminated and text == answer:
        return 1.0
    if not partial_credit:
        return 0.0
    target = list(answer) + [None]  # None stands for EOS
    got = list(text) + ([None] if terminated else [])
    matches = sum(1 for a, b in zip(got, target) if a == b)
    return matches / max(len(target), len(got))


class DigitTask(Task):
    """One of ``copy`` / ``reverse`` / ``sort`` / ``add`` (see the module docstring)."""

    def __init__(self, task: str, tokenizer, min_digits: int = 1, max_digits: int = 3,
                 partial_credit: bool = True):
        """Args:
            task: "copy", "reverse", "sort" or "add".
            tokenizer: encodes the prompt text and decodes responses (needs an ``eos_token_id``).
            min_digits / max_digits: digit-string length range (``add``: digits per operand), 1 <= min <= max.
            partial_credit: award the fraction of correct positions (EOS included) to non-exact responses.
        """
        if task not in DIGIT_TASKS:
            raise ValueError(f"data.task={task!r} is not a built-in task; expected one of {DIGIT_TASKS}")
        self.name = task
        super().__init__(tokenizer)
        for key, v in (("min_digits", min_digits), ("max_digits", max_digits)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"data.task_kwargs.{key}={v!r} must be an int >= 1")
        if min_digits > max_digits:
            raise ValueError(f"data.task_kwargs.min_digits={min_digits} > max_digits={max_digits}")
        if not isinstance(partial_credit, bool):
            raise ValueError(f"data.task_kwargs.partial_credit={partial_credit!r} must be true or false")
        self.min_digits, self.max_digits, self.partial_credit = min_digits, max_digits, partial_credit
        probe = f"{task}:0123456789+="
        ids = tokenizer.encode(probe, add_special_tokens=False)
        unk = getattr(tokenizer, "unk_token_id", None)
        if unk is not None and unk in ids:
            raise ValueError(f"task {task!r}: the tokenizer cannot encode the prompt alphabet {probe!r} "
                             "(it produced the unknown token)")

    def _operands(self, rng: random.Random) -> str:
        if self.name == "add":
            nums = []
            for _ in range(2):
                k = rng.randint(self.min_digits, self.max_digits)
                lo = 0 if k == 1 else 10 ** (k - 1)
                nums.append(str(rng.randint(lo, 10 ** k - 1)))
            return "+".join(nums)
        k = rng.randint(self.min_digits, self.max_digits)
        return "".join(str(rng.randint(0, 9)) for _ in range(k))

    def make_prompt(self, operands: str) -> Prompt:
        """The ``Prompt`` for an explicit operand string (``"123"``, or ``"12+3"`` for add)."""
        text = f"{self.name}:{operands}="
        return Prompt(prompt_ids=list(self.tokenizer.encode(text, add_special_tokens=False)),
                      answer=digit_answer(self.name, operands), text=text)

    def sample(self, n: int, rng: random.Random) -> list[Prompt]:
        """``n`` random prompts drawn with ``rng``."""
        check_rng(rng, f"task {self.name!r}.sample")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"task {self.name!r}.sample: n={n!r} must be an int >= 1")
        return [self.make_prompt(self._operands(rng)) for _ in range(n)]

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        """Exact match 1.0; else partial credit (see module docstring)."""
        text, terminated = response_text(self.tokenizer, response_ids, skip_special_tokens=False)
        return score_text(text, terminated, str(prompt.answer), self.partial_credit)

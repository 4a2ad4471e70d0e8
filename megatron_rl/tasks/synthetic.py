"""Built-in verifiable synthetic tasks on digit strings: ``copy``, ``reverse``, ``sort``, ``add``.

Prompts are ``"<task>:<digits>="`` (``add``: ``"add:<a>+<b>="``), the expected response the answer then EOS; the
reward is in [0, 1] (exact match with EOS: 1; else partial credit, by position, with or without EOS credit, or
up to the first wrong position). The rule to keep: the curriculum is a function of the step alone
(``begin_step``), so a resumed run draws what the uninterrupted run drew, and the held-out split is a
seed-independent ``crc32`` of the operands, the same on every machine. Rewards, length sampling
(``length_alpha``, ``length_floor``), the held-out split and the curriculum, with examples:
docs/synthetic_tasks.md.

    task = DigitTask("copy", tokenizer, min_digits=1, max_digits=3)
    prompts = task.sample(4, random.Random(0))
    task.reward(prompts[0], response_ids)
"""
from __future__ import annotations

import itertools
import math
import random
import zlib
from typing import Callable, Dict, Sequence

from megatron_rl.tasks.base import Prompt, RewardResult, Task, check_rng, response_text

#: The built-in digit tasks.
DIGIT_TASKS = ("copy", "reverse", "sort", "add")
#: The ``data.task_kwargs`` keys a digit task accepts.
DIGIT_TASK_OPTIONS = ("min_digits", "max_digits", "partial_credit", "eos_credit", "prefix_credit",
                      "length_alpha", "length_floor", "heldout_frac", "curriculum_steps")
#: ``heldout_prompts`` refuses to enumerate more operand strings than this.
MAX_ENUMERATED = 1_000_000


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


def _matches(got: Sequence, target: Sequence, prefix: bool) -> int:
    """Positions where ``got`` agrees with ``target``: all of them, or (``prefix``) those before the first
    disagreement."""
    pairs = [a == b for a, b in zip(got, target)]
    return pairs.index(False) if prefix and False in pairs else sum(pairs)


def score_text(text: str, terminated: bool, answer: str, partial_credit: bool, eos_credit: bool = True,
               prefix_credit: bool = False) -> float:
    """The digit-task reward of a decoded response ``text`` (see the module docstring)."""
    if terminated and text == answer:
        return 1.0
    if not partial_credit:
        return 0.0
    if not eos_credit:
        matches = _matches(text, answer, prefix_credit)
        return matches / (max(len(answer), len(text)) + (0 if terminated else 1))
    target = list(answer) + [None]  # None stands for EOS
    got = list(text) + ([None] if terminated else [])
    return _matches(got, target, prefix_credit) / max(len(target), len(got))


def operand_count(task: str, k: int) -> int:
    """How many operands of ``k`` digits ``task`` has: ``10**k`` digit strings; ``add``: integers without
    leading zeros (10 of 1 digit, ``9 * 10**(k-1)`` of more)."""
    if task == "add" and k > 1:
        return 9 * 10 ** (k - 1)
    return 10 ** k


def is_heldout(task: str, operands: str, heldout_frac: float) -> bool:
    """Whether ``operands`` of ``task`` belongs to the held-out split of fraction ``heldout_frac`` (module
    docstring): a fixed hash of the prompt text, the same on every machine and for every seed."""
    return zlib.crc32(f"{task}:{operands}".encode()) % 10_000 < round(heldout_frac * 10_000)


def sample_outside_heldout(task: str, heldout_frac: float, n: int, rng: random.Random,
                           draw: Callable[[random.Random], str], make: Callable[[str], Prompt],
                           widen: str) -> list[Prompt]:
    """``n`` prompts of ``task`` (its ``sample``): ``make(operands)`` for each ``operands = draw(rng)`` outside
    the held-out split of fraction ``heldout_frac``. ValueError for a bad ``n`` or after 1000 held-out draws in a
    row (the message says to widen ``widen``)."""
    check_rng(rng, f"task {task!r}.sample")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"task {task!r}.sample: n={n!r} must be an int >= 1")
    out, misses = [], 0
    while len(out) < n:
        operands = draw(rng)
        if heldout_frac and is_heldout(task, operands, heldout_frac):
            if (misses := misses + 1) >= 1000:  # e.g. 1-digit strings with a large fraction: all held out
                raise ValueError(f"task {task!r}: 1000 draws in a row were held out; lower "
                                 f"data.task_kwargs.heldout_frac={heldout_frac} or widen the {widen}")
            continue
        misses = 0
        out.append(make(operands))
    return out


class DigitTask(Task):
    """One of ``copy`` / ``reverse`` / ``sort`` / ``add`` (see the module docstring)."""

    def __init__(self, task: str, tokenizer, min_digits: int = 1, max_digits: int = 3,
                 partial_credit: bool = True, heldout_frac: float = 0.0, curriculum_steps: int = 0,
                 eos_credit: bool = True, prefix_credit: bool = False, length_alpha: float = 0.0,
                 length_floor: float = 0.0):
        """Args:
            task: "copy", "reverse", "sort" or "add".
            tokenizer: encodes the prompt text and decodes responses (needs an ``eos_token_id``).
            min_digits / max_digits: digit-string length range (``add``: digits per operand), 1 <= min <= max.
            partial_credit: award the fraction of correct positions (EOS included) to non-exact responses.
            eos_credit: with partial credit, count a correctly placed EOS as a matching position (False: only
                answer characters earn credit, see the module docstring).
            prefix_credit: with partial credit, count only the positions before the first wrong one (module
                docstring); False: every matching position counts.
            length_alpha: in [0, 1]: draw an operand length with probability proportional to its number of
                strings to this power (0: every length equally likely, 1: every string; module docstring).
            length_floor: in [0, 1]: the share of draws whose length is uniform over the lengths (the rest as
                ``length_alpha`` says), so each of the L lengths is drawn at least ``length_floor / L`` of the time.
            heldout_frac: fraction in [0, 0.5] of operand strings kept out of ``sample`` for evaluation
                (``heldout_prompts``); 0 disables the split.
            curriculum_steps: steps over which the longest drawn operand grows from min_digits to max_digits
                (module docstring); 0: every length from the first step.
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
        for key, v in (("partial_credit", partial_credit), ("eos_credit", eos_credit),
                       ("prefix_credit", prefix_credit)):
            if not isinstance(v, bool):
                raise ValueError(f"data.task_kwargs.{key}={v!r} must be true or false")
        if isinstance(length_alpha, bool) or not isinstance(length_alpha, (int, float)) \
                or not 0.0 <= length_alpha <= 1.0:
            raise ValueError(f"data.task_kwargs.length_alpha={length_alpha!r} must be a number in [0, 1]")
        if isinstance(length_floor, bool) or not isinstance(length_floor, (int, float)) \
                or not 0.0 <= length_floor <= 1.0:
            raise ValueError(f"data.task_kwargs.length_floor={length_floor!r} must be a number in [0, 1]")
        self.eos_credit, self.prefix_credit, self.length_alpha = eos_credit, prefix_credit, float(length_alpha)
        self.length_floor = float(length_floor)
        if isinstance(heldout_frac, bool) or not isinstance(heldout_frac, (int, float)) \
                or not 0.0 <= heldout_frac <= 0.5:
            raise ValueError(f"data.task_kwargs.heldout_frac={heldout_frac!r} must be a number in [0, 0.5]")
        self.min_digits, self.max_digits, self.partial_credit = min_digits, max_digits, partial_credit
        self.heldout_frac = float(heldout_frac)
        if not isinstance(curriculum_steps, int) or isinstance(curriculum_steps, bool) or curriculum_steps < 0:
            raise ValueError(f"data.task_kwargs.curriculum_steps={curriculum_steps!r} must be an int >= 0")
        self.curriculum_steps = curriculum_steps
        self._step = None  # set by begin_step; None: no curriculum cap (e.g. sampling outside the loop)
        self._length_rewards: Dict[int, float] = {}  # mean reward per operand length of the last scored batch
        # the encoding of each prompt text and the reward of each (answer, response ids) seen -- pure functions
        # of them: a step draws the same strings and responses again and again (a prompt's n samples often agree)
        self._prompt_ids: Dict[str, tuple] = {}
        self._rewards: Dict[tuple, float] = {}
        probe = f"{task}:0123456789+="
        ids = tokenizer.encode(probe, add_special_tokens=False)
        unk = getattr(tokenizer, "unk_token_id", None)
        if unk is not None and unk in ids:
            raise ValueError(f"task {task!r}: the tokenizer cannot encode the prompt alphabet {probe!r} "
                             "(it produced the unknown token)")

    def begin_step(self, step: int) -> None:
        """The loop is about to sample the prompts of 0-based training step ``step`` (sets the curriculum)."""
        self._step = int(step)

    def longest_operand(self) -> int:
        """The longest operand length ``sample`` draws now (``max_digits`` unless the curriculum caps it)."""
        if not self.curriculum_steps or self._step is None:
            return self.max_digits
        span = self.max_digits - self.min_digits + 1
        return min(self.max_digits, self.min_digits + span * max(0, self._step) // self.curriculum_steps)

    def _length(self, rng: random.Random, longest: int) -> int:
        """One operand length in ``[min_digits, longest]``, drawn as ``length_alpha`` and ``length_floor``
        say."""
        if self.length_alpha == 0.0:  # the original draw (same random stream as before the options existed)
            return rng.randint(self.min_digits, longest)
        lengths = range(self.min_digits, longest + 1)
        # count ** alpha in log space, relative to the largest: no float overflow for long operands
        logs = [self.length_alpha * math.log(operand_count(self.name, k)) for k in lengths]
        top = max(logs)
        weights = [math.exp(v - top) for v in logs]
        if self.length_floor:  # a share length_floor of the mass spread evenly over the lengths
            total = sum(weights)
            weights = [self.length_floor / len(weights) + (1 - self.length_floor) * w / total for w in weights]
        return rng.choices(lengths, weights=weights)[0]

    def _operands(self, rng: random.Random) -> str:
        longest = self.longest_operand()
        if self.name == "add":
            nums = []
            for _ in range(2):
                k = self._length(rng, longest)
                lo = 0 if k == 1 else 10 ** (k - 1)
                nums.append(str(rng.randint(lo, 10 ** k - 1)))
            return "+".join(nums)
        k = self._length(rng, longest)
        return "".join(str(rng.randint(0, 9)) for _ in range(k))

    def _all_operands(self):
        """Every operand string with lengths in ``[min_digits, max_digits]`` (``add``: both operands)."""
        lengths = range(self.min_digits, self.max_digits + 1)
        if self.name != "add":
            for k in lengths:
                for t in itertools.product("0123456789", repeat=k):
                    yield "".join(t)
            return
        nums = [str(v) for k in lengths for v in range(0 if k == 1 else 10 ** (k - 1), 10 ** k)]
        for a, b in itertools.product(nums, nums):
            yield f"{a}+{b}"

    def every_prompt(self) -> list[Prompt]:
        """Every prompt with operands in ``[min_digits, max_digits]`` (held-out and trained-on alike), in a
        fixed order; ValueError when the operand space is larger than ``MAX_ENUMERATED``."""
        per_len = [10 ** k for k in range(self.min_digits, self.max_digits + 1)]
        size = sum(per_len) ** 2 if self.name == "add" else sum(per_len)
        if size > MAX_ENUMERATED:
            raise ValueError(f"task {self.name!r}: {size} operand strings for digits {self.min_digits}-"
                             f"{self.max_digits}: too many to enumerate (> {MAX_ENUMERATED})")
        return [self.make_prompt(o) for o in self._all_operands()]

    def is_heldout(self, prompt: Prompt) -> bool:
        """Whether ``prompt`` (one of this task's) is in the held-out split (False without a split)."""
        operands = str(prompt.text).split(":", 1)[1].rstrip("=")
        return bool(self.heldout_frac) and is_heldout(self.name, operands, self.heldout_frac)

    @staticmethod
    def operand_digits(prompt: Prompt) -> int:
        """The length in digits of ``prompt``'s operand (``add``: of its longer operand)."""
        return max(len(o) for o in str(prompt.text).split(":", 1)[1].rstrip("=").split("+"))

    def heldout_prompts(self) -> list[Prompt]:
        """Every held-out prompt (module docstring), in a fixed order; ValueError without a split or when
        the operand space is larger than ``MAX_ENUMERATED``."""
        if self.heldout_frac <= 0:
            raise ValueError(f"task {self.name!r}: no held-out split (data.task_kwargs.heldout_frac is 0)")
        return [p for p in self.every_prompt() if self.is_heldout(p)]

    def longest_prompt(self) -> Prompt:
        """The prompt of the longest operands (``max_digits``; both operands for add)."""
        longest = "9" * self.max_digits
        return self.make_prompt(f"{longest}+{longest}" if self.name == "add" else longest)

    def make_prompt(self, operands: str) -> Prompt:
        """The ``Prompt`` for an explicit operand string (``"123"``, or ``"12+3"`` for add)."""
        text = f"{self.name}:{operands}="
        ids = self._prompt_ids.get(text)
        if ids is None:
            ids = _remember(self._prompt_ids, text, tuple(self.tokenizer.encode(text, add_special_tokens=False)))
        return Prompt(prompt_ids=list(ids), answer=digit_answer(self.name, operands), text=text)

    def sample(self, n: int, rng: random.Random) -> list[Prompt]:
        """``n`` random prompts drawn with ``rng``."""
        return sample_outside_heldout(self.name, self.heldout_frac, n, rng, self._operands, self.make_prompt,
                                      "digit range")

    def score(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> RewardResult:
        """``Task.score``; also keeps the batch's mean reward per operand length for ``stats``."""
        result = super().score(prompts, responses)
        by_len: Dict[int, list] = {}
        digits: Dict[str, int] = {}
        for p, r in zip(prompts, result.rewards):
            k = digits.get(p.text)
            if k is None:
                k = digits[p.text] = self.operand_digits(p)
            by_len.setdefault(k, []).append(r)
        self._length_rewards = {k: sum(v) / len(v) for k, v in by_len.items()}
        return result

    def stats(self) -> Dict[str, float]:
        """``reward/digits_<k>``: the mean reward of the last scored batch's samples whose operand has ``k``
        digits (only the lengths it had)."""
        return {f"reward/digits_{k}": v for k, v in sorted(self._length_rewards.items())}

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        """Exact match 1.0; else partial credit (see module docstring)."""
        answer = str(prompt.answer)
        key = (answer, *(int(t) for t in response_ids))
        got = self._rewards.get(key)
        if got is None:
            text, terminated = response_text(self.tokenizer, key[1:], skip_special_tokens=False)
            got = _remember(self._rewards, key, score_text(text, terminated, answer, self.partial_credit,
                                                           self.eos_credit, self.prefix_credit))
        return got


#: Entries a task keeps of each tokenizer memo (``DigitTask``); a full memo is emptied and refilled.
MEMO_ENTRIES = 1 << 16


def _remember(memo: Dict, key, value):
    """``memo[key] = value`` (``memo`` emptied first when it holds ``MEMO_ENTRIES``); returns ``value``."""
    if len(memo) >= MEMO_ENTRIES:
        memo.clear()
    memo[key] = value
    return value

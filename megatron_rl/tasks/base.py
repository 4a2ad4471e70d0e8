"""The ``Task`` interface: a source of prompts plus a verifier that scores responses.

A task owns a tokenizer (``transformers.PreTrainedTokenizerFast``); ``sample(n, rng)`` draws ``n`` prompts
(``Prompt(prompt_ids, answer, text)``) with a ``random.Random``, and ``reward(prompt, response_ids)`` scores a
generated response (token ids as the engine returned them, possibly ending in EOS) as a float.
``score(prompts, responses)`` scores a step's batch and never raises for one sample's failure (reward
0.0, counted in the ``RewardResult``); ``configure(options)`` applies ``DataOptions`` and ``stats()``
reports dataset counts (malformed rows, filtered prompts) — no-ops for the built-in tasks.
``finite_prompts()`` is the finite list a data file's task is drawn from (without replacement, epoch by epoch:
``trainer.prompt_draw``), None for a task that generates its prompts.

Usage::

    prompts = task.sample(8, random.Random(0))
    r = task.reward(prompts[0], rollout.response_ids)
    result = task.score(prompts, [r.response_ids for r in rollouts])   # .rewards, .failed, .timed_out
"""
from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

from megatron_rl.tasks.reward_pool import RewardResult


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task."""

    #: The token ids sent to the rollout engine.
    prompt_ids: list[int]
    #: The reference answer passed to the verifier (a string for the built-in tasks; any JSON value for files).
    answer: Any
    #: The prompt as text (what a ``module:function`` reward receives as ``prompt_text``).
    text: str
    #: verl's ``data_source`` of the row (selects the reward by default), or None.
    data_source: Optional[str] = None
    #: verl's ``extra_info`` of the row, or None.
    extra_info: Any = None
    #: Where the prompt comes from (``"data.path='train.jsonl' row 3 (line 4)"``: reward errors name it), or None;
    #: not part of the prompt's equality (the same prompt from a JSONL or a Parquet file is the same prompt).
    row: Optional[str] = field(default=None, compare=False)
    #: A chat row's messages before the policy's template (what a reward model renders with its own), or None.
    messages: Optional[list] = field(default=None, compare=False)


def split_at_eos(response_ids: Sequence[int], eos_token_ids: Sequence[int]) -> tuple[list[int], bool]:
    """``(ids before the first EOS, whether an EOS was found)`` for a response's token ids."""
    eos = set(int(e) for e in eos_token_ids)
    out = []
    for t in response_ids:
        if int(t) in eos:
            return out, True
        out.append(int(t))
    return out, False


def response_text(tokenizer, response_ids: Sequence[int], skip_special_tokens: bool = True) -> tuple[str, bool]:
    """Decode a response up to (excluding) its first EOS; also say whether it ended with EOS. Other special
    tokens (PAD, ...) are dropped when ``skip_special_tokens``, else decoded as their text."""
    eos = tokenizer.eos_token_id
    ids, terminated = split_at_eos(response_ids, [] if eos is None else [eos])
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), terminated


def check_rng(rng, where: str) -> random.Random:
    """``rng`` must be a ``random.Random`` (the loop keeps its state for exact resume)."""
    if not isinstance(rng, random.Random):
        raise TypeError(f"{where}: rng must be a random.Random, got {type(rng).__name__}")
    return rng


class Task(abc.ABC):
    """Prompts plus a verifiable reward."""

    #: Short name (e.g. "copy", or the dataset file name).
    name: str = "task"

    def __init__(self, tokenizer):
        """``tokenizer``: a ``PreTrainedTokenizerFast`` with an ``eos_token_id``."""
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError(f"task {self.name!r}: the tokenizer has no eos_token_id")
        self.tokenizer = tokenizer

    @property
    def eos_token_id(self) -> int:
        """The EOS id responses should end with."""
        return int(self.tokenizer.eos_token_id)

    def longest_prompt(self) -> Optional[Prompt]:
        """The longest prompt this task can draw (what ``check`` plans memory with); None: not known up front."""
        return None

    @abc.abstractmethod
    def sample(self, n: int, rng: random.Random) -> list[Prompt]:
        """Draw ``n`` prompts using ``rng`` (deterministic given its state)."""

    @abc.abstractmethod
    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        """Score one response (token ids, possibly ending in EOS) to ``prompt``."""

    def rewards(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> list[float]:
        """``reward`` for each (prompt, response) pair."""
        if len(prompts) != len(responses):
            raise ValueError(f"task {self.name!r}: {len(prompts)} prompts but {len(responses)} responses")
        return [float(self.reward(p, r)) for p, r in zip(prompts, responses)]

    def score(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> RewardResult:
        """``reward`` for each pair in this process; a sample whose reward raises gets 0.0 and is counted
        as failed (file tasks override this with parallel workers and a timeout)."""
        if len(prompts) != len(responses):
            raise ValueError(f"task {self.name!r}: {len(prompts)} prompts but {len(responses)} responses")
        result = RewardResult(rewards=[0.0] * len(prompts))
        for i, (p, r) in enumerate(zip(prompts, responses)):
            try:
                result.rewards[i] = float(self.reward(p, r))
            except Exception as e:  # noqa: BLE001 - counted, never crashes the step
                result.failed += 1
                if len(result.errors) < 5:
                    result.errors.append(f"sample {i}: {type(e).__name__}: {e}")
        return result

    def finite_prompts(self) -> Optional[Sequence[Prompt]]:
        """The finite set of prompts training draws from without replacement, epoch by epoch
        (``trainer.prompt_draw``: file tasks), or None: the task generates its prompts (``sample``; the built-in
        tasks)."""
        return None

    def begin_step(self, step: int) -> None:
        """Called by the loop before it samples the prompts of 0-based training step ``step`` (a task with a
        curriculum reads it); a no-op by default."""

    def configure(self, options) -> None:
        """Apply ``DataOptions`` (file tasks); the built-in tasks have none."""

    def stats(self) -> Dict[str, float]:
        """Dataset counts for the step metrics (file tasks: rows, malformed rows, filtered prompts)."""
        return {}


class WrappedTask(Task):
    """A task that keeps ``inner``'s prompts, curriculum, options, statistics and attributes and changes only how
    responses are scored (the judge, the reward model)."""

    def __init__(self, inner: Task):
        self.name = inner.name
        super().__init__(inner.tokenizer)
        self.inner = inner

    def __getattr__(self, name):
        # the inner task's own attributes (DigitTask.kind, FileTask.options, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def longest_prompt(self):
        return self.inner.longest_prompt()

    def sample(self, n, rng):
        return self.inner.sample(n, rng)

    def finite_prompts(self):
        return self.inner.finite_prompts()

    def begin_step(self, step: int) -> None:
        self.inner.begin_step(step)

    def configure(self, options) -> None:
        self.inner.configure(options)

    def stats(self) -> Dict[str, float]:
        return self.inner.stats()

    def close(self) -> None:
        """The inner task's reward workers, where it has them."""
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

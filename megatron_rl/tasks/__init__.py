"""Tasks: prompts plus verifiable rewards.

* ``base``: ``Task`` (``sample(n, rng)``, ``reward(prompt, response_ids)``) and ``Prompt``.
* ``synthetic``: built-in digit tasks ``copy`` / ``reverse`` / ``sort`` / ``add`` (rewards in [0, 1]).
* ``tool_lookup``: the multi-turn ``lookup`` tool task (its environment: ``megatron_rl.envs.lookup:LookupEnv``).
* ``char_tokenizer``: the tiny char-level tokenizer and ``build_task_model`` (tiny Qwen2 + tokenizer).
* ``datasets``: ``FileTask`` over JSONL / Parquet prompt files (verl's RL format or prompt/answer rows);
  ``rows`` parses and checks rows, ``render`` applies the chat template and the prompt length limit.
* ``rewards``: ``math_reward`` (math-verify) and verl's ``default_compute_score`` dispatch on data_source.
* ``verl_scores``: verl's gsm8k / MATH / math_dapo scorers, ported (the dispatch's rules for verl's sources).
* ``reward_fn``: reward specs (``"math"``, ``"exact"``, ``"module:function"``), ``compute_reward`` and
  ``compute_reward_value`` (a dict reward's ``score`` and its other numeric keys: ``RewardValue``).
* ``reward_pool``: rewards in worker processes with a per-sample timeout.
* ``rm_task`` / ``rm_backends`` / ``rm_render`` / ``rm_check``: a scalar reward model (``reward.model``): the task
  wrapper, where it runs (CPU / SGLang ``/classify``), what it reads (its own chat template), ``check``'s probe.
* ``options``: ``DataOptions`` (chat template arguments, prompt length, reward workers).
* ``chat_model``: a tiny chat model + tokenizer with a chat template (the math CPU config's model).
* ``custom``: a user's task by import path (``data.task: "module:factory"``; docs/extending.md).

``build_task(task, tokenizer, ...)`` maps the ``data:`` config section onto one of these::

    tok = build_char_tokenizer()
    task = build_task("copy", tok, task_kwargs={"min_digits": 1, "max_digits": 3})
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from megatron_rl.tasks.base import Prompt, Task, response_text, split_at_eos
from megatron_rl.tasks.char_tokenizer import (
    build_char_tokenizer,
    build_task_model,
    ensure_task_model,
    task_model_config,
)
from megatron_rl.tasks.custom import build_custom_task, is_custom_task, task_import_error
from megatron_rl.tasks.datasets import FileTask, load_records
from megatron_rl.tasks.options import DataOptions
from megatron_rl.tasks.reward_fn import (
    RewardFunction, RewardValue, check_reward_spec, compute_reward, compute_reward_value, load_reward_fn,
)
from megatron_rl.tasks.reward_pool import RewardJob, RewardPool, RewardResult
from megatron_rl.tasks.rewards import default_compute_score, extract_answer, math_reward
from megatron_rl.tasks.synthetic import DIGIT_TASK_OPTIONS, DIGIT_TASKS, DigitTask
from megatron_rl.tasks.tool_lookup import LOOKUP_TASK, LOOKUP_TASK_OPTIONS, LookupTask


class RewardOverrideTask(Task):
    """A task whose prompts come from ``inner`` and whose reward is ``reward_fn`` ("math", "exact" or a
    ``module:function`` reward) of ``(prompt.text, decoded response, prompt.answer)``."""

    def __init__(self, inner: Task, reward_fn: RewardFunction | str):
        self.name = inner.name
        super().__init__(inner.tokenizer)
        self.inner, self.reward_fn = inner, reward_fn

    def begin_step(self, step):
        """The inner task's curriculum."""
        self.inner.begin_step(step)

    def finite_prompts(self):
        """The inner task's."""
        return self.inner.finite_prompts()

    def sample(self, n, rng):
        """The inner task's prompts."""
        return self.inner.sample(n, rng)

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        """The override reward of the decoded response."""
        text, _ = response_text(self.tokenizer, response_ids)
        if isinstance(self.reward_fn, str):
            return compute_reward(self.reward_fn, prompt.text, text, prompt.answer)
        return self.reward_fn(prompt.text, text, prompt.answer)


def build_task(task: str, tokenizer, path: str | None = None, prompt_key: str = "prompt",
               answer_key: str = "answer", reward_fn: str | None = None,
               task_kwargs: Mapping[str, Any] | None = None, options: DataOptions | None = None) -> Task:
    """The ``Task`` for the ``data:`` config section: a built-in digit task (``task`` in ``DIGIT_TASKS``,
    options in ``task_kwargs``), the ``lookup`` tool task (``LOOKUP_TASK``) or ``task="file"`` reading ``path`` (with ``options``, see
    ``DataOptions``). ``reward_fn`` ("math", "exact" or "module:function") replaces the default reward.
    Errors name the config key."""
    task_kwargs = dict(task_kwargs or {})
    check_reward_spec(reward_fn)
    if task == "file":
        if path is None:
            raise ValueError("data.task='file' needs data.path (a .jsonl or .parquet file)")
        if task_kwargs:
            raise ValueError(f"data.task_kwargs={task_kwargs!r} is not used by data.task='file'")
        return FileTask(path, tokenizer, prompt_key=prompt_key, answer_key=answer_key, reward_fn=reward_fn,
                        options=options)
    fn = None
    if reward_fn is not None:
        fn = reward_fn if ":" not in reward_fn else load_reward_fn(reward_fn)
    if is_custom_task(task):
        inner = build_custom_task(task, tokenizer, task_kwargs)
        return RewardOverrideTask(inner, fn) if fn is not None else inner
    if task in DIGIT_TASKS:
        allowed = set(DIGIT_TASK_OPTIONS)
        unknown = sorted(set(task_kwargs) - allowed)
        if unknown:
            raise ValueError(f"data.task_kwargs has unknown key(s) {unknown} for task {task!r}; "
                             f"allowed: {sorted(allowed)}")
        inner = DigitTask(task, tokenizer, **task_kwargs)
        return RewardOverrideTask(inner, fn) if fn is not None else inner
    if task == LOOKUP_TASK:
        unknown = sorted(set(task_kwargs) - set(LOOKUP_TASK_OPTIONS))
        if unknown:
            raise ValueError(f"data.task_kwargs has unknown key(s) {unknown} for task {task!r}; "
                             f"allowed: {sorted(LOOKUP_TASK_OPTIONS)}")
        if fn is not None:
            raise ValueError(f"data.reward_fn={reward_fn!r} is not used by data.task={task!r}: its environment "
                             "(multi_turn.env) scores the episode")
        return LookupTask(tokenizer, **task_kwargs)
    raise ValueError(f"data.task={task!r} must be one of {DIGIT_TASKS + (LOOKUP_TASK, 'file')} or 'module:factory' "
                     f"(your own task: docs/extending.md)")


__all__ = [
    "DIGIT_TASKS", "DataOptions", "DigitTask", "FileTask", "LOOKUP_TASK", "LookupTask", "Prompt", "RewardFunction",
    "RewardJob", "RewardValue", "compute_reward_value",
    "RewardOverrideTask", "RewardPool", "RewardResult", "Task", "build_char_tokenizer", "build_task",
    "build_task_model", "compute_reward", "default_compute_score", "ensure_task_model", "extract_answer",
    "load_records", "load_reward_fn", "math_reward", "response_text", "split_at_eos", "task_model_config",
    "build_custom_task", "is_custom_task", "task_import_error",
]

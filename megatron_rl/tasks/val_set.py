"""The validation set: prompts evaluated during training and never trained on, and the check of its files.

    problems = val_file_problems(cfg.data)               # check / the trainer's start: "data.val_files: ..." per bad file
    groups = build_val_set(task, cfg.data, tokenizer)    # rank 0: [ValGroup], data.val_max_samples prompts at most

Two sources, both evaluated when both are given, in this order:

* ``data.val_heldout``: the built-in task's held-out split (``data.task_kwargs.heldout_frac``): every prompt its
  ``sample`` never draws (``heldout_prompts()``), scored by the training task's reward (``data.reward_fn`` included);
  their data source is the task's name.
* ``data.val_files``: JSONL / Parquet files read exactly as ``data.path`` is (``datasets.FileTask``: verl's RL
  format or prompt / answer rows, the chat template, ``data.max_prompt_length``, the reward -- ``data.reward_fn``,
  else verl's dispatch on ``data_source``, else exact match); a row's data source is its ``data_source``, else the
  file's name. Errors name ``data.val_files`` and the file.

``data.val_max_samples`` (-1: all) keeps the first prompts in that order: the bound on a validation's work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron_rl.tasks.base import Prompt, Task
from megatron_rl.tasks.datasets import FileTask, scorable_rows
from megatron_rl.tasks.options import DataOptions

__all__ = ["ValGroup", "val_file_problems", "build_val_set", "VAL_FILES_KEY", "VAL_HELDOUT_KEY"]

VAL_FILES_KEY = "data.val_files"
VAL_HELDOUT_KEY = "data.val_heldout"


@dataclass
class ValGroup:
    """Validation prompts scored by one task."""

    task: Task
    """Scores the responses (``task.score``) and gives the stop token (its tokenizer's EOS)."""
    prompts: List[Prompt]
    """The prompts, in a fixed order."""
    sources: List[str]
    """Each prompt's data source (the ``val/<source>/*`` metrics)."""
    owned: bool = False
    """The task was built for validation (its reward workers are closed with the group)."""

    def close(self) -> None:
        """Stop the reward workers of a task built for validation."""
        if self.owned and hasattr(self.task, "close"):
            self.task.close()


def val_file_problems(data) -> List[str]:
    """Each ``data.val_files`` file that cannot become validation prompts, read as the trainer reads it (no
    tokenizer needed; a ``data_source`` with no reward when ``data.reward_fn`` is unset included), as one line
    naming the key and the file; [] when all load."""
    out = []
    for path in data.val_paths:
        try:
            scorable_rows(path, data, key=VAL_FILES_KEY)
        except ValueError as exc:
            out.append(f"{VAL_FILES_KEY}: {exc}")
    return out


def build_val_set(task: Task, data, tokenizer) -> List[ValGroup]:
    """Rank 0: the validation set of the ``data:`` section (module docstring). ``task``: the training task (its
    held-out split). Raises ``ValueError`` naming ``data.val_heldout`` / ``data.val_files``."""
    budget: Optional[int] = None if data.val_max_samples == -1 else data.val_max_samples
    groups: List[ValGroup] = []

    def take(prompts: List[Prompt]) -> List[Prompt]:
        nonlocal budget
        if budget is None:
            return prompts
        kept = prompts[:budget]
        budget -= len(kept)
        return kept

    try:
        if data.val_heldout:
            inner = getattr(task, "inner", task)  # a reward override keeps its inner task's prompts
            try:
                prompts = inner.heldout_prompts()
            except (AttributeError, ValueError) as exc:
                raise ValueError(f"{VAL_HELDOUT_KEY}: task {task.name!r} gives no held-out prompts: {exc}") from exc
            prompts = take(prompts)
            if prompts:
                groups.append(ValGroup(task, prompts, [task.name] * len(prompts)))
        for path in data.val_paths:
            if budget == 0:
                break
            ft = FileTask(path, tokenizer, prompt_key=data.prompt_key, answer_key=data.answer_key,
                          reward_fn=data.reward_fn, options=DataOptions.from_config(data), key=VAL_FILES_KEY)
            prompts = take(ft.prompts)
            groups.append(ValGroup(ft, prompts, [p.data_source or ft.name for p in prompts], owned=True))
    except BaseException:
        for g in groups:
            g.close()
        raise
    if not any(g.prompts for g in groups):
        raise ValueError(f"{VAL_FILES_KEY} / {VAL_HELDOUT_KEY}: the validation set has no prompt")
    return groups

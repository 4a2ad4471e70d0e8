"""Your own task by import path: ``data.task: "my_pkg.tasks:make_task"`` (or ``"path/to/file.py:make_task"``).

The object the path names is called as ``factory(tokenizer, **data.task_kwargs)`` and must return a ``Task``
(``tasks/base.py``: ``sample(n, rng)`` and ``reward(prompt, response_ids)``; a ``Task`` subclass itself is such a
factory). The same registry by import path as ``data.reward_fn`` and ``multi_turn.env`` have: nothing to edit in the
project (docs/extending.md). Its one rule: a factory that does not import, or does not take ``data.task_kwargs``,
is an error naming the key before any process group exists (``megatron-rl check`` and the launcher's check); the
task itself is built on rank 0 with the model's tokenizer.
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping

from megatron_rl.imports import import_object
from megatron_rl.tasks.base import Task

#: What a custom ``data.task`` value looks like.
SHAPE = "module:factory"


def is_custom_task(name: Any) -> bool:
    """Whether ``data.task`` names a task by import path (it holds a ':')."""
    return isinstance(name, str) and ":" in name


def load_task_factory(spec: str):
    """The callable ``spec`` names (ValueError naming ``data.task`` when it does not import or is not callable)."""
    factory = import_object(spec, "data.task", SHAPE, "callables", callable)
    if not callable(factory):
        raise ValueError(f"data.task={spec!r}: {spec.rpartition(':')[2]} is a {type(factory).__name__}, not callable")
    return factory


def build_custom_task(spec: str, tokenizer, task_kwargs: Mapping[str, Any]) -> Task:
    """``factory(tokenizer, **task_kwargs)``, checked to be a ``Task``."""
    factory = load_task_factory(spec)
    try:
        task = factory(tokenizer, **dict(task_kwargs))
    except Exception as e:  # noqa: BLE001 - any failure of user code becomes the config error naming the key
        raise ValueError(f"data.task={spec!r}: {spec.rpartition(':')[2]}(tokenizer, **data.task_kwargs) failed: "
                         f"{type(e).__name__}: {e}") from e
    if not isinstance(task, Task):
        raise ValueError(f"data.task={spec!r}: {spec.rpartition(':')[2]} returned a {type(task).__name__}, not a "
                         f"megatron_rl.tasks.Task")
    return task


def task_import_error(spec: Any, task_kwargs: Mapping[str, Any] | None = None) -> str | None:
    """Why a custom ``data.task`` cannot be loaded here (import, attribute, or ``data.task_kwargs`` its factory does
    not take), naming the key; None when it loads or is not a custom task. The task itself is built on rank 0 with
    the model's tokenizer; what its constructor does beyond its arguments shows there."""
    if not is_custom_task(spec):
        return None
    try:
        factory = load_task_factory(spec)
    except ValueError as e:
        return str(e)
    try:
        inspect.signature(factory).bind(None, **dict(task_kwargs or {}))
    except TypeError as e:
        return (f"data.task_kwargs: {dict(task_kwargs or {})!r} do not fit {spec.rpartition(':')[2]}(tokenizer, "
                f"**data.task_kwargs) of data.task={spec!r}: {e}")
    except ValueError:   # no signature (a builtin): nothing to check up front
        pass
    return None

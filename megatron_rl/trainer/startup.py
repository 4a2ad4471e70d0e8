"""What the trainer checks at start: the data file before any model is built (the plan it runs with is printed by
``job.build_job``: ``JobPlan.describe``).

    check_data(cfg)                         # every rank, first thing in ``train``: ValueError naming data.path /
                                            # data.val_files
"""
from __future__ import annotations

from megatron_rl.tasks.datasets import scorable_rows
from megatron_rl.tasks.val_set import val_file_problems


def check_data(cfg) -> None:
    """Raise ``ValueError`` (naming ``data.path`` / ``data.val_files``, the keys and the first bad rows) when a
    ``data.task: file`` job's file, or a validation file, has no row that can become a prompt -- seconds after
    start, not after the model is built."""
    d = cfg.data
    if d.task == "file":
        scorable_rows(d.path, d)
    problems = val_file_problems(d)
    if problems:
        raise ValueError("; ".join(problems))

"""What the trainer checks and says once at start: the data file before any model is built, then the layout
the job actually runs with (rank 0, one line).

    check_data(cfg)                         # every rank, first thing in ``train``: ValueError naming data.path /
                                            # data.val_files
    print(layout_line(cfg, actor.groups, world_size))   # rank 0, after the process groups exist
"""
from __future__ import annotations

from megatron_rl.rollout.factory import engine_class
from megatron_rl.tasks.datasets import scorable_rows
from megatron_rl.tasks.val_set import val_file_problems
from megatron_rl.trainer.sync_settings import weight_sync_settings


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


def layout_line(cfg, groups, world_size: int) -> str:
    """The parallel layout megatron built (``groups``: the actor's ``ActorGroups``), the rollout engine and
    the weight-sync mode, as one line."""
    r = cfg.rollout
    engine = engine_class(r.engine).describe(r)
    return (f"[megatron-rl] layout: world size {world_size}, {groups.dims.describe()}; rollout engine {engine}, "
            f"{r.mode} rollouts; "
            f"weight sync {weight_sync_settings(cfg).mode}")

"""A run directory belongs to one run: refuse, start over, or resume — decided once, said on one line.

``trainer.run_dir`` receives a run's outputs (``RUN_OUTPUTS``: metrics.jsonl, checkpoints/, rollouts.jsonl,
the default weight_sync/, report/, TensorBoard / W&B files and the W&B run id, logged validation generations, a
launched server's log). Other files there (a
model directory the config loads, launcher logs) are not outputs and are never touched.

* ``run_dir_error(run_dir, resume, overwrite)``: a directory holding outputs is refused unless the run
  resumes (``--resume`` / ``trainer.resume=true``) or starts over (``trainer.overwrite=true``). Every rank
  computes it from the file system before any process group exists; the message names the directory,
  what it holds and both ways out.
* ``start_over(run_dir)``: rank 0 of an ``overwrite`` run removes the outputs and returns its one line.
* ``trim_to_step(run_dir, step)``: rank 0 of a resumed run keeps metrics.jsonl / rollouts.jsonl records of
  steps <= ``step`` (the checkpoint's) and removes every checkpoint directory that is not COMPLETE or is
  newer than ``step``, so the history reads 1..N once and no stale checkpoint can be picked up later.

Usage::

    err = run_dir_error("runs/x", resume=False, overwrite=False)   # None, or the refusal
    print(start_over("runs/x"))                                     # "... removed metrics.jsonl, checkpoints/ ..."
    print(trim_to_step("runs/x", 40))
"""
from __future__ import annotations

import json
import os
import shutil
from typing import List, Optional

__all__ = ["RUN_OUTPUTS", "run_outputs", "run_dir_error", "start_over", "trim_to_step", "complete_steps"]

#: What a run writes into its run directory (files and directories).
RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "rollouts.jsonl", "weight_sync", "report", "tensorboard",
               "wandb", "wandb_id", "val_generations.jsonl", "sglang_server.log")
#: The step-numbered JSON-lines files a resumed run continues.
STEP_LOGS = ("metrics.jsonl", "rollouts.jsonl", "val_generations.jsonl")


def run_outputs(run_dir: str) -> List[str]:
    """The ``RUN_OUTPUTS`` present in ``run_dir`` (directories with a trailing ``/``)."""
    out = []
    for name in RUN_OUTPUTS:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            out.append(name + "/")
        elif os.path.exists(path):
            out.append(name)
    return out


def _step_dirs(run_dir: str) -> List[tuple]:
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = []
    for d in os.listdir(root):
        if d.startswith("step_") and d[5:].isdigit():
            found.append((int(d[5:]), os.path.join(root, d)))
    return sorted(found)


def complete_steps(run_dir: str) -> List[int]:
    """Steps of ``run_dir/checkpoints/step_N`` directories marked COMPLETE, ascending."""
    return [n for n, path in _step_dirs(run_dir) if os.path.isfile(os.path.join(path, "COMPLETE"))]


def run_dir_error(run_dir: str, resume, overwrite: bool) -> Optional[str]:
    """The refusal for a run directory holding another run's outputs, or for ``resume="required"`` in one with no
    COMPLETE checkpoint; None otherwise (see the module docstring)."""
    if resume == "required" and not complete_steps(run_dir):
        found = run_outputs(run_dir)
        return (f"trainer.resume=required (--resume=required): no complete checkpoint in "
                f"{os.path.join(run_dir, 'checkpoints')!r}"
                + (f" (the directory holds: {', '.join(found)})" if found else
                   " (nothing of a run there: is trainer.run_dir mistyped?)")
                + ". Without 'required', --resume would begin a new run there at step 0")
    if resume or overwrite:
        return None
    found = run_outputs(run_dir)
    if not found:
        return None
    done = complete_steps(run_dir)
    ckpt = f" (complete checkpoints up to step_{done[-1]})" if done else ""
    return (f"trainer.run_dir: {run_dir!r} holds another run's outputs: {', '.join(found)}{ckpt}. Continue that "
            f"run with --resume (trainer.resume=true), or start over with trainer.overwrite=true (removes "
            f"them), or choose another trainer.run_dir")


def start_over(run_dir: str, keep: Optional[str] = None) -> str:
    """Remove the run outputs of ``run_dir`` (rank 0, ``trainer.overwrite``); returns the line to print.
    ``keep`` (the model the job loads, ``actor.load_hf``) must not lie inside what would be removed."""
    found = run_outputs(run_dir)
    if keep:
        inside = [n for n in found if _is_within(keep, os.path.join(run_dir, n.rstrip("/")))]
        if inside:
            raise ValueError(f"trainer.overwrite: actor.load_hf={keep!r} lies inside {inside[0]!r} of "
                             f"trainer.run_dir={run_dir!r}, which starting over would delete: copy the model "
                             f"elsewhere or choose another trainer.run_dir")
    for name in found:
        path = os.path.join(run_dir, name.rstrip("/"))
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if not found:
        return f"[megatron-rl] new run in {run_dir} (trainer.overwrite: nothing to remove)"
    return f"[megatron-rl] trainer.overwrite: removed the previous run's {', '.join(found)} from {run_dir}; new run"


def _is_within(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _trim_jsonl(path: str, step: int) -> int:
    """Keep the records of steps <= ``step`` (and unreadable lines, untouched); returns how many were dropped."""
    if not os.path.isfile(path):
        return 0
    kept, dropped, torn = [], 0, False
    with open(path) as fh:
        for line in fh:
            if not line.endswith("\n"):  # the last record of a killed writer: appending would glue onto it
                dropped, torn = dropped + 1, True
                continue
            try:
                s = json.loads(line).get("step")
            except (ValueError, AttributeError):
                s = None
            if isinstance(s, int) and s > step:
                dropped += 1
            else:
                kept.append(line)
    if dropped or torn:
        tmp = path + ".trim"
        with open(tmp, "w") as fh:
            fh.writelines(kept)
        os.replace(tmp, path)
    return dropped


def trim_to_step(run_dir: str, step: int) -> str:
    """Rank 0 of a run resumed at ``step``: drop later step records and stale checkpoints (see the module
    docstring); returns what was dropped, for the resume line ("" when nothing was)."""
    dropped = {name: _trim_jsonl(os.path.join(run_dir, name), step) for name in STEP_LOGS}
    stale = [(n, path) for n, path in _step_dirs(run_dir)
             if n > step or not os.path.isfile(os.path.join(path, "COMPLETE"))]
    for _, path in stale:
        shutil.rmtree(path)
    parts = [f"{k} record(s) of {name} after step {step}" for name, k in dropped.items() if k]
    if stale:
        parts.append("stale checkpoint(s) " + ", ".join(f"step_{n}" for n, _ in stale))
    return "; dropped " + "; ".join(parts) if parts else ""

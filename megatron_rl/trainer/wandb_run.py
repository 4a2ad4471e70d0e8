"""The W&B run of a run directory: its id is kept in ``run_dir/wandb_id`` so that a resumed run continues it.

    kwargs, line = wandb_init_kwargs("runs/x", resumed=True)   # {"id": ..., "resume": "allow"}, the line to print
    run = wandb.init(project=..., dir="runs/x", config=..., **kwargs)

A run that starts at step 0 (fresh, or ``--resume`` without a complete checkpoint) gets a new id and writes it; a
run resumed from a checkpoint reuses the id in the file (``resume="allow"``: W&B continues that run, or creates it
when the server never saw it, e.g. an offline run not yet synced). ``trainer.overwrite`` removes the file with the
other outputs (``run_dir.RUN_OUTPUTS``). Steps the interrupted run logged after its checkpoint are logged again by
the resumed run; W&B keeps the first value of a step (docs/running.md).
"""
from __future__ import annotations

import os
import secrets
import string
from typing import Dict, Tuple

__all__ = ["WANDB_ID_FILE", "new_wandb_id", "wandb_init_kwargs"]

WANDB_ID_FILE = "wandb_id"
"""File in the run directory holding the W&B run id (one line)."""
_ALPHABET = string.ascii_lowercase + string.digits


def new_wandb_id() -> str:
    """A fresh run id in W&B's own form (8 characters of [a-z0-9], as ``wandb.util.generate_id``)."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(8))


def wandb_init_kwargs(run_dir: str, resumed: bool) -> Tuple[Dict[str, str], str]:
    """(the id / resume arguments of ``wandb.init`` for this run, the line saying which W&B run it logs to); writes
    ``run_dir/wandb_id`` when the run gets a new id. ``resumed``: the run continues from a checkpoint."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if resumed and os.path.isfile(path):
        with open(path) as fh:
            run_id = fh.read().strip()
        if run_id:
            return {"id": run_id, "resume": "allow"}, f"[megatron-rl] W&B: continuing run {run_id} ({path})"
    run_id = new_wandb_id()
    os.makedirs(run_dir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(run_id + "\n")
    os.replace(tmp, path)
    why = " (the resumed run_dir had no W&B id: a new W&B run)" if resumed else ""
    return {"id": run_id}, f"[megatron-rl] W&B: new run {run_id}{why}, its id kept in {path}"

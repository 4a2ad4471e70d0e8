"""``trainer.epochs``: a training length in passes over the data file, turned into ``trainer.steps`` as verl does.

    errors = apply_epochs(cfg, trainer_tree)   # when the job is built: cfg.trainer.steps set from the file's rows
    print(epochs_line(cfg))                    # what the job (and `megatron-rl check`) prints

verl trains ``len(train_dataloader) x total_epochs`` steps, its dataloader batching the prompts of one draw
(``data.gen_batch_size`` or ``data.train_batch_size``) with ``drop_last`` (its ``ray_trainer._create_dataloader``):
``floor(rows / prompts per draw)`` steps per epoch. The one non-obvious rule: rows are the training file's records
as read (before ``data.overlong_prompts`` filters any), counted without tokenizing, so the length is known before
any expensive work; the draw here continues across epoch boundaries (``tasks/epoch_order.py``), so a file whose
rows do not divide evenly is not cut short, only the step count is verl's.
"""
from __future__ import annotations

import os
from typing import Any, List, Mapping

from megatron_rl.config.job import JobConfig
from megatron_rl.config.sections import round_prompts
from megatron_rl.jsonl import read_json_objects


def count_rows(path: str) -> int:
    """Records of a JSONL (non-blank lines) or Parquet (its metadata's row count) file; ValueError naming
    ``data.path`` when it cannot be read."""
    if not os.path.isfile(path):
        raise ValueError(f"data.path={path!r} does not exist or is not a file")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq  # optional dependency (the parquet extra)
        except ImportError:
            raise ValueError(f"data.path={path!r}: reading Parquet needs the 'pyarrow' package") from None
        return int(pq.ParquetFile(path).metadata.num_rows)
    if suffix in (".jsonl", ".json", ".ndjson"):
        return sum(1 for _ in read_json_objects(path, where=f"data.path={path!r}"))
    raise ValueError(f"data.path={path!r}: unsupported extension {suffix!r}; use .jsonl or .parquet")


def epoch_steps(rows: int, per_draw: int, epochs: int) -> int:
    """verl's step count: ``floor(rows / per_draw)`` batches per epoch (drop_last) times ``epochs``."""
    return (rows // per_draw) * epochs


def apply_epochs(cfg: JobConfig, trainer_tree: Mapping[str, Any]) -> List[str]:
    """Set ``cfg.trainer.steps`` from ``cfg.trainer.epochs`` (when set) and return the problems, each naming its
    key: epochs < 1, epochs together with an explicit ``trainer.steps``, a task without a data file, a file that
    cannot be read or holds fewer rows than one draw."""
    t = cfg.trainer
    if t.epochs is None:
        return []
    if isinstance(t.epochs, bool) or not isinstance(t.epochs, int) or t.epochs < 1:
        return [f"trainer.epochs: must be an integer >= 1 (or null: trainer.steps), got {t.epochs!r}"]
    if "steps" in (trainer_tree or {}):
        return [f"trainer.epochs: {t.epochs} together with trainer.steps {trainer_tree['steps']!r}: give one "
                f"(epochs count steps from the data file's rows)"]
    if cfg.data.task != "file" or not cfg.data.path:
        return [f"trainer.epochs: counts passes over a data file; data.task is {cfg.data.task!r} (set data.task: "
                f"file and data.path, or give trainer.steps)"]
    per_draw = round_prompts(cfg.algorithm, cfg.data)
    if per_draw < 1:
        return []  # data.prompts_per_step / prompts_per_round report their own problem
    try:
        rows = count_rows(cfg.data.path)
    except ValueError as exc:
        return [f"trainer.epochs: {exc}"]
    if rows < per_draw:
        return [f"trainer.epochs: data.path={cfg.data.path!r} holds {rows} rows, fewer than one draw of {per_draw} "
                f"prompts (verl's dataloader would be empty)"]
    t.steps = epoch_steps(rows, per_draw, t.epochs)
    return []


def epochs_line(cfg: JobConfig) -> str:
    """The line a job with ``trainer.epochs`` prints: its steps and how they were counted."""
    per_draw = round_prompts(cfg.algorithm, cfg.data)
    rows = count_rows(cfg.data.path)
    return (f"trainer.epochs {cfg.trainer.epochs}: {cfg.trainer.steps} steps = {cfg.trainer.epochs} x floor({rows} "
            f"rows of {cfg.data.path} / {per_draw} prompts per draw), as verl counts its dataloader (drop_last)")

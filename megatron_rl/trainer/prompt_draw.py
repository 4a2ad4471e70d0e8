"""Rank 0: the prompts of each generation round -- one ``PromptDraw`` per job, built with the task and handed to the
step generator (``rollout_phase.build_step_generator``) and the checkpoints (``job.py``).

    draw = PromptDraw(task, cfg)           # after the task is built (rank 0)
    prompts = draw(step, rnd)              # the prompts of generation round rnd of step (round_prompts of them)
    extra = draw.state(s, s + j)           # the checkpoint after s steps (j: the async rollouts it holds)
    draw.restore(extra, start)             # --resume, before the first draw

* A task with a finite set of prompts (``task.finite_prompts()``: a data file) is drawn without replacement,
  epoch by epoch, continuing across rounds and steps (``tasks.epoch_order.EpochOrder`` seeded by trainer.seed:
  epoch e is the permutation of (trainer.seed, e)). Its position at the start of each step is checkpoint state
  (``prompt_order``, with a fingerprint of the rendered prompts: ``prompts_fingerprint``): a resumed run draws
  exactly what the uninterrupted one drew. A checkpoint without it (older), of another data set size or seed, or of
  other prompts (another file of the same size, or the same rows rendered otherwise) starts the order over at
  epoch 0, saying why.
* A task that generates its prompts (the digit tasks, ``lookup``) draws them with ``task.sample`` and a
  ``random.Random`` seeded by (trainer.seed, step, round) (``sample_prompts``): no state, as it always did.

Before drawing, the task gets the ``data:`` section's ``DataOptions`` (a no-op when unchanged) and the step
(``begin_step``: a curriculum follows it). Only rank 0 draws; the prompts reach the other ranks in the step's
scatter (``rollout_source``), so every rank trains the same ones.
"""
from __future__ import annotations

import hashlib
import random
from typing import Dict, Optional, Sequence

import numpy as np

from megatron_rl.config.sections import round_prompts
from megatron_rl.tasks.epoch_order import EpochOrder
from megatron_rl.tasks.options import DataOptions

__all__ = ["PromptDraw", "sample_prompts", "round_seed", "prompts_fingerprint", "ROUND_SEED_STRIDE", "STATE_KEY"]

STATE_KEY = "prompt_order"
"""The checkpoint extra state's key of the file order's positions."""

ROUND_SEED_STRIDE = 1_000_000_007
"""Seed offset between generation rounds of one step (larger than any step count: no round meets another step)."""


def round_seed(base: int, rnd: int) -> int:
    """The seed of generation round ``rnd`` of a step whose round 0 uses ``base``: dynamic sampling's extra rounds
    (``algorithm.filter_groups``) draw fresh samples (and, for generated tasks, prompts); round 0 is what every
    run draws."""
    return base + ROUND_SEED_STRIDE * rnd


def sample_prompts(task, cfg, step: int, rnd: int = 0) -> list:
    """The draw of a task that generates its prompts: step ``step``'s prompts (``round_prompts``: data.prompts_per_step,
    or algorithm.filter_groups.prompts_per_round with dynamic sampling) of
    generation round ``rnd``, seeded by (trainer.seed, step, rnd), after the task got the ``data:`` options and the
    step (its curriculum and held-out split follow it)."""
    task.configure(DataOptions.from_config(cfg.data))
    rng = random.Random(round_seed(cfg.trainer.seed * 1_000_003 + step, rnd))
    task.begin_step(step)  # a task's curriculum (e.g. data.task_kwargs.curriculum_steps) follows the step
    return task.sample(round_prompts(cfg.algorithm, cfg.data), rng)


def prompts_fingerprint(prompts: Sequence) -> str:
    """SHA-256 (hex) of the prompts' token ids in order (each row's length, then its ids, as int64): what a saved
    order's positions index."""
    h = hashlib.sha256()
    for p in prompts:
        ids = np.asarray(p.prompt_ids, dtype=np.int64)
        h.update(np.int64(ids.size).tobytes())
        h.update(ids.tobytes())
    return h.hexdigest()


class PromptDraw:
    """The job's prompt draw (module docstring)."""

    def __init__(self, task, cfg):
        self.task, self.cfg = task, cfg
        self.options = DataOptions.from_config(cfg.data)
        task.configure(self.options)  # the data set's size is the one the options render
        finite = task.finite_prompts()
        self.order: Optional[EpochOrder] = None if finite is None else EpochOrder(len(finite), cfg.trainer.seed)
        self.fingerprint = None if finite is None else prompts_fingerprint(finite)

    def __call__(self, step: int, rnd: int = 0) -> list:
        if self.order is None:
            return sample_prompts(self.task, self.cfg, step, rnd)
        self.task.configure(self.options)
        self.task.begin_step(step)
        prompts = self.task.finite_prompts()
        if len(prompts) != self.order.size:
            raise RuntimeError(f"task {self.task.name!r}: {len(prompts)} prompts, the order was made for "
                               f"{self.order.size}")
        return [prompts[i] for i in self.order.take(round_prompts(self.cfg.algorithm, self.cfg.data), step)]

    def state(self, first: int, last: int) -> Dict:
        """The checkpoint extra state of the order: its start position at steps ``first .. last`` (the checkpoint's
        step and the steps whose async rollouts it holds: a resumed run draws from one of them on); {} for a
        generated task."""
        if self.order is None:
            return {}
        return {STATE_KEY: {"size": self.order.size, "seed": self.order.seed, "fingerprint": self.fingerprint,
                            "positions": self.order.positions(first, last)}}

    def restore(self, extra: Dict, start: int) -> None:
        """``--resume`` from a checkpoint after ``start`` steps (``extra``: its extra state, whose
        ``async_rollouts`` are the steps the producer may skip): continue its order;
        one line and a fresh order when it has none (written before the order was saved) or one of another data
        set size, seed or prompts (``prompts_fingerprint``; a checkpoint written before the fingerprint was saved
        continues, saying that its prompts could not be compared)."""
        if self.order is None or start <= 0:
            return
        saved = (extra or {}).get(STATE_KEY)
        why = None
        if not saved:
            why = "the checkpoint holds no prompt order (written before it was saved)"
        elif (saved["size"], saved["seed"]) != (self.order.size, self.order.seed):
            why = (f"the checkpoint's prompt order is for {saved['size']} prompts and trainer.seed={saved['seed']} "
                   f"(this run: {self.order.size}, {self.order.seed})")
        elif saved.get("fingerprint") not in (None, self.fingerprint):
            why = (f"the checkpoint's prompt order is for other prompts of the same count (another data file, or the "
                   f"rows rendered otherwise: fingerprint {str(saved['fingerprint'])[:12]}, this run's "
                   f"{self.fingerprint[:12]})")
        elif saved.get("fingerprint") is None:
            print("[megatron-rl] the checkpoint's prompt order records no fingerprint of its prompts (written before "
                  "it was saved): continuing it for the same prompt count and seed", flush=True)
        if why is not None:
            print(f"[megatron-rl] {why}: the prompt order starts over at epoch 0", flush=True)
            # the step the producer draws first -- the checkpoint's, or the one after the async rollouts it keeps --
            # starts the fresh order; a held step, never drawn here, is checkpointed at that start too
            held = len((extra or {}).get("async_rollouts") or {})
            self.order.resume({t: (0, 0, ()) for t in range(start, start + held + 1)})
            return
        self.order.resume(saved["positions"])


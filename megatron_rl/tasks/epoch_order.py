"""The order in which a finite set of prompts (a data file's) is drawn: without replacement, epoch by epoch.

    order = EpochOrder(size=7473, seed=1234)
    idx = order.take(512, step)            # the next 512 indices; called once per generation round of ``step``
    order.position()                       # (epoch, offset, set aside): where the next step starts
    saved = order.positions(s, s + 1)      # {step: [epoch, offset, [set aside]]} for a checkpoint
    order.resume(saved)                    # a resumed run: the first step it draws starts where the saved one did

Epoch ``e`` draws every index once, in the permutation ``numpy.random.default_rng([seed mod 2**64, e])
.permutation(size)`` -- a function of (seed, epoch) alone, nothing to store but the position. Draws continue
across generation rounds and steps; an epoch ends when its permutation is used up and the next one starts
within the same round (the epoch's last prompts come first, nothing is dropped).

A step never draws a prompt twice while the file holds a prompt it has not drawn: right after an epoch boundary,
an index of the new permutation that the step already drew in the old epoch is set aside and drawn first in the
next step (it stays in its epoch: every epoch still draws every index exactly once). Only a step that draws
more than ``size`` prompts repeats some (each epoch is finished before the next begins).

``take`` records the position each step starts from (``positions`` hands them to a checkpoint; a step whose draw
has not begun starts at the current position). Thread-safe: the async producer draws while the trainer
checkpoints.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

Position = Tuple[int, int, Tuple[int, ...]]
"""(epoch, offset into its permutation, indices set aside to be drawn first)."""


def epoch_permutation(size: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch ``epoch``'s order of ``range(size)`` for ``seed`` (module docstring)."""
    return np.random.default_rng([int(seed) % 2 ** 64, int(epoch)]).permutation(int(size))


class EpochOrder:
    """Indices ``0 .. size - 1`` without replacement, epoch by epoch (module docstring)."""

    def __init__(self, size: int, seed: int):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"EpochOrder: size={size!r} must be an int >= 1")
        self.size, self.seed = size, int(seed)
        self.epoch, self.offset, self.aside = 0, 0, []   # the position
        self._perm = epoch_permutation(size, self.seed, 0)
        self._step: Optional[int] = None                  # the step being drawn
        self._drawn: set = set()                          # its draws so far
        self._starts: Dict[int, Position] = {}            # step -> the position it started from
        self._resume = False                              # the next step seeks to its saved start
        self._lock = threading.Lock()

    def position(self) -> Position:
        """Where the next draw comes from."""
        return self.epoch, self.offset, tuple(self.aside)

    def take(self, n: int, step: int) -> List[int]:
        """The next ``n`` indices, drawn for (0-based) ``step``: a new step number starts a step."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"EpochOrder.take: n={n!r} must be an int >= 1")
        with self._lock:
            if step != self._step:
                self._begin(int(step))
            return [self._next() for _ in range(n)]

    def positions(self, first: int, last: int) -> Dict[int, list]:
        """The start positions of steps ``first .. last`` as plain lists (a checkpoint's): recorded ones, or the
        current position for the step after the last one drawn. Forgets starts before ``first``."""
        with self._lock:
            out = {}
            for t in range(int(first), int(last) + 1):
                if t in self._starts:
                    pos = self._starts[t]
                elif not self._resume and (self._step is None or t == self._step + 1):
                    pos = self.position()
                else:
                    raise RuntimeError(f"EpochOrder: the start of step {t} is not known (last step drawn: "
                                       f"{self._step}; recorded: {sorted(self._starts)})")
                out[t] = [int(pos[0]), int(pos[1]), [int(i) for i in pos[2]]]
            for t in [t for t in self._starts if t < first]:
                del self._starts[t]
            return out

    def resume(self, saved: Dict[int, Sequence]) -> None:
        """Take a checkpoint's ``positions``: the first step drawn next starts at its saved position (a resumed
        producer may regenerate from the checkpoint's step or skip the steps it holds)."""
        with self._lock:
            self._starts = {int(t): (int(p[0]), int(p[1]), tuple(int(i) for i in p[2])) for t, p in saved.items()}
            self._resume, self._step = True, None

    # ------------------------------------------------------------------ internals (under the lock)
    def _begin(self, step: int) -> None:
        if self._resume:
            if step not in self._starts:
                raise RuntimeError(f"EpochOrder: resumed at steps {sorted(self._starts)}, asked to draw step {step}")
            self._seek(self._starts[step])
            self._resume = False
        self._step, self._drawn = step, set()
        self._starts[step] = self.position()

    def _seek(self, pos: Position) -> None:
        epoch, offset, aside = pos
        if epoch != self.epoch:
            self._perm = epoch_permutation(self.size, self.seed, epoch)
        self.epoch, self.offset, self.aside = int(epoch), int(offset), list(aside)

    def _next(self) -> int:
        while True:
            for j, i in enumerate(self.aside):        # set aside earlier: first, unless this step holds them
                if i not in self._drawn:
                    del self.aside[j]
                    return self._took(i)
            while self.offset < self.size:
                i = int(self._perm[self.offset])
                self.offset += 1
                if i not in self._drawn:
                    return self._took(i)
                self.aside.append(i)                  # this step drew it in the last epoch: later
            if self.aside:                            # the step holds every prompt: finish the epoch anyway
                return self._took(self.aside.pop(0))
            self._seek((self.epoch + 1, 0, ()))

    def _took(self, i: int) -> int:
        self._drawn.add(i)
        return i

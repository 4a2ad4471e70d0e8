"""SIGTERM / SIGINT (Slurm preemption, Ctrl-C) -> checkpoint at the next step boundary, then exit.

The handler only sets a flag; the loop checks it between steps (all ranks agree through an
all-reduce of the flag, since signals reach ranks at different times), saves a checkpoint and exits
with code 0 so ``--resume`` continues exactly where it stopped. A second signal exits at once.
"""
from __future__ import annotations

import signal
import sys


class StopRequested:
    """Installs the handlers; ``requested`` turns True on the first SIGTERM / SIGINT."""

    def __init__(self) -> None:
        self.requested = False
        self.signum = None
        self._old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:  # second signal: give up immediately
            sys.exit(128 + signum)
        self.requested = True
        self.signum = signum
        print(f"[megatron-rl] received signal {signum}: checkpointing at the end of this step", file=sys.stderr,
              flush=True)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

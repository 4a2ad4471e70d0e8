"""SIGTERM / SIGINT (Slurm preemption, Ctrl-C, torchrun stopping the job) -> checkpoint at the end of the
step, then exit 0; a second signal, or a step that cannot end, exits at once.

* First signal: ``requested`` turns True (rank 0 says so on one line). The loop reads it between steps (all
  ranks agree through an all-reduce, since signals reach ranks at different times), saves a checkpoint, prints
  one line naming it and exits 0, so ``--resume`` continues exactly where it stopped. From that moment the
  rank has ``stop_timeout_s`` seconds to finish; if it is still running then (blocked in a hung collective, a
  process join, a queue wait, a checkpoint that cannot be written) it exits with ``128 + signum`` and its
  stacks printed — a job that cannot checkpoint still stops.
* Second signal: exit ``128 + signum`` at once, without checkpoint.
* Under ``launch/torchrun.sh`` the launcher also writes each stop request to a file (``lifeline.StopChannel``)
  before it signals the ranks; the watcher reads it on every signal and every ``poll_s``, so a signal that never
  arrives still stops the rank. The number of requests taken is the larger of the signals received and the
  launcher's count (a signal and the file entry for it are one request); the first one is acknowledged to the
  launcher.

Signals are seen by a watcher thread, not by a Python signal handler: Python runs handlers only when the
main thread returns to the interpreter, which a rank blocked inside a gloo/NCCL collective or a lock never
does (a handler calling ``sys.exit`` there does nothing). ``signal.set_wakeup_fd`` makes the C-level handler
write each signal number to a pipe the moment it arrives; the thread reads it and, when the process must
end, calls ``watchdog.abort`` (``os._exit``, which nothing can block).
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from typing import Dict, Optional

from megatron_rl.lifeline import StopChannel
from megatron_rl.trainer.watchdog import abort

__all__ = ["StopRequested"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested:
    """Installs the SIGTERM / SIGINT watcher (main thread only); ``requested`` turns True on the first."""

    def __init__(self, stop_timeout_s: float = 900.0, rank: Optional[int] = None, poll_s: float = 0.5) -> None:
        """``stop_timeout_s``: seconds a rank may take after the first signal before it exits without
        checkpoint (<= 0: no limit). ``rank`` is named in messages (default: $RANK). ``poll_s``: how often the
        launcher's stop file is read."""
        self.requested = False
        self.signum: Optional[int] = None
        self.stop_timeout_s = float(stop_timeout_s)
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self._count = 0
        self._signals = 0
        self._channel = StopChannel.from_env()
        self._poll_s = poll_s
        self._closed = False
        self._old: Dict[int, object] = {}
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd requires a non-blocking fd
        self._old_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for sig in _SIGNALS:
            self._old[sig] = signal.signal(sig, self._python_handler)
        self._thread = threading.Thread(target=self._watch, name="megatron-rl-signals", daemon=True)
        self._thread.start()

    @staticmethod
    def _python_handler(signum, frame) -> None:
        """The watcher thread acts on the signal; the interpreter-level handler has nothing to do."""

    def _watch(self) -> None:
        self._take_requests(None)  # a stop requested while this rank was starting
        while True:
            try:
                ready, _, _ = select.select([self._read_fd], [], [], self._poll_s if self._channel else None)
                data = os.read(self._read_fd, 64) if ready else b"-"
            except OSError:
                return
            if not data or self._closed:
                os.close(self._read_fd)
                return
            for signum in data:
                if signum in _SIGNALS:
                    self._signals += 1
                    self._take_requests(int(signum))
            self._take_requests(None)

    def _take_requests(self, signum: Optional[int]) -> None:
        """Act on every request not taken yet: ``max(signals received, the launcher's count)``."""
        count, file_signum = self._channel.read() if self._channel else (0, None)
        while self._count < max(self._signals, count):
            self._on_signal(signum if signum is not None else file_signum)

    def _on_signal(self, signum: int) -> None:
        self._count += 1
        if self._count > 1:
            abort(128 + signum, f"second signal {signum}: exiting now without checkpoint", rank=self.rank)
        self.requested = True
        self.signum = signum
        if self._channel is not None:
            self._channel.acknowledge(self.rank, signum)
        if self.rank == 0:  # one line per job: every rank got the signal (launch/torchrun.sh forwards it)
            print(f"[megatron-rl] received signal {signum}: checkpointing at the end of this step "
                  f"(a second signal exits at once)", file=sys.stderr, flush=True)
        if self.stop_timeout_s > 0:
            threading.Thread(target=self._deadline, args=(signum,), name="megatron-rl-stop-deadline",
                             daemon=True).start()

    def _deadline(self, signum: int) -> None:
        time.sleep(self.stop_timeout_s)
        abort(128 + signum, f"signal {signum} arrived {self.stop_timeout_s:g} s ago and this rank has not "
                            f"finished its step and checkpoint (trainer.stop_timeout_s); exiting without "
                            f"checkpoint", rank=self.rank)

    def restore(self) -> None:
        """Put the previous handlers back. A deadline started by a signal keeps running: the process is
        expected to exit within it."""
        if self._closed:
            return
        self._closed = True
        for sig, old in self._old.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self._write_fd)  # the watcher's read returns b"" and the thread ends

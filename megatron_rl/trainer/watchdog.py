"""Bounded waits for the RL loop: a per-rank watchdog over the phases of a step, and ``abort``.

A rank can wait on something that never comes: a collective whose peer died without closing its socket,
a checkpoint writer, an HTTP reply, a child process, a queue. Process-group timeouts
(``trainer.collective_timeout_s``) bound collectives; the watchdog bounds everything else. The loop
names each phase of a step (``rollout``, ``logprob``, ``train``, ``weight_sync``, ``metrics``,
``checkpoint``)::

    wd = Watchdog(rank, timeout_s=cfg.trainer.phase_timeout_s)
    with wd.phase("checkpoint", step=10, timeout_s=cfg.trainer.checkpoint_timeout_s):
        save(...)

If a phase is still running when its time is up, a daemon thread calls ``abort``: it prints
``[megatron-rl] rank R: <phase> of step S did not finish within N s (<config key>)`` and the Python stack
of every thread (so the log shows *where* it hung), kills this rank's child processes (checkpoint
writers, a launched SGLang server) and ends the process with ``os._exit(EXIT_HUNG)``. ``os._exit`` works
even when the main thread is blocked inside C code (a collective, a lock), where an exception could never
be delivered. torchrun then sees a failed rank and stops the others (SIGTERM, then SIGKILL after its
30 s grace), so the whole job ends in bounded time with the cause in the failing rank's log.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

from megatron_rl.lifeline import abort, kill_children  # noqa: F401  (re-exported: the loop's names)

__all__ = ["Watchdog", "abort", "kill_children", "EXIT_HUNG"]

EXIT_HUNG = 124
"""Exit code of a rank ended by the watchdog (the code ``timeout(1)`` uses)."""


class Watchdog:
    """Per-rank daemon thread that aborts the process when a named phase outlives its time limit."""

    def __init__(self, rank: int, timeout_s: float, config_key: str = "trainer.phase_timeout_s",
                 poll_s: float = 0.5) -> None:
        """``timeout_s`` is the default limit of a phase (<= 0: phases are unbounded unless a phase gives
        its own limit); ``config_key`` is named in the abort message so users know what to raise."""
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.config_key = config_key
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._current: Optional[tuple] = None  # (name, step, deadline, limit, key)
        self.elapsed: Dict[str, float] = {}
        """Seconds the last run of each phase took (by name): the loop's ``timing/*`` metrics."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron-rl-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def phase(self, name: str, step: int, timeout_s: Optional[float] = None,
              config_key: Optional[str] = None) -> Iterator[None]:
        """Bound the body: it must finish within ``timeout_s`` (default: the watchdog's) seconds; its duration is
        kept in ``elapsed[name]``."""
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        key = config_key or self.config_key
        with self._lock:
            outer = self._current
            self._current = (name, step, time.monotonic() + limit, limit, key) if limit > 0 else None
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.elapsed[name] = time.perf_counter() - t0
            with self._lock:
                self._current = outer

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                cur = self._current
            if cur is not None and time.monotonic() > cur[2]:
                name, step, _, limit, key = cur
                abort(EXIT_HUNG, f"{name} of step {step} did not finish within {limit:g} s ({key}); "
                                 f"ending this rank so the job stops instead of hanging", rank=self.rank)

    def close(self) -> None:
        """Stop watching (the thread exits at its next poll)."""
        self._stop.set()

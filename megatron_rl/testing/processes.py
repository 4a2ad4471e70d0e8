"""The processes a test starts, found by ancestry (whatever session or process group they moved to) and ended.

    become_subreaper()            # orphans of our descendants are re-parented to us: a job whose launcher
                                  # died stays findable (and its zombies are ours to reap)
    before = process_ids()        # every live descendant of this process
    left = leftovers(before)      # new descendants not started by one of ``before``, after a grace period
    kill_job(proc)                # SIGKILL a started job: the Popen's process, its group and every descendant
    with shared(lambda: pool.worker_pids()):   # a fixture shared across tests (module / session scope) that
        yield pool                             # starts processes lazily, during a test, names them as its own

Used by ``tests/conftest.py`` (a test that leaves a process of its job behind fails) and by the tests that start
jobs (``launch/torchrun.sh``, ``megatron_rl.train``, servers), which call ``kill_job`` on every way out.
"""
from __future__ import annotations

import ctypes
import gc
import os
import signal
import contextlib
import time
from typing import Callable, Iterable, Iterator, List, Optional, Set

import psutil

__all__ = ["become_subreaper", "process_ids", "leftovers", "kill_job", "kill_processes", "describe", "shared",
           "terminal_signals"]

_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
#: long-lived helpers a library starts once per process on first use; not a test's job
_SHARED_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "compile_worker",
                   "torch_shm_manager")
#: pid sources of fixtures shared across tests (``shared``): their processes outlive a test by design
_SHARED_SOURCES: List[Callable[[], Iterable[Optional[int]]]] = []


@contextlib.contextmanager
def shared(pids: Callable[[], Iterable[Optional[int]]]) -> Iterator[None]:
    """While open, the processes whose pids ``pids()`` returns (None entries ignored) belong to a fixture shared
    across tests (started lazily by whichever test uses it first), not to the test that was running."""
    _SHARED_SOURCES.append(pids)
    try:
        yield
    finally:
        _SHARED_SOURCES.remove(pids)


def terminal_signals() -> None:
    """``preexec_fn`` of a launcher a test signals: SIGINT, SIGQUIT, SIGHUP and SIGTERM at their defaults, as in a
    terminal's foreground job, whatever the test process inherited -- a shell cannot trap a signal that was ignored
    when it started, and pytest run under ``nohup`` or as a background job ignores SIGINT / SIGHUP."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _shared_pids() -> Set[int]:
    return {int(p) for source in _SHARED_SOURCES for p in source() if p is not None}


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux); returns whether it worked."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _descendants(pid: Optional[int] = None) -> List[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def process_ids(pid: Optional[int] = None) -> Set[int]:
    """Pids of the live descendants of ``pid`` (default: this process)."""
    return {p.pid for p in _descendants(pid)}


def _reap_zombies(orphans_only: bool = False) -> None:
    """Reap this process's zombie children (orphans re-parented to a subreaper, killed jobs nobody waited).
    ``orphans_only``: only those of another session -- a child this process started is in its session or leads
    its own (start_new_session), and its ``Popen`` must still read its exit code."""
    my_sid = os.getsid(0)
    for p in psutil.Process().children():
        try:
            if p.status() == psutil.STATUS_ZOMBIE and (not orphans_only or os.getsid(p.pid) not in (p.pid, my_sid)):
                os.waitpid(p.pid, os.WNOHANG)
        except (psutil.Error, OSError):
            pass


def reap_orphans() -> None:
    """Reap this process's zombie children that belong to another session: orphans of a job's processes,
    re-parented to this process when it is a child subreaper (the test suite makes pytest one). ``slurmstepd``
    waits until no process of the job's process group exists, a zombie included: left unreaped, one holds the job
    in COMPLETING for Slurm's UnkillableStepTimeout (60 s) and then drains the node ("Kill task failed")."""
    _reap_zombies(orphans_only=True)


def _new_job_processes(before: Set[int]) -> List[psutil.Process]:
    """Live descendants not in ``before`` and not started by a process in ``before`` (a shared server's own
    children are the server's business), shared library helpers excepted."""
    me = os.getpid()
    out = []
    before = set(before) | _shared_pids()
    for p in _descendants():
        try:
            if p.pid in before or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if any(a.pid in before for a in p.parents() if a.pid != me):
                continue
            if any(h in " ".join(p.cmdline()) for h in _SHARED_HELPERS):
                continue
        except psutil.Error:  # ended meanwhile
            continue
        out.append(p)
    return out


def describe(procs: Iterable[psutil.Process]) -> str:
    """``pid (sid S): cmdline`` per process, one per line."""
    lines = []
    for p in procs:
        try:
            lines.append(f"  pid {p.pid} (session {os.getsid(p.pid)}): {' '.join(p.cmdline())[:200]}")
        except (psutil.Error, OSError):
            lines.append(f"  pid {p.pid}: (ended)")
    return "\n".join(lines)


def leftovers(before: Set[int], grace_s: float = 15.0, poll_s: float = 0.2) -> List[psutil.Process]:
    """The processes started since ``before`` (see ``_new_job_processes``) still alive after ``grace_s`` seconds
    (a job's ranks get that long to notice their launcher ended)."""
    if process_ids() <= before:  # the common case, in one scan of /proc
        return []
    gc.collect()  # worker pools end their workers when collected (a full collection: only when needed)
    deadline = time.monotonic() + grace_s
    while True:
        _reap_zombies()
        left = _new_job_processes(before)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(poll_s)


def kill_processes(procs: Iterable[psutil.Process]) -> None:
    """SIGKILL each process (and the group it leads), then reap what is ours."""
    for p in procs:
        try:
            if os.getpgid(p.pid) == p.pid:
                os.killpg(p.pid, signal.SIGKILL)
            p.kill()
        except (psutil.Error, OSError):
            pass
    psutil.wait_procs(list(procs), timeout=10)
    _reap_zombies()


def kill_job(proc) -> None:
    """End a job a test started (a ``subprocess.Popen``), whatever state it is in: SIGKILL every descendant of
    it (the torchrun agent and the ranks run in sessions of their own), its process group, then itself; wait.
    A process already waited for is left alone (its pid may belong to another process by now)."""
    if proc.returncode is not None:
        return
    kids = _descendants(proc.pid)  # not reaped yet: the pid is still this process's
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # started with start_new_session: its group is its pid
    except (ProcessLookupError, PermissionError):
        pass
    kill_processes(kids)
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=30)
    except Exception:  # noqa: BLE001 - a process that cannot be reaped in 30 s is reported by the fixture
        pass

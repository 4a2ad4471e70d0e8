"""The link between ``launch/torchrun.sh`` and the processes of its job: a job never outlives its launcher, and a
stop request cannot be lost. Light on purpose (no torch): the torchrun agent starts through it.

* The agent: ``python -m megatron_rl.lifeline --parent PID -- CMD...`` starts ``CMD`` (torchrun) in a new session
  with the kernel's parent-death signal set to SIGKILL, so the agent ends the moment the launcher (``PID``) ends,
  however it ends (SIGKILL, SIGHUP, a crash).
* A rank (``watch_job_owners``, called by ``megatron_rl.train``): when started by torchrun, a daemon thread waits
  for its agent (its parent, ``$MEGATRON_RL_AGENT_PID``) and for the launcher (``$MEGATRON_RL_LAUNCHER_PID``) to
  end; when either does, the rank exits at once (its worker processes with it) -- a job nobody watches does not
  keep running.
* The stop request (``StopChannel``): the launcher writes ``"<count> <signum>"`` to ``$MEGATRON_RL_STOP_FILE``
  *before* it signals the ranks, and each rank, once it has taken a stop request, writes ``ack.<rank>`` into the
  file's directory. A rank reads the file every ``poll_s`` as well as on every signal, so a signal that never
  arrives still stops it; the launcher counts the acknowledgements and says in one line that the ranks got it.
"""
from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

__all__ = ["StopChannel", "watch_job_owners", "set_parent_death_signal", "abort", "kill_children", "main"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
LAUNCHER_PID_ENV = "MEGATRON_RL_LAUNCHER_PID"
AGENT_PID_ENV = "MEGATRON_RL_AGENT_PID"
STOP_FILE_ENV = "MEGATRON_RL_STOP_FILE"


def kill_children() -> int:
    """SIGKILL every descendant process of this one (process groups of children that lead their own,
    e.g. a launched SGLang server, included). Returns how many processes were signalled."""
    import psutil  # only here: the torchrun agent starts through this module and never calls it

    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    n = 0
    for kid in kids:
        try:
            if os.getpgid(kid.pid) == kid.pid:  # a group leader: take its whole group
                os.killpg(kid.pid, signal.SIGKILL)
            else:
                kid.kill()
            n += 1
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return n


def abort(code: int, message: str, rank: Optional[int] = None, stacks: bool = True) -> None:
    """End this process now: print ``message`` (prefixed with the rank), the stacks of all threads, kill
    child processes, then ``os._exit(code)`` (no cleanup handlers run; nothing can block it)."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    try:
        print(f"[megatron-rl] rank {rank}: {message}", file=sys.stderr, flush=True)
        if stacks:
            print(f"[megatron-rl] rank {rank}: stacks of all threads at exit:", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        kill_children()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent ends (kept across ``exec``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")


@dataclass
class StopChannel:
    """The launcher's stop request as a rank sees it (``from_env``: None outside ``launch/torchrun.sh``)."""

    #: the file the launcher writes ``"<count> <signum>"`` to, before it signals the ranks
    stop_file: str

    @classmethod
    def from_env(cls, env=None) -> "Optional[StopChannel]":
        """The channel named by ``$MEGATRON_RL_STOP_FILE``, or None."""
        path = (os.environ if env is None else env).get(STOP_FILE_ENV)
        return cls(path) if path else None

    def read(self) -> Tuple[int, Optional[int]]:
        """``(count, signum)`` of the launcher's stop requests so far; ``(0, None)`` before the first."""
        try:
            with open(self.stop_file) as fh:
                count, signum = fh.read().split()
            return int(count), int(signum)
        except (OSError, ValueError):  # not written yet (the launcher renames a complete file into place)
            return 0, None

    def acknowledge(self, rank: int, signum: int) -> None:
        """Tell the launcher this rank has taken the stop request (``ack.<rank>`` next to the stop file)."""
        path = os.path.join(os.path.dirname(self.stop_file), f"ack.{rank}")
        try:
            with open(path + ".tmp", "w") as fh:
                fh.write(f"{os.getpid()} {signum}\n")
            os.replace(path + ".tmp", path)
        except OSError:  # the launcher is gone (it removes the directory at exit): nobody to tell
            pass


def _pidfd(pid: int) -> Optional[int]:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_any_exit(pids: List[int], parent: int, poll_s: float) -> int:
    """Block until one of ``pids`` has ended (or this process's parent is no longer ``parent``); returns it."""
    fds = {fd: pid for pid in pids for fd in [_pidfd(pid)] if fd is not None}
    try:
        while True:
            for pid in pids:
                if not _alive(pid) or (pid == parent and os.getppid() != parent):
                    return pid
            if not fds:
                time.sleep(poll_s)
                continue
            ready, _, _ = select.select(list(fds), [], [], poll_s)
            if ready:
                return fds[ready[0]]
    finally:
        for fd in fds:
            os.close(fd)


def watch_job_owners(env=None, on_orphan: Optional[Callable[[str], None]] = None,
                     poll_s: float = 1.0) -> Optional[threading.Thread]:
    """In a rank started by torchrun (``$TORCHELASTIC_RUN_ID``): a daemon thread that ends the process as soon
    as its agent (the parent) or the launcher (``$MEGATRON_RL_LAUNCHER_PID``) has ended. ``on_orphan(message)``
    ends the process (default: ``abort`` with exit 1, which also kills the rank's worker processes).
    Returns the thread, or None when the process was not started by torchrun."""
    env = os.environ if env is None else env
    if not env.get("TORCHELASTIC_RUN_ID"):
        return None
    agent = env.get(AGENT_PID_ENV, "")
    parent = int(agent) if agent.isdigit() else os.getppid()  # an agent that died before this line: orphaned
    owners = [parent] + [int(p) for p in [env.get(LAUNCHER_PID_ENV, "")] if p.isdigit()]
    if on_orphan is None:
        def on_orphan(message: str) -> None:
            abort(1, message, stacks=False)

    def watch() -> None:
        gone = _wait_any_exit(owners, parent, poll_s)
        who = "the torchrun agent" if gone == parent else "launch/torchrun.sh"
        on_orphan(f"{who} (pid {gone}) has ended: this rank exits too (a job never outlives its launcher)")

    thread = threading.Thread(target=watch, name="megatron-rl-lifeline", daemon=True)
    thread.start()
    return thread


def main(argv: Optional[List[str]] = None) -> int:
    """``--parent PID -- CMD...``: new session, parent-death signal SIGKILL, then exec ``CMD``."""
    p = argparse.ArgumentParser(prog="python -m megatron_rl.lifeline",
                                description="run CMD in a new session that the kernel kills when PID ends")
    p.add_argument("--parent", type=int, required=True, help="pid whose end ends CMD (the launcher)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command after --")
    if os.getpgrp() != os.getpid():  # a group leader (started by a shell with job control) cannot setsid, and
        os.setsid()                  # is out of the launcher's process group already
    set_parent_death_signal(signal.SIGKILL)
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # exec keeps the pid: the ranks' parent
    if os.getppid() != args.parent:  # the launcher ended before the signal was armed
        print(f"megatron_rl.lifeline: launcher pid {args.parent} has already ended; not starting "
              f"{cmd[0]}", file=sys.stderr)
        return 1
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())

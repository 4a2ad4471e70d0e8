"""The pipes between a process and its worker processes (reward workers, environment workers): length-prefixed
pickle frames over the worker's stdin / stdout, and ending a worker. A light module on purpose: a worker imports
it first and starts without torch.

    write_frame(proc.stdin, request)     # one frame: 8-byte little-endian length + pickle
    reply = read_frame(proc.stdout)      # EOFError when the other side closed the stream
    kill_worker(proc)                    # SIGKILL by its pid, reap it, close its pipes
    proto_in, proto_out = worker_streams()   # in the worker, first: its end of the pipes

A worker ignores SIGINT / SIGTERM (a Ctrl-C or a Slurm preemption signals every process of the job: the trainer
must be able to finish its step and checkpoint while its workers keep answering; the parent ends them by pid) and
asks the kernel to SIGKILL it when its parent dies (a trainer killed outright leaves no worker behind).
"""
from __future__ import annotations

import ctypes
import os
import pickle
import signal
import struct
import sys

__all__ = ["write_frame", "read_frame", "kill_worker", "worker_streams"]

_HEADER = struct.Struct("<Q")


def write_frame(fh, obj) -> None:
    """Write one length-prefixed pickle to a binary stream and flush."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    fh.write(_HEADER.pack(len(data)) + data)
    fh.flush()


def read_frame(fh):
    """Read one length-prefixed pickle; EOFError when the stream ended."""
    head = fh.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("worker stream closed")
    size = _HEADER.unpack(head)[0]
    data = fh.read(size)
    if len(data) < size:
        raise EOFError("worker stream closed mid-message")
    return pickle.loads(data)


def kill_worker(proc) -> None:
    """Kill a worker ``subprocess.Popen`` (by its pid), reap it and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for fh in (proc.stdin, proc.stdout):
        try:
            fh.close()
        except OSError:
            pass


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_streams():
    """In a worker process, before anything else: ignore SIGINT / SIGTERM, die with the parent (Linux), and
    return ``(proto_in, proto_out)``, the binary streams of the parent's pipes; ``print`` in user code (rewards,
    environments) then goes to stderr and cannot corrupt the frames."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's kill by pid still ends it
        pass
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto_in, proto_out

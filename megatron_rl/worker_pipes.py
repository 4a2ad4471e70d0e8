"""The pipes between a process and its worker processes (reward workers, environment workers): length-prefixed
pickle frames over the worker's stdin / stdout, and ending a worker. A light module on purpose: a worker imports
it first and starts without torch.

    write_frame(proc.stdin, request)     # one frame: 8-byte little-endian length + pickle
    reply = read_frame(proc.stdout)      # EOFError when the other side closed the stream
    kill_worker(proc)                    # SIGKILL by its pid, reap it, close its pipes
"""
from __future__ import annotations

import pickle
import struct

__all__ = ["write_frame", "read_frame", "kill_worker"]

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

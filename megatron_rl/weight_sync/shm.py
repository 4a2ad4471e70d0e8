"""Same-host shared memory for the weight sync: byte buffers one process writes and another maps.

A ``Segment`` is an anonymous memory file (``memfd_create``): the writer creates it and keeps its descriptor, the
reader maps it through ``/proc/<writer pid>/fd/<fd>`` and drops the descriptor at once. The one rule: nothing is ever
named in ``/dev/shm``, so no exit path -- a failed sync, a killed rank, a killed job -- can leave a segment behind;
the memory is freed when the last process that maps it lets go or exits. A reader checks that the file it opened is
the writer's segment (its key is in the memory file's name): the same ``/proc`` path names another process's file
in another pid namespace or on another host.
"""
from __future__ import annotations

import glob
import mmap
import os
import secrets
from typing import Tuple

import torch

#: Most bytes of pieces per rank in one ``shm`` TP / ETP gather batch (``gather``): the sender copies a batch in
#: while the others write the next one (smaller batches overlap more, each costs one exchange of the group: ~0.3 ms,
#: a memcpy of ~3 MiB).
BATCH_CAP = 16 << 20
#: The smallest ``shm`` gather slot (the floor of a batch; ``gather._Slots``).
MIN_SLOT = 1 << 20

__all__ = ["available", "Segment", "leftovers", "segment_bytes"]

_PREFIX = "megatron_rl_ws_"


def available() -> bool:
    """Whether this host offers anonymous shared memory files a peer can map (Linux: ``memfd_create`` + ``/proc``)."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


class Segment:
    """``nbytes`` of shared memory as a uint8 tensor (``tensor``): ``Segment.create`` (writer) or ``Segment.attach``
    (reader, by the writer's ``path``)."""

    def __init__(self, path: str, key: str, nbytes: int, fd: int, owner: bool):
        # path: where a reader opens it; key: unique per segment of a host (a fd number, so a path, may be reused)
        self.path, self.key, self.nbytes = path, key, int(nbytes)
        self._fd = fd if owner else None
        try:
            self._mm = mmap.mmap(fd, self.nbytes)
        finally:
            if not owner:
                os.close(fd)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        """The bytes (1-D uint8 over the mapping)."""

    @classmethod
    def create(cls, label: str, nbytes: int) -> "Segment":
        """A new segment of ``max(nbytes, 1)`` bytes (``label``: its name in ``/proc/<pid>/fd``, for people)."""
        nbytes = max(int(nbytes), 1)
        key = f"{os.getpid()}_{secrets.token_hex(8)}"  # random: pids repeat across pid namespaces and hosts
        fd = os.memfd_create(f"{_PREFIX}{label}_{key}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            return cls(f"/proc/{os.getpid()}/fd/{fd}", key, nbytes, fd, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, path: str, key: str, nbytes: int) -> "Segment":
        """Map the writer's segment ``path`` whose key is ``key`` (``OSError`` when it is gone, cannot be opened
        here -- ``/proc`` access refused -- or ``path`` names another file: another host or pid namespace)."""
        fd = os.open(path, os.O_RDWR)
        try:
            opened = os.readlink(f"/proc/self/fd/{fd}")
            if not (opened.startswith(f"/memfd:{_PREFIX}") and f"_{key} " in f"{opened} "):
                raise OSError(f"{path} is {opened!r}, not the weight-sync segment {key} (another host or pid "
                              f"namespace)")
            if os.fstat(fd).st_size < int(nbytes):
                raise OSError(f"shared-memory segment {path} holds fewer than {nbytes} bytes (not the writer's)")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, key, nbytes, fd, owner=False)

    def close(self) -> None:
        """The writer's descriptor (the memory lives while a process maps it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def leftovers() -> list:
    """Weight-sync names in ``/dev/shm`` (tests: always none)."""
    return sorted(glob.glob("/dev/shm/megatron_rl_ws_*"))


def segment_bytes(settings, largest_piece: int = 0, largest_tensor: int = 0) -> Tuple[int, int]:
    """(``tp_gather``, ``sender``): the bytes of one shared-memory segment a rank keeps for the syncs of a job with
    ``settings`` (``WeightSyncSettings``) -- what ``megatron-rl check`` counts; change it with the segments.

    * ``tp_gather``: held by each non-owner rank of a sender's TP (or ETP) group, one per group, when
      ``settings.tp_gather`` is "shm" (``gather._Slots``: two slots of a batch, ``B = max(min(bucket_bytes,
      gather.BATCH_CAP), 1 MiB)``; a piece larger than ``B`` gets a batch of its own and the slots grow to
      ``max(piece, 2 B)``): ``2 B``, or at most ``2 max(largest_piece, 2 B)``; 0 without a split piece.
    * ``sender``: held by each sender other than rank 0 whose buckets reach an engine in rank 0's process through
      shared memory (``settings.sender_transport`` "shm"; ``in_process``): a bucket, or the largest tensor when that
      is larger (``buckets.bucketize`` asks its ``alloc`` for ``max(bucket_bytes, n)``).

    ``largest_piece``: bytes of the largest piece of a split parameter the rank writes; ``largest_tensor``: of the
    largest tensor a sender packs; both in the engine's dtype."""
    batch = max(min(int(settings.bucket_bytes), BATCH_CAP), MIN_SLOT)
    slot = batch if largest_piece <= batch else max(int(largest_piece), 2 * batch)
    gather = 2 * slot if settings.tp_gather == "shm" and largest_piece > 0 else 0
    sender = max(int(settings.bucket_bytes), int(largest_tensor)) if settings.sender_transport == "shm" else 0
    return gather, sender

"""megatron-core's checkpoint file writer, replaced by one that cannot hang: files are written on threads
of the saving rank and every failure comes back as an error.

Why (applies on every device, not a CPU patch): megatron-core 0.16's ``FileSystemWriterAsync`` writes a
synchronous ``dist_checkpointing.save`` by forking one child process per file bucket and then waits on a
``JoinableQueue`` that each child releases only at the very end of its work. A child that dies before
that point — it imported psutil outside its ``try`` (``pip install psutil`` missing), was OOM-killed, or
was SIGKILLed — leaves the rank waiting forever with no output (seen: every rank of the quickstart idle at
its first checkpoint). The results also travel through a ``multiprocessing`` Manager, one more spawned
process per rank.

``install()`` replaces the two places of that design:

* ``FileSystemWriterAsync.write_preloaded_data_multiproc`` -> ``write_buckets_in_process``: the same
  files written by a thread pool in the saving process (file I/O releases the GIL), with fsync. Its
  outcome — the write results, or the first error prefixed with the rank and the file — goes to the
  results queue exactly as megatron's workers report theirs, so megatron's own finalize step raises
  ``CheckpointException`` on every rank.
* ``filesystem_async._get_write_results_queue`` -> an in-process ``queue.Queue`` (no Manager process).

The project saves synchronously only (the RL loop saves between steps; an async save would have to
overlap a weight sync that reads the same parameters), so nothing needs a cross-process queue.
``last_write_error()`` returns this rank's error text of the latest failed write, which
``actor/checkpoint.save_checkpoint`` gathers so every rank's error names the failing rank and cause.
"""
from __future__ import annotations

import inspect
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

__all__ = ["install", "write_buckets_in_process", "last_write_error"]

_LOCK = threading.Lock()
_QUEUE: "queue.Queue" = queue.Queue()
_LAST_ERROR: Optional[str] = None
_INSTALLED = False


def last_write_error() -> Optional[str]:
    """This rank's error of the latest checkpoint write that failed (None if it succeeded)."""
    return _LAST_ERROR


def _results_queue() -> "queue.Queue":
    return _QUEUE


def write_bucket(transform_list: list, use_msc: bool, bucket) -> list:
    """Write one bucket (file name, storage key, (bytes items, tensor items)) and fsync it; returns its
    ``WriteResult`` list. The body of megatron's ``write_preloaded_data`` without its process plumbing."""
    from torch.distributed.checkpoint.filesystem import _write_item

    file_name, storage_key, (bytes_data, tensor_data) = bucket
    extra = {}
    if "serialization_format" in inspect.signature(_write_item).parameters:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        extra["serialization_format"] = SerializationFormat.TORCH_SAVE
    if use_msc:
        import multistorageclient as msc

        open_file = msc.open
    else:
        open_file = open
    results = []
    with open_file(file_name, "wb") as stream:
        for item, data in bytes_data:
            results.append(_write_item(*transform_list, stream, data, item, storage_key, **extra))
        for item, tensor in tensor_data:
            if not tensor.is_cpu:
                raise RuntimeError(f"checkpoint bucket {file_name}: tensor {item.index.fqn} is on {tensor.device}, "
                                   f"expected host memory after preload")
            results.append(_write_item(*transform_list, stream, tensor, item, storage_key, **extra))
        if use_msc:
            stream.fsync()
        else:
            stream.flush()
            os.fsync(stream.fileno())
    return results


def write_buckets_in_process(transform_list: List, use_msc: bool, rank: int, write_buckets: List,
                             global_results_queue) -> None:
    """Replacement of ``FileSystemWriterAsync.write_preloaded_data_multiproc`` (same arguments): write
    every bucket on a thread of this process, then put ``{bucket index: [WriteResult]}`` — or the first
    error, naming the rank and the file — into ``global_results_queue``."""
    global _LAST_ERROR
    _LAST_ERROR = None
    outcome: object = {}
    with ThreadPoolExecutor(max_workers=max(1, len(write_buckets)), thread_name_prefix="ckpt-writer") as pool:
        futures = [pool.submit(write_bucket, transform_list, use_msc, b) for b in write_buckets]
        for i, (bucket, fut) in enumerate(zip(write_buckets, futures)):
            try:
                outcome[i] = fut.result()
            except Exception as exc:  # noqa: BLE001 - reported through megatron's results protocol
                _LAST_ERROR = f"rank {rank}: writing {bucket[0]} failed: {type(exc).__name__}: {exc}"
                outcome = RuntimeError(_LAST_ERROR)
                break
    global_results_queue.put(outcome)


def install() -> None:
    """Replace megatron-core's forked writer and its Manager queue (idempotent)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

        fa.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_buckets_in_process)
        fa._get_write_results_queue = _results_queue
        _INSTALLED = True

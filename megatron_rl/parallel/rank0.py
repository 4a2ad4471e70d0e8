"""Work that only global rank 0 does, with its outcome reaching every rank (so no rank waits for a dead one).

Rank 0 owns the task, the rollout engine and the file system side of a run; the other ranks must learn
whether that work failed, or they would wait in their next collective until its timeout. The pattern is
written once here:

    engine = on_rank0(lambda: build_engine(cfg), what="set up the rollout engine")   # rank 0: the engine; others: None
    batch = from_rank0(lambda: source.next(step))                                  # every rank: rank 0's batch
    choice = share_from_rank0(value if rank0 else None)                             # a plain broadcast

An exception on rank 0 is raised on every rank (``what`` given: wrapped in a ``RuntimeError`` naming it, except
the types in ``passthrough``, which arrive as they were raised). Collective over the default group.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple, Type, TypeVar

import torch.distributed as dist

__all__ = ["share_from_rank0", "on_rank0", "from_rank0", "is_rank0"]

T = TypeVar("T")


def is_rank0() -> bool:
    """This process is global rank 0 (True without a process group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def share_from_rank0(obj: Optional[object]) -> object:
    """Broadcast a picklable object (rollouts, or an exception to re-raise) from global rank 0."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _run(fn: Callable[[], T], what: Optional[str], passthrough: Tuple[Type[BaseException], ...]):
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank by the caller
        if what is None or isinstance(exc, passthrough):
            return None, exc
        error = RuntimeError(f"rank 0: {what} failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return None, error


def on_rank0(fn: Callable[[], T], what: Optional[str] = None,
             passthrough: Tuple[Type[BaseException], ...] = ()) -> Optional[T]:
    """Run ``fn`` on rank 0 only and share only whether it failed: its result on rank 0, None elsewhere
    (for what cannot or need not travel: an engine, a task). A failure is raised on every rank."""
    result, error = _run(fn, what, passthrough) if is_rank0() else (None, None)
    error = share_from_rank0(error)
    if error is not None:
        raise error
    return result


def from_rank0(fn: Callable[[], T], what: Optional[str] = None,
               passthrough: Tuple[Type[BaseException], ...] = ()) -> T:
    """Run ``fn`` on rank 0 only and return its (picklable) result on every rank; a failure is raised on every
    rank."""
    box = _run(fn, what, passthrough) if is_rank0() else (None, None)
    result, error = share_from_rank0(box)
    if error is not None:
        raise error
    return result

"""Work that only global rank 0 does, with its outcome reaching every rank (so no rank waits for a dead one).

Rank 0 owns the task, the rollout engine and the file system side of a run; the other ranks must learn
whether that work failed, or they would wait in their next collective until its timeout. The pattern is
written once here:

    engine = on_rank0(lambda: build_engine(cfg), what="setting up the rollout engine")  # rank 0: the engine; others: None
    batch = from_rank0(lambda: generator.generate(engine, step, version))           # every rank: rank 0's batch
    part, whole = scatter_from_rank0(make, split)   # each rank: only its own piece of rank 0's result
    choice = share_from_rank0(value if rank0 else None)                             # a plain broadcast

An exception on rank 0 is raised on every rank (``what`` given: wrapped in a ``RuntimeError`` naming it, except
the types in ``passthrough``, which arrive as they were raised): rank 0 raises its own exception, the others a
copy (an exception that cannot be pickled arrives as a ``RuntimeError`` with its text). Collective over the default
group; ``fn`` runs on rank 0 alone, so it must not be a collective itself.
"""
from __future__ import annotations

import pickle
from typing import Callable, List, Optional, Tuple, Type, TypeVar

import torch.distributed as dist

__all__ = ["share_from_rank0", "on_rank0", "from_rank0", "scatter_from_rank0", "is_rank0"]

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


def _shareable(exc: BaseException) -> BaseException:
    """``exc`` itself when it pickles (the other ranks raise the same type), else a ``RuntimeError`` with its text."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001 - e.g. an exception holding a lock, a socket or a handle
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _run(fn: Callable[[], T], what: Optional[str], passthrough: Tuple[Type[BaseException], ...]):
    """Rank 0: ``(result, None)`` or ``(None, the exception to raise everywhere)``."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank by the caller
        if what is None or isinstance(exc, passthrough):
            return None, exc
        error = RuntimeError(f"rank 0: {what} failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return None, error


def _finish(result, local: Optional[BaseException], shared: Optional[BaseException]):
    """Raise the failure on every rank: rank 0 its own exception (with its traceback), the others rank 0's copy."""
    if local is not None:
        raise local
    if shared is not None:
        raise shared
    return result


def on_rank0(fn: Callable[[], T], what: Optional[str] = None,
             passthrough: Tuple[Type[BaseException], ...] = ()) -> Optional[T]:
    """Run ``fn`` on rank 0 only and share only whether it failed: its result on rank 0, None elsewhere
    (for what cannot or need not travel: an engine, a task). A failure is raised on every rank."""
    result, local = _run(fn, what, passthrough) if is_rank0() else (None, None)
    shared = share_from_rank0(None if local is None else _shareable(local))
    return _finish(result, local, shared)


def from_rank0(fn: Callable[[], T], what: Optional[str] = None,
               passthrough: Tuple[Type[BaseException], ...] = ()) -> T:
    """Run ``fn`` on rank 0 only and return its (picklable) result on every rank; a failure is raised on every
    rank. ``fn`` must not itself be a collective (it runs on rank 0 alone)."""
    result, local = _run(fn, what, passthrough) if is_rank0() else (None, None)
    result, shared = share_from_rank0((result, None if local is None else _shareable(local)))
    return _finish(result, local, shared)


def scatter_from_rank0(fn: Callable[[], T], split: Callable[[T], List[object]], what: Optional[str] = None,
                       passthrough: Tuple[Type[BaseException], ...] = (),
                       group: Optional[dist.ProcessGroup] = None) -> Tuple[object, Optional[T]]:
    """Run ``fn`` on rank 0 only, cut its result into one picklable piece per global rank (``split``: a list of
    world-size pieces) and send each rank its own piece alone (``scatter_object_list`` over ``group``: every rank,
    default the default group; a gloo group keeps the pickled pieces in host memory). Returns ``(this rank's
    piece, fn's result on rank 0 / None elsewhere)``; a failure of ``fn`` or ``split`` is raised on every rank."""
    if not dist.is_initialized():
        result = fn()
        return split(result)[0], result
    pieces, local, result = None, None, None
    if is_rank0():
        def run():
            out = fn()
            parts = split(out)
            if len(parts) != dist.get_world_size():
                raise RuntimeError(f"scatter_from_rank0: {len(parts)} pieces for {dist.get_world_size()} ranks")
            return out, parts
        both, local = _run(run, what, passthrough)
        if both is not None:
            result, pieces = both
    shared = share_from_rank0(None if local is None else _shareable(local))
    _finish(None, local, shared)
    box: List[object] = [None]
    dist.scatter_object_list(box, pieces if is_rank0() else None, src=0, group=group)
    return box[0], result

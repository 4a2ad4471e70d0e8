"""Work that only global rank 0 does, with its outcome reaching every rank (so no rank waits for a dead one).

Rank 0 owns the task, the rollout engine and the file system side of a run; the other ranks must learn
whether that work failed, or they would wait in their next collective until its timeout. The pattern is
written once here:

    engine = on_rank0(lambda: plan.build_engine(), what="setting up the rollout engine")  # rank 0: the engine; others: None
    batch = from_rank0(lambda: generator.generate(engine, step, version))           # every rank: rank 0's batch
    part, whole = scatter_from_rank0(make, split)   # each rank: only its own piece (split -> Pieces)
    choice = share_from_rank0(value if rank0 else None)                             # a plain broadcast
    err = share_from_rank0(err, group, waiting="waiting for ...")  # a failed wait names what it waited for

An exception on rank 0 is raised on every rank (``what`` given: wrapped in a ``RuntimeError`` naming it, except
the types in ``passthrough``, which arrive as they were raised): rank 0 raises its own exception, the others a
copy (an exception that cannot be pickled arrives as a ``RuntimeError`` with its text). Collective over the default
group; ``fn`` runs on rank 0 alone, so it must not be a collective itself.
"""
from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Callable, Hashable, List, Optional, Tuple, Type, TypeVar

import torch
import torch.distributed as dist

from megatron_rl.parallel.devices import recv_, send_

__all__ = ["share_from_rank0", "on_rank0", "from_rank0", "scatter_from_rank0", "Pieces", "is_rank0"]

T = TypeVar("T")


def is_rank0() -> bool:
    """This process is global rank 0 (True without a process group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def share_from_rank0(obj: Optional[object], group: Optional[dist.ProcessGroup] = None,
                     waiting: Optional[str] = None) -> object:
    """Broadcast a picklable object (rollouts, or an exception to re-raise) from global rank 0 (over ``group``, a
    group of every rank; default the default group). ``waiting``: what the other ranks wait for; when the wait
    itself fails on one of them (the group's timeout, rank 0 gone) it raises a ``RuntimeError`` naming it, not the
    bare backend error."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=0, group=group)
    except Exception as exc:  # noqa: BLE001 - the wait for rank 0 failed: say for what
        if waiting is None or is_rank0():
            raise
        raise RuntimeError(f"rank {dist.get_rank()}: {waiting}: {type(exc).__name__}: {exc}") from exc
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


@dataclass
class Pieces:
    """How a result of rank 0 is cut for ``scatter_from_rank0``: which piece each global rank receives (``keys``:
    ranks with equal keys receive the same piece) and how rank 0 makes a piece (``make``), one at a time."""

    keys: List[Hashable]
    """Per global rank: the key of its piece."""
    make: Callable[[Hashable], object]
    """A key's piece (picklable)."""


def _pickled(obj: object) -> torch.Tensor:
    """``obj`` pickled, as a uint8 tensor over the pickle's own buffer (no copy)."""
    buf = io.BytesIO()
    pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)


def _send_pieces(pieces: Pieces, group: Optional[dist.ProcessGroup]) -> Tuple[object, Optional[BaseException]]:
    """Rank 0: pickle each distinct piece once, send it to each rank whose key it is (its size, then its bytes),
    drop it, go on. Returns rank 0's own piece (never pickled) and the failure to make or pickle a piece (the
    ranks still waiting then receive size 0)."""
    keys, failure, own = pieces.keys, None, None
    try:
        own = pieces.make(keys[0])
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the caller
        failure = exc
    for key in dict.fromkeys(keys[1:]):
        data = torch.empty(0, dtype=torch.uint8)
        if failure is None:
            try:
                data = _pickled(pieces.make(key))
            except Exception as exc:  # noqa: BLE001 - raised on every rank by the caller
                failure = exc
        for dst in (r for r in range(1, len(keys)) if keys[r] == key):
            send_(torch.tensor([data.numel()], dtype=torch.int64), dst, group=group)
            if data.numel():
                send_(data, dst, group=group)
        del data
    if failure is None:
        return own, None
    error = RuntimeError(f"rank 0: cutting its result into each rank's piece failed: {type(failure).__name__}: "
                         f"{failure}")
    error.__cause__ = failure
    return None, error


def _receive_piece(group: Optional[dist.ProcessGroup]) -> object:
    """A rank other than 0: its piece (size, then bytes, from rank 0); None when rank 0 sent none (size 0)."""
    size = int(recv_(torch.zeros(1, dtype=torch.int64), 0, group=group).item())
    if size == 0:
        return None
    data = recv_(torch.empty(size, dtype=torch.uint8), 0, group=group)
    return pickle.loads(memoryview(data.numpy()))


def scatter_from_rank0(fn: Callable[[], T], split: Callable[[T], Pieces], what: Optional[str] = None,
                       passthrough: Tuple[Type[BaseException], ...] = (),
                       group: Optional[dist.ProcessGroup] = None,
                       waiting: Optional[str] = None) -> Tuple[object, Optional[T]]:
    """Run ``fn`` on rank 0 only, cut its result (``split``: the ``Pieces`` of every global rank) and send each
    rank its own piece alone, point to point over ``group`` (every rank; default the default group; a gloo group
    keeps the bytes in host memory, ``parallel.devices`` stages them where another backend needs them). Rank 0
    pickles each distinct piece once and holds one pickled piece at a time; a rank receives and holds only its
    own. Returns ``(this rank's piece, fn's result on rank 0 / None elsewhere)``; a failure of ``fn``, ``split``
    or of making or pickling any piece is raised on every rank; every wait is bounded by ``group``'s timeout.
    ``waiting``: what the other ranks wait for while ``fn`` runs; when that wait itself fails on one of them (the
    group's timeout, rank 0 gone) it raises a ``RuntimeError`` naming it, not the bare backend error."""
    if not dist.is_initialized():
        result = fn()
        pieces = split(result)
        return pieces.make(pieces.keys[0]), result
    pieces, local, result = None, None, None
    if is_rank0():
        def run():
            out = fn()
            cut = split(out)
            if len(cut.keys) != dist.get_world_size():
                raise RuntimeError(f"scatter_from_rank0: {len(cut.keys)} pieces for {dist.get_world_size()} ranks")
            return out, cut
        both, local = _run(run, what, passthrough)
        if both is not None:
            result, pieces = both
    shared = share_from_rank0(None if local is None else _shareable(local), group, waiting)
    _finish(None, local, shared)
    piece, local = _send_pieces(pieces, group) if is_rank0() else (_receive_piece(group), None)
    shared = share_from_rank0(None if local is None else _shareable(local), group)  # every rank learns of a failure
    return _finish(piece, local, shared), result

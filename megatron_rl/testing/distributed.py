"""Run a function on N gloo ranks forked from the current process, with a hard timeout.

Forking from a parent that already imported torch/megatron makes a multi-rank test cost
~0.3 s instead of ~3 s of imports per rank. Each rank:
  * sets ``OMP_NUM_THREADS=1`` / ``torch.set_num_threads(1)`` (oversubscription on 2 cores makes
    steps 25-70x slower),
  * joins a gloo process group through a ``FileStore`` (no port races) on 127.0.0.1,
  * runs ``fn(rank, world_size, *args)`` and returns its result to the parent (``torch.save`` bytes,
    so tensors survive the child's exit).

A rank that raises makes ``run_ranks`` raise ``RankError`` with that rank's traceback; if any rank
does not finish within ``timeout`` seconds every rank is killed and ``TimeoutError`` is raised —
a hang fails the test instead of stalling CI.

Usage::

    def body(rank, world, x):
        import torch.distributed as dist
        t = torch.tensor([float(rank)]); dist.all_reduce(t); return t
    results = run_ranks(body, 2, torch.ones(1), timeout=60)   # list indexed by rank
"""
from __future__ import annotations

import datetime
import io
import os
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank raised; the message carries its rank and traceback."""


def _worker(fn, rank, world_size, store_path, conn, args, kwargs, timeout):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1"})
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        open(f"{store_path}.joined.{rank}", "w").close()
        out = fn(rank, world_size, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(out, buf)
        conn.send(("ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        conn.send(("err", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                _wait_joined(store_path, world_size, timeout)
                dist.destroy_process_group()
        except Exception:
            pass
        conn.close()


def _wait_joined(store_path: str, world_size: int, timeout: float) -> None:
    """Before a rank tears its process group down: wait (bounded) until every rank has finished joining it. A rank
    that returns at once (a test whose body needs no collective) would otherwise close its gloo sockets while a
    slower rank is still connecting its mesh ("Connection closed by peer" there, under load)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(f"{store_path}.joined.{r}") for r in range(world_size)):
            return
        time.sleep(0.01)


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout: float = 120.0,
              **kwargs) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked gloo ranks.

    Returns the per-rank results (index = rank). Raises ``RankError`` (first failing rank, with
    traceback) or ``TimeoutError`` (names the ranks still running) — never hangs.
    """
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("fork")
    tmpdir = tempfile.mkdtemp(prefix="mrl_dist_")
    store_path = os.path.join(tmpdir, "store")
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        # not daemonic: ranks may start processes of their own (e.g. megatron's checkpoint writers);
        # the finally-block below kills every rank still alive, so none outlives the call
        p = ctx.Process(target=_worker, daemon=False,
                        args=(fn, rank, world_size, store_path, child_conn, args, kwargs, timeout))
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    results: List[Any] = [None] * world_size
    done = [False] * world_size
    errors = []
    deadline = time.monotonic() + timeout
    try:
        while not all(done):
            if time.monotonic() > deadline:
                pending = [r for r in range(world_size) if not done[r]]
                raise TimeoutError(f"run_ranks: ranks {pending} did not finish within {timeout:.0f}s "
                                   f"(hang or deadlock); all ranks killed")
            progressed = False
            for r, c in enumerate(conns):
                if done[r]:
                    continue
                if c.poll(0.01):
                    try:
                        status, payload = c.recv()
                    except EOFError:
                        status, payload = "err", f"rank {r} exited without a result (exit code {procs[r].exitcode})"
                    done[r] = True
                    progressed = True
                    if status == "ok":
                        results[r] = torch.load(io.BytesIO(payload), weights_only=False)
                    else:
                        errors.append((r, payload))
                elif not procs[r].is_alive() and not c.poll(0):
                    done[r] = True
                    errors.append((r, f"rank {r} died with exit code {procs[r].exitcode}"))
            if errors:
                break
            if not progressed:
                time.sleep(0.005)
    finally:
        if all(done) and not errors:
            # finished ranks exit on their own; let them (and children they started, e.g. megatron's
            # checkpoint-writer Manager) shut down instead of orphaning those children
            for p in procs:
                p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        try:
            for f in os.listdir(tmpdir):
                os.unlink(os.path.join(tmpdir, f))
            os.rmdir(tmpdir)
        except OSError:
            pass
    if errors:
        r, tb = errors[0]
        raise RankError(f"rank {r} of {world_size} failed:\n{tb}")
    return results

"""``EnvPool``: the environments of multi-turn trajectories, run out of process under a per-call timeout.

A user environment may raise, hang or return nonsense; none of that may stall or crash the training step. A
trajectory key is pinned to one worker process (``python -m megatron_rl.envs.env_worker``), which holds its
environment's state; a worker that hangs is killed (by pid) and replaced, and the environments it held are lost
with it (their next calls answer ``env_timeout`` naming the trajectory that hung). ``workers=0`` runs them in
this process, unbounded (tests, debugging). Failure kinds, start-up and release rules: docs/environments.md.

    pool = EnvPool("my_envs:Calculator", {}, workers=2, step_timeout_s=10.0)
    pool.reset(["a", "b"], [row_a, row_b])                 # [None, None]
    pool.step(["a", "b"], [turn_text_a, turn_text_b])      # [EnvStep(...), EnvFailure("env_timeout", "...")]
    pool.close()
"""
from __future__ import annotations

import atexit
import collections
import os
import pickle
import select
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Deque, Dict, Hashable, List, Optional, Sequence, Union

from megatron_rl.envs.base import EnvFailure, EnvStep, load_env_class
from megatron_rl.envs.env_worker import EnvHost
from megatron_rl.errors import RolloutError
from megatron_rl.parallel.child_env import child_environment
from megatron_rl.worker_pipes import kill_worker, read_frame, write_frame


class EnvPoolError(RolloutError):
    """The pool could not serve a call (a worker that does not start): the step fails on every rank."""


@dataclass
class _Job:
    """One request of a pool call."""

    #: Position of the answer in the call's result (-1: a release, no answer).
    index: int
    #: The trajectory key (a list of keys for a release).
    key: Any
    #: ``"reset"``, ``"step"`` or ``"release"``.
    op: str
    #: The sample (reset), the action text (step), None (release).
    payload: Any
    #: The worker slot of a release (others: the key's pinned slot).
    slot: int = -1


class _Worker:
    """One worker process, the request it is running and its deadline."""

    def __init__(self, spec: str, env_kwargs: Dict[str, Any]):
        """Start the process and send it the environment spec (``wait_ready`` waits for it to load)."""
        # the parent's import path, so `module:Class` environments import in the worker as they do here
        path = os.pathsep.join(p for p in sys.path if p)
        env = child_environment({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.envs.env_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.ready = False
        self.job: Optional[_Job] = None
        self.deadline = 0.0
        try:
            write_frame(self.proc.stdin, (spec, env_kwargs))
        except OSError:
            pass  # it died already: wait_ready says so

    def wait_ready(self, start_timeout_s: float) -> None:
        """Wait for "ready"; ``ValueError`` when the class cannot load there, ``RuntimeError`` past the limit."""
        if self.ready:
            return
        ready, _, _ = select.select([self.proc.stdout], [], [], start_timeout_s)
        msg = None
        if ready:
            try:
                msg = read_frame(self.proc.stdout)
            except (EOFError, pickle.UnpicklingError, OSError):
                msg = None
        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "error":
            self.kill()
            raise ValueError(msg[1])
        if msg != "ready":
            self.kill()
            raise RuntimeError(f"environment worker did not start within {start_timeout_s:g} s (exit code "
                               f"{self.proc.poll()}); run `{sys.executable} -m megatron_rl.envs.env_worker` "
                               "to see why")
        self.ready = True

    def send(self, job: _Job, timeout_s: float) -> None:
        """Send ``job``; it must answer within ``timeout_s``."""
        write_frame(self.proc.stdin, (job.op, job.key, job.payload))
        self.job = job
        self.deadline = time.monotonic() + timeout_s

    def kill(self) -> None:
        """Kill the process (by its pid) and close its pipes."""
        kill_worker(self.proc)


Result = Union[EnvStep, EnvFailure, None]


def _exit_code(proc: subprocess.Popen, wait_s: float = 2.0) -> Optional[int]:
    """``proc``'s exit code, waiting at most ``wait_s`` for it to end (None: still running)."""
    try:
        return proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return None


class EnvPool:
    """Environments in worker processes, pinned by trajectory key, each call under a timeout (module docstring)."""

    def __init__(self, spec: str, env_kwargs: Optional[Dict[str, Any]] = None, workers: int = 2,
                 step_timeout_s: float = 30.0, start_timeout_s: float = 120.0):
        """``spec``: ``multi_turn.env`` (``module:Class``); ``env_kwargs``: the class's keyword arguments;
        ``workers``: worker processes (0: in this process, no timeout); ``step_timeout_s``: the wall-clock limit
        of one environment call; ``start_timeout_s``: the limit of a worker's start-up."""
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ValueError(f"multi_turn.env_workers={workers!r} must be an int >= 0")
        if not isinstance(step_timeout_s, (int, float)) or isinstance(step_timeout_s, bool) \
                or not step_timeout_s > 0:
            raise ValueError(f"multi_turn.env_step_timeout_s={step_timeout_s!r} must be a number > 0")
        env_kwargs = dict(env_kwargs or {})
        try:
            pickle.dumps(env_kwargs)
        except Exception as e:
            raise ValueError(f"multi_turn.env_kwargs must be plain (picklable) data: {type(e).__name__}: {e}") \
                from e
        load_env_class(spec)  # a clear ValueError naming multi_turn.env before any worker starts
        self.spec, self.env_kwargs = spec, env_kwargs
        self.num_workers, self.step_timeout_s, self.start_timeout_s = workers, float(step_timeout_s), start_timeout_s
        self._host: Optional[EnvHost] = EnvHost(spec, env_kwargs) if workers == 0 else None
        #: Worker slots (None: not started yet).
        self._workers: List[Optional[_Worker]] = [None] * workers
        #: Slot of each live trajectory's environment.
        self._home: Dict[Hashable, int] = {}
        #: Trajectories whose environment died with its worker -> the failure their next call answers.
        self._lost: Dict[Hashable, EnvFailure] = {}
        self._finalizer = weakref.finalize(self, EnvPool._kill_all, self._workers)
        atexit.register(self._finalizer)

    @staticmethod
    def _kill_all(workers: List[Optional[_Worker]]) -> None:
        for i, w in enumerate(workers):
            if w is not None:
                w.kill()
                workers[i] = None

    def close(self) -> None:
        """Kill every worker this pool started (by pid) and forget every environment."""
        EnvPool._kill_all(self._workers)
        self._home.clear()
        self._lost.clear()

    def worker_pids(self) -> List[Optional[int]]:
        """The pid of each worker slot (None: not started)."""
        return [None if w is None else w.proc.pid for w in self._workers]

    def reset(self, keys: Sequence[Hashable], samples: Sequence[Dict[str, Any]]) -> List[Optional[EnvFailure]]:
        """A new environment for each key, reset with its sample; None where ready, else the failure."""
        keys = self._check_keys(keys, samples, "samples")
        load = collections.Counter(self._home.values())
        jobs = []
        for i, (key, sample) in enumerate(zip(keys, samples)):
            self._lost.pop(key, None)
            if key not in self._home:
                slot = min(range(len(self._workers)), key=lambda s: (load[s], s)) if self._workers else -1
                self._home[key] = slot
                load[slot] += 1
            jobs.append(_Job(i, key, "reset", sample))
        answers = self._run(jobs)
        results = [answers[i] for i in range(len(keys))]
        for key, result in zip(keys, results):
            if result is not None:
                self._home.pop(key, None)
        return results

    def step(self, keys: Sequence[Hashable], actions: Sequence[str]) -> List[Union[EnvStep, EnvFailure]]:
        """Each key's environment answers its action: ``EnvStep`` or ``EnvFailure``, in key order."""
        keys = self._check_keys(keys, actions, "actions")
        results: List[Result] = [None] * len(keys)
        jobs = []
        for i, (key, action) in enumerate(zip(keys, actions)):
            if not isinstance(action, str):
                raise TypeError(f"EnvPool.step: the action of trajectory {key!r} is {type(action).__name__}, "
                                "not str")
            if key in self._lost:
                results[i] = self._lost.pop(key)
            elif key in self._home:
                jobs.append(_Job(i, key, "step", action))
            else:
                raise ValueError(f"EnvPool.step: trajectory {key!r} has no environment (never reset, or it "
                                 "already answered done / a failure, or was released)")
        answers = self._run(jobs)
        for job in jobs:
            results[job.index] = result = answers[job.index]
            if not isinstance(result, EnvStep) or result.done:
                self._home.pop(job.key, None)
        return results

    def release(self, keys: Sequence[Hashable]) -> None:
        """Forget the environments of ``keys`` (trajectories the driver ended); unknown keys are ignored."""
        by_slot: Dict[int, List[Hashable]] = collections.defaultdict(list)
        for key in keys:
            self._lost.pop(key, None)
            slot = self._home.pop(key, None)
            if slot is not None:
                by_slot[slot].append(key)
        if self._host is not None:
            self._host.handle("release", list(keys), None)
            return
        self._run([_Job(-1, ks, "release", None, slot) for slot, ks in by_slot.items()])

    # ------------------------------------------------------------------ internals

    def _check_keys(self, keys, values, what) -> List[Hashable]:
        keys = list(keys)
        if len(keys) != len(values):
            raise ValueError(f"EnvPool: {len(keys)} keys but {len(values)} {what}")
        if len(set(keys)) != len(keys):
            raise ValueError("EnvPool: duplicate trajectory keys in one call")
        return keys

    def _where(self, key) -> str:
        return f"{self.spec} (trajectory {key!r})"

    def _run(self, jobs: List[_Job]) -> Dict[int, Result]:
        """Answers of ``jobs`` by ``job.index`` (releases answer nothing): in process, or sent to their slots'
        workers one at a time per worker, each under the timeout. If the pool itself fails half-way (a
        replacement worker that does not start), the workers with requests in flight are killed and replaced
        first, so the pool stays consistent, and ``EnvPoolError`` names the cause."""
        try:
            return self._run_jobs(jobs)
        except Exception as exc:
            for slot, w in enumerate(self._workers):
                if w is not None and w.job is not None:
                    self._fail(slot, w.job, {}, "env_exception", f"the pool failed: {type(exc).__name__}: {exc}")
            raise EnvPoolError(f"environment pool of {self.spec}: {type(exc).__name__}: {exc}") from exc

    def _run_jobs(self, jobs: List[_Job]) -> Dict[int, Result]:
        answers: Dict[int, Result] = {}
        if self._host is not None:
            for job in jobs:
                if job.index >= 0:
                    answers[job.index] = self._answer(job, self._host.handle(job.op, job.key, job.payload))
            return answers
        queues: Dict[int, Deque[_Job]] = collections.defaultdict(collections.deque)
        for job in jobs:
            queues[job.slot if job.op == "release" else self._home[job.key]].append(job)
        self._start_missing(sorted(queues))
        busy: Dict[Any, int] = {}
        while True:
            for slot, queue in queues.items():
                w = self._workers[slot]
                while queue and w.job is None:
                    job = queue.popleft()
                    if job.op == "step" and job.key in self._lost:  # its worker died earlier in this call
                        answers[job.index] = self._lost.pop(job.key)
                        continue
                    if job.op == "reset":  # (re)pinned here: its slot's worker may be a fresh replacement
                        self._home[job.key] = slot
                        self._lost.pop(job.key, None)
                    w.wait_ready(self.start_timeout_s)
                    try:
                        w.send(job, self.step_timeout_s)
                    except OSError as e:
                        self._fail(slot, job, answers, "env_exception",
                                   f"its worker (pid {w.proc.pid}) died before the request "
                                   f"({type(e).__name__}; exit code {_exit_code(w.proc)})")
                        w = self._workers[slot]
                        continue
                    busy[w.proc.stdout] = slot
            if not busy:
                return answers
            wait = max(0.0, min(self._workers[s].deadline for s in busy.values()) - time.monotonic())
            ready, _, _ = select.select(list(busy), [], [], wait)
            for fh in ready:
                slot = busy.pop(fh)
                w = self._workers[slot]
                job = w.job
                try:
                    reply = read_frame(fh)
                except (EOFError, pickle.UnpicklingError, OSError) as e:
                    self._fail(slot, job, answers, "env_exception",
                               f"its worker (pid {w.proc.pid}) died ({type(e).__name__}: {e}; exit code "
                               f"{_exit_code(w.proc)})")
                    continue
                w.job = None
                if job.index >= 0:
                    answers[job.index] = self._answer(job, reply)
            now = time.monotonic()
            for fh, slot in list(busy.items()):
                w = self._workers[slot]
                if now >= w.deadline:
                    busy.pop(fh)
                    self._fail(slot, w.job, answers, "env_timeout",
                               f"{w.job.op} did not answer within {self.step_timeout_s:g} s; its worker "
                               f"(pid {w.proc.pid}) was killed")

    def _answer(self, job: _Job, reply: Any) -> Result:
        """A worker's reply as the job's result (an unexpected reply is an ``env_exception``)."""
        if isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "fail":
            return EnvFailure(reply[1], reply[2])
        if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "ok":
            if job.op == "step" and isinstance(reply[1], EnvStep):
                return reply[1]
            if job.op != "step" and reply[1] is None:
                return None
        return EnvFailure("env_exception", f"{self._where(job.key)}: the worker answered {job.op} with "
                                           f"{type(reply).__name__}, not a protocol reply")

    def _fail(self, slot: int, job: _Job, answers: Dict[int, Result], kind: str, why: str) -> None:
        """``job`` failed with ``kind`` because its worker hung or died: kill and replace the worker; every other
        environment it held is lost (its next step answers ``kind``, naming ``job``'s trajectory)."""
        w = self._workers[slot]
        w.kill()
        self._workers[slot] = _Worker(self.spec, self.env_kwargs)
        if job.op == "release":
            culprit = f"a release of {self.spec} environments"
        else:
            culprit = self._where(job.key)
            if job.index >= 0:
                answers[job.index] = EnvFailure(kind, f"{self._where(job.key)}: {why}")
            self._home.pop(job.key, None)
        for key, home in list(self._home.items()):
            if home == slot and key != job.key:
                del self._home[key]
                self._lost[key] = EnvFailure(kind, f"{self._where(key)}: its environment was lost with its "
                                                   f"worker (pid {w.proc.pid}), replaced after {culprit} "
                                                   f"failed: {why}")

    def _start_missing(self, slots: List[int]) -> None:
        """Start the workers of ``slots`` that never started (all at once), then wait for them."""
        for slot in slots:
            if self._workers[slot] is None:
                self._workers[slot] = _Worker(self.spec, self.env_kwargs)
        for slot in slots:
            self._workers[slot].wait_ready(self.start_timeout_s)

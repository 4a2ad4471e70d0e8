"""Rewards computed in parallel worker processes, each sample under a wall-clock timeout.

A pathological response (a huge expression that sympy simplifies for minutes, a user reward that hangs)
must not stall the training step: ``RewardPool(num_workers, timeout_s).score(jobs)`` sends each job to an
idle worker (``python -m megatron_rl.tasks.reward_worker``, one job at a time per worker), waits with
``select``, and a worker still busy ``timeout_s`` after it got its job is killed (SIGKILL); a fresh one
starts when a job needs it.
A timed-out or failing job (the reward raised, returned a non-number or a dict without ``"score"``, or the
worker died) gets reward 0.0 and no extras, and is counted; ``score`` never raises for a job's failure. A dict
reward's other numeric keys come back per job (``RewardResult.extras``).

A job is ``RewardJob(spec, prompt_text, response_text, ground_truth, data_source, extra_info, kwargs, row)``:
plain data (``spec`` is the reward's string, see ``reward_fn.compute_reward``), pickled to the worker.
Workers start lazily (the first ``score``), import the rewards and warm math-verify before they take a
timed job (start-up is bounded by ``start_timeout_s`` separately), and live until ``close()`` (also at
interpreter exit). ``num_workers=0`` computes in this process, without timeouts (tests, debugging).

Usage::

    pool = RewardPool(num_workers=2, timeout_s=10.0)
    result = pool.score([RewardJob("math", "q", "\\\\boxed{2}", "2")])
    result.rewards, result.failed, result.timed_out        # [1.0], 0, 0
    result.extras                                          # [{}]: a dict reward's other numeric keys
    pool.close()
"""
from __future__ import annotations

import atexit
import os
import pickle
import select
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from megatron_rl.worker_pipes import kill_worker, read_frame, write_frame
from megatron_rl.parallel.child_env import child_environment
from megatron_rl.tasks.reward_fn import compute_reward_value



@dataclass(frozen=True)
class RewardJob:
    """One sample to score."""

    #: The reward spec (``"math"``, ``"exact"``, ``"source"`` or ``"module:function"``).
    spec: str
    #: The prompt as text.
    prompt_text: str
    #: The decoded response.
    response_text: str
    #: The reference answer.
    ground_truth: Any
    #: The row's ``data_source`` (verl format), if any.
    data_source: Optional[str] = None
    #: The row's ``extra_info`` (verl format), if any.
    extra_info: Any = None
    #: Keyword arguments of the reward function (``data.reward_kwargs``).
    kwargs: Dict[str, Any] = field(default_factory=dict)
    #: Where the prompt comes from (``"data.path='train.jsonl' row 3 (line 4)"``), for error messages; or None.
    row: Optional[str] = None


@dataclass
class RewardResult:
    """Rewards of a batch of jobs, in job order."""

    #: One float per job (0.0 for failed and timed-out jobs).
    rewards: List[float]
    #: Jobs whose reward raised or returned a bad value, or whose worker died.
    failed: int = 0
    #: Jobs that ran past the timeout (their worker was killed).
    timed_out: int = 0
    #: The first few error messages, for the log.
    errors: List[str] = field(default_factory=list)
    #: Per job: a dict reward's other numeric keys (``RewardValue.extras``; ``{}`` for a float reward), None for
    #: a failed or timed-out job; empty when the task does not report them (``Task.score``'s default).
    extras: List[Optional[Dict[str, float]]] = field(default_factory=list)
    #: Step metrics of the scorer itself (the judge's ``reward/judge_*``, a reward model's ``reward/rm_*``); empty
    #: for the rule rewards.
    metrics: Dict[str, float] = field(default_factory=dict)

    def extra_means(self) -> Dict[str, float]:
        """``reward_extra/<key>/mean``: each extra key's mean over the jobs that returned it."""
        sums: Dict[str, List[float]] = {}
        for e in self.extras:
            for k, v in (e or {}).items():
                sums.setdefault(k, []).append(v)
        return {f"reward_extra/{k}/mean": sum(v) / len(v) for k, v in sums.items()}


def run_job(job: RewardJob) -> tuple[bool, Any]:
    """``(True, RewardValue)`` or ``(False, error message naming the job's row)`` for one job, in this process."""
    try:
        return True, compute_reward_value(job.spec, job.prompt_text, job.response_text, job.ground_truth,
                                          job.data_source, job.extra_info, job.kwargs)
    except Exception as e:  # noqa: BLE001 - a failing reward is counted, never raised
        return False, f"{type(e).__name__}: {e}" + (f" ({job.row})" if job.row else "")


class _Worker:
    """One worker process and the job it is running."""

    def __init__(self):
        """Start the process (``wait_ready`` waits for its start-up)."""
        # the parent's import path, so `module:function` rewards import in the worker as they do here
        path = os.pathsep.join(p for p in sys.path if p)
        env = child_environment({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.tasks.reward_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.job_index: Optional[int] = None
        self.deadline = 0.0

    def wait_ready(self, start_timeout_s: float) -> "_Worker":
        """Wait for the worker's "ready" (imports done); kill it and raise ``RuntimeError`` past the limit."""
        ready, _, _ = select.select([self.proc.stdout], [], [], start_timeout_s)
        msg = None
        if ready:
            try:
                msg = read_frame(self.proc.stdout)
            except EOFError:
                msg = None
        if msg != "ready":
            self.kill()
            raise RuntimeError(f"reward worker did not start within {start_timeout_s} s (exit code "
                               f"{self.proc.poll()}); run `{sys.executable} -m megatron_rl.tasks.reward_worker` "
                               "to see why")
        return self

    def send(self, index: int, job: RewardJob, timeout_s: float) -> None:
        self.job_index = index
        self.deadline = time.monotonic() + timeout_s
        write_frame(self.proc.stdin, job)

    def kill(self) -> None:
        kill_worker(self.proc)


class RewardPool:
    """Parallel reward workers with a per-sample timeout (see the module docstring)."""

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, start_timeout_s: float = 120.0):
        """``num_workers``: worker processes (0: compute in this process, no timeout); ``timeout_s``: the
        wall-clock limit of one sample; ``start_timeout_s``: the limit of a worker's start-up."""
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
            raise ValueError(f"data.reward_workers={num_workers!r} must be an int >= 0")
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
            raise ValueError(f"data.reward_timeout_s={timeout_s!r} must be a number > 0")
        self.num_workers, self.timeout_s, self.start_timeout_s = num_workers, float(timeout_s), start_timeout_s
        self._workers: List[_Worker] = []
        self._finalizer = weakref.finalize(self, RewardPool._kill_all, self._workers)
        atexit.register(self._finalizer)

    @staticmethod
    def _kill_all(workers: List[_Worker]) -> None:
        for w in workers:
            w.kill()
        workers.clear()

    def close(self) -> None:
        """Stop every worker (a later ``score`` starts new ones)."""
        RewardPool._kill_all(self._workers)

    def score(self, jobs: Sequence[RewardJob]) -> RewardResult:
        """Rewards of ``jobs`` in order; failures and timeouts are 0.0 and counted."""
        result = RewardResult(rewards=[0.0] * len(jobs), extras=[None] * len(jobs))

        def fail(i: int, message: str, timed_out: bool = False) -> None:
            result.rewards[i] = 0.0
            if timed_out:
                result.timed_out += 1
            else:
                result.failed += 1
            if len(result.errors) < 5:
                result.errors.append(f"sample {i}: {message}")

        if self.num_workers == 0:
            for i, job in enumerate(jobs):
                ok, value = run_job(job)
                if ok:
                    result.rewards[i], result.extras[i] = value.score, dict(value.extras)
                else:
                    fail(i, value)
            return result
        pending = list(range(len(jobs)))[::-1]
        busy: Dict[Any, _Worker] = {}
        while pending or busy:
            # (re)start workers only while jobs wait for one (a killed worker is not replaced for nothing)
            idle = sum(w.job_index is None for w in self._workers)
            want = min(self.num_workers - len(self._workers), len(pending) - idle)
            if want > 0:
                starting = [_Worker() for _ in range(want)]
                self._workers.extend(w.wait_ready(self.start_timeout_s) for w in starting)
            for w in list(self._workers):
                if not pending:
                    break
                if w.job_index is None:
                    i = pending.pop()
                    try:
                        w.send(i, jobs[i], self.timeout_s)
                        busy[w.proc.stdout] = w
                    except (BrokenPipeError, OSError) as e:
                        fail(i, f"worker died before the job ({type(e).__name__})")
                        self._drop(w)
            if not busy:
                continue
            now = time.monotonic()
            wait = max(0.0, min(w.deadline for w in busy.values()) - now)
            ready, _, _ = select.select(list(busy), [], [], wait)
            for fh in ready:
                w = busy.pop(fh)
                i = w.job_index
                try:
                    ok, value = read_frame(fh)
                except (EOFError, pickle.UnpicklingError, OSError) as e:
                    fail(i, f"worker died ({type(e).__name__}: {e}; exit code {w.proc.poll()})")
                    self._drop(w)
                    continue
                w.job_index = None
                if ok:
                    result.rewards[i], result.extras[i] = value.score, dict(value.extras)
                else:
                    fail(i, value)
            now = time.monotonic()
            for fh, w in list(busy.items()):
                if now >= w.deadline:
                    busy.pop(fh)
                    fail(w.job_index, f"timed out after {self.timeout_s:g} s", timed_out=True)
                    self._drop(w)
        return result

    def _drop(self, worker: _Worker) -> None:
        """Kill ``worker`` and forget it (a fresh one starts when a job needs it)."""
        worker.kill()
        self._workers.remove(worker)

"""Asynchronous rollouts (``rollout.mode: async``): rank 0's producer thread generates the next steps' rollouts
while the trainer trains, never more than ``rollout.max_staleness`` versions behind.

Rule: the producer generates step ``t`` with exactly version ``max(t - k, start)`` (k = ``rollout.max_staleness``)
and owns every engine call once started (a weight update never races a generation), so finish mode is
deterministic and a resumed run reproduces it. Versions, partial rollouts and drained checkpoints:
docs/trainer.md.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_rl.rollout.base import Rollout, SamplingParams, StaleRolloutError
from megatron_rl.rollout.finish import normalised_finish, stop_ids
from megatron_rl.rollout.versions import parse_version, version_tag
from megatron_rl.rollout.routing import join_routing

__all__ = ["SegmentedEngine", "RolloutProducer", "SnapshotTimeout", "token_lag_tensor",
           "check_staleness", "overlap_seconds"]


class SegmentedEngine:
    """An engine view whose ``generate`` runs in segments of ``segment_tokens`` tokens, calling
    ``before_segment()`` between them (it may load newer weights into the engine). Each returned
    ``Rollout`` has ``info["token_versions"]`` (the version of every response token) and the weight version
    of its first token. ``segment_tokens <= 0``: one segment, a plain ``engine.generate`` call."""

    def __init__(self, engine, segment_tokens: int, before_segment: Callable[[], None]):
        self.engine = engine
        self.segment_tokens = int(segment_tokens)
        self.before_segment = before_segment

    @property
    def weight_version(self):
        return self.engine.weight_version

    def _call(self, prompts, sampling, n, seed):
        return self.engine.generate(prompts, sampling, n=n, seed=seed)  # ignored where not engine.seeded_sampling

    def generate(self, prompt_ids: List[List[int]], sampling: SamplingParams, n: int = 1,
                 seed: Optional[int] = None) -> List[Rollout]:
        seg, total = self.segment_tokens, sampling.max_new_tokens
        if seg <= 0 or seg >= total:
            out = self._call(prompt_ids, sampling, n, seed)
            for r in out:
                r.info["token_versions"] = [parse_version(r.weight_version)] * len(r.response_ids)
            return out
        stops = stop_ids(sampling, getattr(self.engine, "eos_token_ids", ()))
        out = self._call(prompt_ids, dataclasses.replace(sampling, max_new_tokens=seg), n, seed)
        rows = [dict(r=r, ids=list(r.response_ids), lps=list(r.rollout_log_probs),
                     versions=[parse_version(r.weight_version)] * len(r.response_ids),
                     finish=normalised_finish(r.finish_reason, r.response_ids, stops), routing=r.routed_experts)
                for r in out]
        done_tokens, segment = seg, 1
        while True:
            open_rows = [row for row in rows if row["finish"] == "length" and len(row["ids"]) == done_tokens]
            if not open_rows or done_tokens >= total:
                break
            self.before_segment()
            step_tokens = min(seg, total - done_tokens)
            cont = self._call([list(row["r"].prompt_ids) + row["ids"] for row in open_rows],
                              dataclasses.replace(sampling, max_new_tokens=step_tokens), 1,
                              None if seed is None else seed + 7919 * segment)
            for row, r in zip(open_rows, cont):
                row["routing"] = join_routing(row["routing"], r.routed_experts,
                                               len(row["r"].prompt_ids) + len(row["ids"]) - 1)
                row["ids"] += list(r.response_ids)
                row["lps"] += list(r.rollout_log_probs)
                row["versions"] += [parse_version(r.weight_version)] * len(r.response_ids)
                row["finish"] = normalised_finish(r.finish_reason, row["ids"], stops)
            done_tokens += step_tokens
            segment += 1
        result = []
        for row in rows:
            r = row["r"]
            info = dict(r.info, token_versions=row["versions"], segments=segment)
            result.append(Rollout(prompt_index=r.prompt_index, prompt_ids=list(r.prompt_ids), response_ids=row["ids"],
                                  rollout_log_probs=row["lps"], finish_reason=row["finish"],
                                  weight_version=r.weight_version, source=r.source, info=info,
                                  routed_experts=row["routing"]))
        return result


class SnapshotTimeout(TimeoutError):
    """``RolloutProducer.snapshot`` did not get its rollouts within its ``timeout_s``."""


class RolloutProducer:
    """Rank 0's background generator (see the module docstring).

    ``generate_fn(step, engine_view, version_tag) -> StepBatch`` makes one step's rollouts with the
    engine view it is given; ``apply_fn(payload, version_tag)`` loads published weights into the engine
    (called in the producer thread only)."""

    def __init__(self, engine, generate_fn: Callable, apply_fn: Callable, start_step: int, max_staleness: int,
                 interrupt: bool = False, segment_tokens: int = 0, preloaded: Optional[Dict[int, Any]] = None):
        if max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {max_staleness}")
        self.engine = engine
        self.generate_fn = generate_fn
        self.apply_fn = apply_fn
        self.start = int(start_step)
        self.k = int(max_staleness)
        self.interrupt = bool(interrupt)
        self._cond = threading.Condition()
        self._published: Dict[int, Any] = {}       # version -> payload not yet loaded
        self._latest = self.start                 # newest version published (the engine holds `start` already)
        self._loaded = self.start                 # version in the engine
        self._ready: Dict[int, Any] = dict(preloaded or {})   # step -> rollouts (or the thread's exception)
        self._stop = False
        self.busy: List[Tuple[float, float]] = []  # (start, end) wall times of generation
        view_seg = segment_tokens if interrupt else 0
        self.view = SegmentedEngine(engine, view_seg, self._load_newest)
        self._step_now = self.start
        self._thread = threading.Thread(target=self._run, name="megatron-rl-rollouts", daemon=True)

    # --------------------------------------------------------------- trainer side
    def start_thread(self) -> "RolloutProducer":
        self._thread.start()
        return self

    def versions_in_use(self) -> set:
        """Versions whose payload the engine may still load or holds: published and not yet loaded, being
        loaded, or loaded (weight sync keeps their disk exports, deletes older ones)."""
        with self._cond:
            return set(self._published) | {self._loaded}

    def publish(self, version: int, payload: Any) -> None:
        """The trainer finished ``version``: hand its weights over (loaded by the producer when needed)."""
        with self._cond:
            self._published[int(version)] = payload
            self._latest = max(self._latest, int(version))
            self._cond.notify_all()

    def _wait_ready(self, step: int, poll_s: float, deadline: Optional[float] = None):
        with self._cond:
            while step not in self._ready:
                errors = [v for v in self._ready.values() if isinstance(v, BaseException)]
                if errors:
                    raise errors[0]
                if not self._thread.is_alive():
                    raise RuntimeError(f"rollout producer thread ended without producing step {step}")
                if deadline is not None and time.monotonic() >= deadline:
                    raise SnapshotTimeout(f"rollouts of step {step} not ready by the deadline")
                self._cond.wait(poll_s)
            item = self._ready[step]
        if isinstance(item, BaseException):
            raise item
        return item

    def get(self, step: int, poll_s: float = 0.5):
        """Block until step ``step``'s rollouts are ready and hand them over; re-raise an error of the
        producer thread."""
        item = self._wait_ready(step, poll_s)
        with self._cond:
            self._ready.pop(step, None)
        return item

    def snapshot(self, next_step: int, poll_s: float = 0.5, timeout_s: Optional[float] = None,
                 ready_only: bool = False) -> Dict[int, Any]:
        """For a checkpoint taken before ``next_step``: wait for and return (without handing over) the
        rollouts of every step whose pinned version is older than ``next_step`` — steps ``next_step ..
        next_step + k - 1`` — so ``--resume`` can replay them (see the module docstring). ``timeout_s``
        bounds the whole wait (``SnapshotTimeout``); None: no bound. ``ready_only`` (the run's last checkpoint:
        no step will train on them): no wait, only the leading steps already generated, none after a gap or
        an error."""
        steps = range(next_step, next_step + self.k)
        if ready_only:
            out: Dict[int, Any] = {}
            with self._cond:
                for t in steps:
                    item = self._ready.get(t)
                    if item is None or isinstance(item, BaseException):
                        break
                    out[t] = item
            return out
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return {t: self._wait_ready(t, poll_s, deadline) for t in steps}

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop producing; rollouts in flight are discarded (the thread is a daemon: a generation that does
        not return within ``timeout_s`` is abandoned with the process)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # --------------------------------------------------------------- producer thread
    def _load(self, version: int) -> None:
        """Load published ``version`` into the engine (producer thread) and forget older payloads."""
        if version == self._loaded:
            return
        with self._cond:
            payload = self._published.get(version)
        if payload is None:
            raise RuntimeError(f"rollout producer: weights of version {version} were never published")
        self.apply_fn(payload, version_tag(version))
        self._loaded = version
        with self._cond:
            for v in [v for v in self._published if v <= version]:
                del self._published[v]

    def _load_newest(self) -> None:
        """Interrupt mode, between segments: continue on the newest published version (<= current step)."""
        with self._cond:
            newest = min(self._latest, self._step_now)
        if newest > self._loaded:
            self._load(newest)

    def _run(self) -> None:
        step = self.start
        try:
            while True:
                # the pinned version; in interrupt mode the engine may already hold a newer one (<= step)
                need = max(step - self.k, self.start, self._loaded)
                with self._cond:
                    while not self._stop and self._latest < need:
                        self._cond.wait(0.5)
                    if self._stop:
                        return
                with self._cond:
                    replay = step in self._ready          # preloaded from a checkpoint
                if not replay:
                    self._step_now = step
                    self._load(need)
                    t0 = time.time()
                    payload = self.generate_fn(step, self.view, version_tag(need))
                    self.busy.append((t0, time.time()))
                    with self._cond:
                        self._ready[step] = payload
                        self._cond.notify_all()
                step += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer by get()
            with self._cond:
                self._ready[step] = exc
                self._cond.notify_all()


def token_lag_tensor(prompt_lengths: Sequence[int], token_versions: Sequence[Sequence[int]], trainer_version: int,
                     width: int) -> torch.Tensor:
    """``[B, width]`` int64 lag (trainer version - token version) at the columns where the batch holds each
    response token's log-prob (column ``prompt_len - 1 + j`` for response token ``j``, the
    ``RolloutBatch`` layout); 0 elsewhere."""
    rows = []  # host rows, one tensor for the batch
    for p, versions in zip(prompt_lengths, token_versions):
        row, start = [0] * width, int(p) - 1
        if versions and start < width:
            lags = [trainer_version - int(v) for v in versions][: width - start]
            row[start: start + len(lags)] = lags
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), width)


def check_staleness(token_versions: Sequence[Sequence[int]], trainer_version: int, max_staleness: int, step: int) -> None:
    """Raise ``StaleRolloutError`` if a token is older than ``max_staleness`` versions or from the future."""
    for b, versions in enumerate(token_versions):
        for v in versions:
            if not 0 <= trainer_version - v <= max_staleness:
                raise StaleRolloutError(f"step {step}: row {b} has a token of weight version {v}, the trainer is at "
                                        f"version {trainer_version} and rollout.max_staleness is {max_staleness}")


def overlap_seconds(busy: Sequence[Tuple[float, float]], window: Tuple[float, float]) -> float:
    """Seconds of ``window`` covered by the ``busy`` intervals (the intervals do not overlap each other)."""
    lo, hi = window
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in busy)

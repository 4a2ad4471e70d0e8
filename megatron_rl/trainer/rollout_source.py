"""The rollout source: where each step's ``StepBatch`` comes from, chosen once when the job is built.

    source = build_rollout_source(cfg, generator, engine, actor, immediate_publisher, start, resumed, rank0,
                                  deferred=deferred_publisher)   # async: the job's DeferredPublisher
    got = source.next(step)                   # collective: rank 0 makes the batch, each rank receives its rows
    got.rows, got.whole                       # this rank's DP shard (StepRows); rank 0: the whole StepBatch
    publisher = source.publisher              # how trained versions reach the engine from now on
    extra, error = source.drain(step, last)     # rollouts a checkpoint must hold (async), and a drain failure

``SyncRollouts`` generates step ``t`` from version ``t`` when asked; ``AsyncRollouts`` takes it from the producer
(``async_rollout``). Rule: the staleness bound (``max_lag``) and the reward-failure limit are checked here, once,
before a batch leaves rank 0, and each rank receives only its rows (``RowSplit``). Waits and pieces:
docs/trainer.md.
"""
from __future__ import annotations

import dataclasses
import datetime
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron_rl.config import JobConfig
from megatron_rl.config.timeouts import (drain_key, drain_timeout_s, drain_wait_cause, drain_wait_timeout_s,
                                         rollout_wait_cause, rollout_wait_timeout_s)
from megatron_rl.parallel.rank0 import Pieces, scatter_from_rank0, share_from_rank0
from megatron_rl.rollout.base import RolloutError
from megatron_rl.rollout.versions import version_tag
from megatron_rl.trainer.dynamic_sampling import SKIPPED
from megatron_rl.trainer.async_rollout import RolloutProducer, SnapshotTimeout, check_staleness, overlap_seconds
from megatron_rl.trainer.reward_failures import reward_failure_error
from megatron_rl.trainer.reward_failures import failed_fraction
from megatron_rl.trainer.step_batch import StepBatch, StepRows
from megatron_rl.weight_sync.publisher import DeferredPublisher, WeightPublisher

__all__ = ["RolloutSource", "SyncRollouts", "AsyncRollouts", "AsyncDrainError", "build_rollout_source", "async_schedule",
           "RowSplit", "routing_layers"]


class AsyncDrainError(RuntimeError):
    """The async producer could not hand over the rollouts a checkpoint must hold (raised on every rank)."""


@dataclass(frozen=True)
class RowSplit:
    """Which rows of a step each global rank trains: its DP rank's (``StepBatch.dp_rows``)."""

    dp_rank_of: List[int]
    """The DP rank of each global rank."""
    dp_size: int
    """Data-parallel size."""
    n_samples: int
    """rollout.n_samples_per_prompt (prompt groups stay whole)."""
    balance_tokens: bool
    """Groups spread over DP ranks balancing tokens (``MicroBatcher.balances_dp_tokens``)."""
    group: Optional[dist.ProcessGroup] = None
    """The group the pieces travel in: every rank, gloo (host memory). None: the default group, when it is gloo."""
    layers_of: Optional[List[Optional[Tuple[int, ...]]]] = None
    """Per global rank: the MoE layers whose routing it receives (its pipeline stage's, every virtual stage's
    with VPP: ``RoutingReplay.local_layers``); None (for a rank, or for all): every layer."""

    @classmethod
    def gather(cls, cfg: JobConfig, dp_rank: int, dp_size: int, balance_tokens: bool,
               layers: Optional[Sequence[int]] = None, wait_s: Optional[float] = None) -> "RowSplit":
        """Collective over every rank: each rank's DP rank and routing layers (``layers``, None: every layer; one
        all_gather_object), and, when the default group is not gloo (NCCL), a gloo group of every rank for the
        pieces, so they travel in host memory and none is staged in GPU memory. ``balance_tokens``: the actor's
        ``MicroBatcher.balances_dp_tokens``. ``wait_s``: how long the other ranks may wait for rank 0's rollouts
        (``config.timeouts.rollout_wait_timeout_s``; None: ``trainer.collective_timeout_s``); when longer than
        that, the group (gloo, every rank) is made with it, so only this wait gets the longer bound."""
        mine = (int(dp_rank), None if layers is None else tuple(int(j) for j in layers))
        everyone = [mine]
        group = None
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            longer = wait_s is not None and wait_s > cfg.trainer.collective_timeout_s
            if dist.get_backend() != "gloo" or longer:
                timeout = wait_s if longer else cfg.trainer.collective_timeout_s
                group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        return cls([d for d, _ in everyone], int(dp_size), cfg.rollout.n_samples_per_prompt, bool(balance_tokens),
                   group, [lay for _, lay in everyone])

    def pieces(self, batch: StepBatch) -> Pieces:
        """Each global rank's ``StepRows``: its DP shard's rows with its stage's routing (ranks that share both
        share the piece), made by rank 0 one at a time while they are sent."""
        failed = failed_fraction(batch.metrics, batch.num_generated)
        layers_of = self.layers_of or [None] * len(self.dp_rank_of)
        keys = list(zip(self.dp_rank_of, layers_of))

        def make(key):
            dp, layers = key
            rows = batch.dp_rows(self.n_samples, dp, self.dp_size, self.balance_tokens)
            return batch.part(rows, failed, layers if batch.routing else None)

        return Pieces(keys, make)


class RolloutSource:
    """Hands the loop each step's rows (see the module docstring)."""

    max_lag: int = 0
    """The staleness bound: the most weight versions a token of a batch may lag the trainer."""
    dump_versions: bool = False
    """``rollouts.jsonl`` records carry each token's version (``StepBatch.records``): where tokens may lag."""
    publisher: WeightPublisher
    """How each trained version reaches the engine while this source runs."""

    split: Optional[RowSplit] = None
    """Which rows each rank receives (set by ``build_rollout_source``; None: every rank gets all rows)."""

    def __init__(self, cfg: JobConfig, publisher: WeightPublisher, generator=None):
        self.cfg = cfg
        self.publisher = publisher
        self.generator = generator

    def next(self, step: int) -> StepRows:
        """Collective: step ``step``'s (0-based) rows of this rank; rank 0 also gets the whole batch."""
        raise NotImplementedError

    def _scatter(self, make, step: int, **kw) -> StepRows:
        """Rank 0 makes the batch (``make``) and checks it; each rank receives its rows."""
        split = self.split or RowSplit([0] * (dist.get_world_size() if dist.is_initialized() else 1), 1,
                                       self.cfg.rollout.n_samples_per_prompt, False)
        piece, whole = scatter_from_rank0(lambda: self._checked(make(), step), split.pieces, group=split.group,
                                          waiting=rollout_wait_cause(self.cfg, step + 1), **kw)
        piece.whole = whole
        return piece

    def drain(self, step: int, last: bool = False) -> Tuple[Dict, Optional[BaseException]]:
        """Collective, before the checkpoint after ``step`` steps: what it must hold besides the weights (rank
        0; {} elsewhere) and the failure of handing it over (on every rank; the checkpoint is written anyway).
        ``last``: the run's final checkpoint (``trainer.steps`` done): nothing is waited for."""
        return {}, None

    def overlap_s(self, t_start: float, t_end: float) -> float:
        """Seconds of ``[t_start, t_end]`` (``time.perf_counter``) in which rollouts were generated while the
        trainer worked (rank 0; 0 elsewhere)."""
        return 0.0

    def close(self) -> None:
        """Stop generating (rollouts in flight are discarded) and release the step generator (rank 0: e.g. the
        environment workers of multi-turn rollouts)."""
        if self.generator is not None:
            self.generator.close()

    def _checked(self, batch: StepBatch, step: int) -> StepBatch:
        """Rank 0: the staleness bound and the reward-failure limit, before the batch leaves."""
        check_staleness(batch.token_versions, step, self.max_lag, step + 1)
        failure = reward_failure_error(batch.metrics, batch.num_generated, self.cfg.data.max_reward_failure_frac,
                                       step + 1)
        if failure is not None:
            raise failure
        return batch


class SyncRollouts(RolloutSource):
    """Rank 0 generates step ``t`` from version ``t`` when the loop asks for it."""

    def __init__(self, cfg: JobConfig, generator, engine, publisher: WeightPublisher):
        super().__init__(cfg, publisher, generator)
        self.engine = engine

    def next(self, step: int) -> StepRows:
        return self._scatter(lambda: self.generator.generate(self.engine, step, version_tag(step)), step)


class AsyncRollouts(RolloutSource):
    """Rank 0's producer thread generates ahead (``async_rollout.RolloutProducer``); ``publisher``: the job's
    ``DeferredPublisher`` (its payloads are the versions the producer applies later)."""

    def __init__(self, cfg: JobConfig, generator, engine, actor, start: int, resumed: Dict, rank0: bool, *,
                 publisher: DeferredPublisher):
        rc = cfg.rollout
        super().__init__(cfg, publisher, generator)
        self.max_lag = rc.max_staleness
        self.dump_versions = True
        self.producer = None
        # every rank, in the same order (before RowSplit.gather's): the group the other ranks wait for the drain in
        self.drain_group = None
        if dist.is_initialized():
            self.drain_group = dist.new_group(backend="gloo",
                                              timeout=datetime.timedelta(seconds=drain_wait_timeout_s(cfg)))
        if rank0:  # generation overlaps training from here on
            self.producer = RolloutProducer(
                engine, generate_fn=lambda s, view, tag: generator.generate(view, s, tag),
                apply_fn=lambda payload, tag: payload.apply(engine, publisher.settings, tag, actor), start_step=start,
                max_staleness=rc.max_staleness, interrupt=rc.partial_rollout == "interrupt",
                segment_tokens=rc.segment_tokens, preloaded=_resumed_rollouts(resumed, cfg)).start_thread()
        self.publisher.producer = self.producer

    def next(self, step: int) -> StepRows:
        return self._scatter(lambda: self.producer.get(step), step, what=f"async rollouts of step {step + 1}",
                             passthrough=(RolloutError,))

    def drain(self, step: int, last: bool = False) -> Tuple[Dict, Optional[BaseException]]:
        timeout_s = drain_timeout_s(self.cfg)
        extra, error = self._snapshot(step, timeout_s, last) if self.producer is not None else ({}, None)
        return extra, share_from_rank0(error, self.drain_group, waiting=drain_wait_cause(self.cfg, step))

    def _snapshot(self, step: int, timeout_s: float, last: bool) -> Tuple[Dict, Optional[BaseException]]:
        """Rank 0: the rollouts the producer generated from versions older than ``step`` (they cannot be
        regenerated from the checkpoint; async_rollout.py), within ``timeout_s`` (<= 0: no limit). ``last``: no
        step of this run trains on them, so only those already generated are kept (a run extended with
        ``--resume`` regenerates the others) and nothing is waited for."""
        try:
            rollouts = self.producer.snapshot(step, timeout_s=timeout_s if timeout_s > 0 else None, ready_only=last)
            rollouts = {t: _fields(batch) for t, batch in rollouts.items()}  # plain data in the checkpoint
            return {"async_rollouts": rollouts, "async_schedule": async_schedule(self.cfg)}, None
        except SnapshotTimeout:
            cause = f"the producer did not hand them over within {timeout_s:g} s ({drain_key(self.cfg)})"
        except Exception as exc:  # noqa: BLE001 - reported to every rank by drain
            cause = f"{type(exc).__name__}: {exc}"
        return {}, AsyncDrainError(f"rank 0: draining the async rollouts for the checkpoint of step {step} failed: "
                                   f"{cause}. The checkpoint of step {step} is written without them (--resume "
                                   f"regenerates them from its weights)")

    def overlap_s(self, t_start: float, t_end: float) -> float:
        if self.producer is None:
            return 0.0
        return overlap_seconds(self.producer.busy, (_wall(t_start), _wall(t_end)))

    def close(self) -> None:
        try:
            if self.producer is not None:
                self.producer.close()  # no generation uses the step generator after this
        finally:
            super().close()


def build_rollout_source(cfg: JobConfig, generator, engine, actor, immediate: WeightPublisher, start: int,
                         resumed: Dict, rank0: bool, *, deferred: Optional[DeferredPublisher] = None) -> RolloutSource:
    """The job's source for ``rollout.mode`` (``generator`` / ``engine``: rank 0's step generator
    (``rollout_phase.build_step_generator``) and engine, None elsewhere; ``immediate``: the
    publisher that loads a version right away; ``resumed``: the resumed checkpoint's extra state; ``deferred``: the
    job's ``DeferredPublisher``, built by the caller with ``immediate``, for async rollouts). Call after the engine
    holds version ``start``."""
    if cfg.rollout.mode == "async":
        if deferred is None:
            raise ValueError("rollout.mode 'async' needs the job's DeferredPublisher (build_rollout_source(deferred=))")
        source = AsyncRollouts(cfg, generator, engine, actor, start, resumed, rank0, publisher=deferred)
    else:
        source = SyncRollouts(cfg, generator, engine, immediate)
    source.split = RowSplit.gather(cfg, actor.dp_rank, actor.dp_size, actor.batcher.balances_dp_tokens,
                                   routing_layers(actor), wait_s=rollout_wait_timeout_s(cfg))
    return source


def routing_layers(actor) -> Optional[Tuple[int, ...]]:
    """The MoE layers whose routing this rank's actor replays (the layers of its routers: its pipeline stage's,
    every virtual stage's with VPP; ``RoutingReplay.local_layers``); None for a dense model (every layer)."""
    replay = actor.routing
    return None if replay is None else tuple(replay.local_layers)


def async_schedule(cfg: JobConfig) -> Dict[str, object]:
    """What a checkpoint's drained rollouts were made with, by dotted config key: the async schedule, the
    prompt groups (``StepBatch.shard`` groups rows by the current ``rollout.n_samples_per_prompt``) and, when
    enabled, dynamic sampling's settings (rollouts drawn without it are regenerated for a run with it, and those
    drawn with it for a run without it or with other settings: their steps were filtered, and skipped or not by
    ``on_exhausted``); with ``remax`` / ``gdpo`` the estimator (its rows carry its extra inputs: rollouts drawn for
    another estimator lack them)."""
    rc = cfg.rollout
    schedule = {"rollout.max_staleness": rc.max_staleness, "rollout.partial_rollout": rc.partial_rollout,
                "rollout.n_samples_per_prompt": rc.n_samples_per_prompt,
                "data.prompts_per_step": cfg.data.prompts_per_step}
    fg = cfg.algorithm.filter_groups
    if fg.enable:
        keys = ("metric", "prompts_per_round", "max_num_gen_batches", "on_exhausted")
        schedule.update({f"algorithm.filter_groups.{k}": getattr(fg, k) for k in keys})
    a = cfg.algorithm
    if a.advantage_estimator in ("remax", "gdpo"):   # its rows carry greedy baselines / reward components
        schedule["algorithm.adv_estimator"] = a.advantage_estimator
        schedule["algorithm.gdpo_reward_keys"] = list(a.gdpo_reward_keys or [])
    return schedule


def _saved_schedule(saved) -> Dict[str, object]:
    """A checkpoint's ``async_schedule``; checkpoints written before the prompt groups were stored hold the tuple
    ``(max_staleness, partial_rollout)`` (their group keys then count as not recorded)."""
    if isinstance(saved, (tuple, list)) and len(saved) == 2:
        return {"rollout.max_staleness": saved[0], "rollout.partial_rollout": saved[1]}
    return dict(saved) if isinstance(saved, dict) else {}


def _resumed_rollouts(extra: Dict, cfg: JobConfig) -> Dict:
    """The drained rollouts of a resumed checkpoint when they were made with this run's ``async_schedule``;
    otherwise none (the producer regenerates them) and one line naming each key that differs."""
    saved = extra.get("async_rollouts") or {}
    if not saved:
        return {}
    then, now = _saved_schedule(extra.get("async_schedule")), async_schedule(cfg)
    diff = [f"{k}={then[k]!r} (this run: {v!r})" if k in then else f"{k} not recorded (this run: {v!r})"
            for k, v in now.items() if k not in then or then[k] != v]
    diff += [f"{k}={v!r} (this run: not set)" for k, v in then.items() if k not in now]
    batches = {int(t): _saved_batch(b) for t, b in saved.items()}
    rows = cfg.rollout.n_samples_per_prompt * cfg.data.prompts_per_step
    if not diff and any(b.num_rows != rows for b in batches.values()):
        diff = [f"{b.num_rows} rows per step (this run: {rows})" for b in batches.values() if b.num_rows != rows][:1]
    if diff:
        print(f"[megatron-rl] the checkpoint's async rollouts were made with {', '.join(diff)}: regenerating them "
              f"from the checkpoint's weights", flush=True)
        return {}
    return batches



def _saved_batch(saved) -> StepBatch:
    """A checkpoint's drained batch (a dict of fields, or a pickled batch). One written before
    ``StepBatch.skipped`` recorded a skipped step only in its ``filter_groups/skipped`` metric: read there once."""
    fields = dict(saved) if isinstance(saved, dict) else _fields(saved)
    if "skipped" not in (saved if isinstance(saved, dict) else vars(saved)):
        fields["skipped"] = bool((fields.get("metrics") or {}).get(SKIPPED))
    return StepBatch(**fields)


def _fields(batch) -> Dict:
    """A batch's fields as a shallow dict (no copy of its arrays). Also reads the ``StepRollouts`` objects that
    checkpoints written before the ``StepBatch`` rename hold (their fields are a subset)."""
    names = [f.name for f in dataclasses.fields(StepBatch)]
    return {n: getattr(batch, n) for n in names if hasattr(batch, n)}


def _wall(perf_t: float) -> float:
    """A ``time.perf_counter()`` reading as wall time (the producer records ``time.time()``)."""
    return time.time() - (time.perf_counter() - perf_t)

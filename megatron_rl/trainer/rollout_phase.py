"""The rollout phase of a step on global rank 0: prompts -> engine -> rewards -> a ``StepBatch``.

Two step generators, chosen once by ``build_step_generator``: ``SingleTurn`` (``generate_step``) and, with
``multi_turn.env`` set, ``MultiTurn`` (environments in an ``envs.EnvPool`` the generator owns); with
``algorithm.filter_groups.enable`` the chosen one is wrapped in ``dynamic_sampling.DynamicSampling``. Rule:
prompts and embedded samples are seeded by (trainer.seed, step, round), so a resumed run draws exactly what the
uninterrupted run drew (SGLang samples server-side: the same prompts, other responses). Rewards, truncation,
MoE routing: docs/trainer.md.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_rl.actor.replay_modes import ReplayMode
from megatron_rl.actor.routing import RoutingError
from megatron_rl.envs.pool import EnvPool
from megatron_rl.rollout.base import RolloutError, SamplingParams, StaleRolloutError
from megatron_rl.rollout.budget import ResponseBudget
from megatron_rl.rollout.multi_turn import ObservationEncoder, TurnLimits, run_trajectories
from megatron_rl.rollout.sglang_routing import ROUTED_EXPERTS_FLAG
from megatron_rl.rollout.trajectory import COUNT_KEYS, FINISH_REASONS
from megatron_rl.tasks.base import response_text
from megatron_rl.trainer.dynamic_sampling import DynamicSampling
from megatron_rl.trainer.greedy_baseline import greedy_rewards
from megatron_rl.trainer.judge_trajectories import judge_trajectories
from megatron_rl.trainer.prompt_draw import PromptDraw, round_seed, sample_prompts  # noqa: F401 (re-exported)
from megatron_rl.trainer.reward_components import reward_components
from megatron_rl.trainer.step_batch import StepBatch


StepRollouts = StepBatch  # the old name: async checkpoints written before the rename unpickle through it


def sampling_params(rollout_cfg, eos_ids=()) -> SamplingParams:
    """SamplingParams from the ``rollout`` config section."""
    return SamplingParams(temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
                          max_new_tokens=rollout_cfg.max_new_tokens, stop_token_ids=tuple(eos_ids))


def task_eos_ids(task) -> tuple:
    """The task tokenizer's EOS id (what the reward cuts the response at), as stop ids for the engine: both
    engines then end a response there, and a client that only sees the reply (SGLang's) knows the stop set."""
    eos = getattr(getattr(task, "tokenizer", None), "eos_token_id", None)
    return () if eos is None else (int(eos),)


def overlong_penalty(lengths: Sequence[int], max_new_tokens: int, buffer_len: int, factor: float) -> List[float]:
    """DAPO's soft overlong punishment per response: 0 up to ``max_new_tokens - buffer_len`` tokens, then
    linearly down to ``-factor`` at ``max_new_tokens`` (all zeros when ``buffer_len`` is 0)."""
    if buffer_len <= 0:
        return [0.0] * len(lengths)
    expected = max_new_tokens - buffer_len
    return [min(0.0, -(n - expected) / buffer_len * factor) for n in lengths]


def step_metrics(prompt_rows, rollouts, raw_rewards: Sequence[float], penalties: Sequence[float],
                 result, task_stats: Dict[str, float]) -> Dict[str, float]:
    """The data / reward / length metrics of one step."""
    n = len(rollouts)
    truncated = sum(r.finish_reason == "length" for r in rollouts)
    plen = [len(p.prompt_ids) for p in prompt_rows]
    m = dict(task_stats)
    m.update({
        "data/prompt_length_mean": sum(plen) / len(plen), "data/prompt_length_max": float(max(plen)),
        "reward/failed": float(result.failed), "reward/timed_out": float(result.timed_out),
        "reward/raw_mean": sum(raw_rewards) / n,
        "response/truncated_frac": truncated / n, "response/truncated_count": float(truncated),
        "response/overlong_penalty_mean": sum(penalties) / n,
    })
    m.update(result.extra_means())
    m.update(getattr(result, "metrics", {}))  # the judge's reward/judge_*, the reward model's reward/rm_*
    return m


def generate_step(task, engine, cfg, step: int, expected_version: str, rnd: int = 0, *,
                  replay: ReplayMode, draw: Optional[PromptDraw] = None,
                  greedy_baseline: bool = False, reward_keys: Sequence[str] = ()) -> StepBatch:
    """Rank 0: draw prompts, generate n responses each, score them (``rnd``: the generation round of the step,
    ``round_seed``; ``replay``: the job plan's routing-replay mode, the step generator's; ``draw``: the job's
    prompt draw, the step generator's -- None, for a one-off call: the stateless draw seeded by (trainer.seed,
    step, round), ``sample_prompts``, also for a data file, whose epoch order only a job's draw holds;
    ``greedy_baseline``: also each prompt's greedy response's reward, ReMax's ``reward_baselines``,
    ``greedy_baseline.py``; ``reward_keys``: GDPO's components of each row's dict reward,
    ``reward_components.py``). Raises RolloutError on failure (the step is then not applied) or
    StaleRolloutError if the engine serves other weights."""
    prompts = draw(step, rnd) if draw is not None else sample_prompts(task, cfg, step, rnd)
    n = cfg.rollout.n_samples_per_prompt
    # the embedded engine reproduces a sample from its seed; SGLang samples server-side (engine.seeded_sampling)
    rollouts = engine.generate([p.prompt_ids for p in prompts], sampling_params(cfg.rollout, task_eos_ids(task)),
                               n=n, seed=round_seed(cfg.trainer.seed * 7919 + step, rnd))
    stale = [r.weight_version for r in rollouts if r.weight_version != expected_version]
    if stale:
        raise StaleRolloutError(f"step {step}: {len(stale)} rollouts from weight version {stale[0]!r}, "
                                f"expected {expected_version!r}")
    routing, routing_stats = None, {}
    if rollout_routing(rollouts) is not None:  # an MoE engine captured routing (for some rows at least)
        routing, routing_stats = step_routing(rollouts, required=replay.needs_rollout_routing, step=step)
    prompt_rows = [prompts[i // n] for i in range(len(rollouts))]
    result = task.score(prompt_rows, [r.response_ids for r in rollouts])
    if result.failed or result.timed_out:
        print(f"[megatron-rl] step {step + 1}: {result.failed} reward(s) failed and {result.timed_out} timed out "
              f"(scored 0); first: {result.errors[0] if result.errors else '-'}", file=sys.stderr, flush=True)
    d = cfg.data
    penalties = overlong_penalty([len(r.response_ids) for r in rollouts], cfg.rollout.max_new_tokens,
                                 d.overlong_buffer_len, d.overlong_penalty_factor)
    rewards = [float(x) + p for x, p in zip(result.rewards, penalties)]
    baselines, greedy_metrics = [], {}
    if greedy_baseline:
        per_prompt, greedy_metrics = greedy_rewards(
            task, engine, prompts, sampling_params(cfg.rollout, task_eos_ids(task)),
            round_seed(cfg.trainer.seed * 7919 + step, rnd), expected_version,
            lambda lengths: overlong_penalty(lengths, cfg.rollout.max_new_tokens, d.overlong_buffer_len,
                                             d.overlong_penalty_factor))
        baselines = [per_prompt[i // n] for i in range(len(rollouts))]
    components = reward_components(result.extras, result.rewards, reward_keys) if reward_keys else []
    return StepBatch(prompt_ids=[list(p.prompt_ids) for p in prompt_rows],
                        response_ids=[list(r.response_ids) for r in rollouts],
                        rollout_log_probs=[list(r.rollout_log_probs) for r in rollouts],
                     rewards=rewards, scores=[float(x) for x in result.rewards] if any(penalties) else [],
                     weight_version=expected_version, routing=routing,
                     truncated=[r.finish_reason == "length" for r in rollouts],
                     metrics={**step_metrics(prompt_rows, rollouts, result.rewards, penalties, result,
                                             task.stats()), **routing_stats, **greedy_metrics},
                     reward_baselines=baselines, reward_components=components,
                     token_versions=[r.token_versions for r in rollouts], reward_extras=list(result.extras))


class PartialRoutingError(RolloutError, RoutingError):
    """The engine captured MoE routing for some rollouts only, and ``actor.routing_replay: r3`` needs all."""


def rollout_routing(rollouts) -> Optional[List[object]]:
    """Each rollout's ``routed_experts`` (MoE routing captured by the engine), or None if no rollout has it
    (a partial capture is kept: ``RolloutBatch.from_sequences`` names the rows that miss it)."""
    routing = [getattr(r, "routed_experts", None) for r in rollouts]
    return routing if any(x is not None for x in routing) else None


def step_routing(rollouts, required: bool, step: int = 0) -> Tuple[Optional[List[object]], Dict[str, float]]:
    """A step's MoE routing for the actor (``rollout_routing``, or None) and its routing metrics.

    Only replay of the engine's routing (``required``: ``actor.routing_replay: r3``) needs it. A partial
    capture (some rows without routing: e.g. one of several SGLang servers started without
    ``--enable-return-routed-experts``, or one that did not answer ``/server_info``) is then a
    ``PartialRoutingError`` naming the rows (a ``RolloutError``: the loop ends the step with it on every rank); otherwise it is dropped for the step (the actor's agreement metrics
    skip it) and counted: ``routing/missing_rows`` (rows without routing; 0 on a full capture)."""
    def what(missing: List[int]) -> str:
        prompts = sorted({rollouts[b].prompt_index for b in missing})
        return (f"the engine returned none for {len(missing)} of {len(rollouts)} rollouts (rows {_head(missing)}, "
                f"prompts {_head(prompts)}; sources {sorted({rollouts[b].source for b in missing})})")

    return _replayable(rollout_routing(rollouts), required, step, what)


def _head(items: List[int]) -> str:
    """The first 16 of ``items`` for a message (`` ...`` when there are more)."""
    return f"{items[:16]}{' ...' if len(items) > 16 else ''}"


def _replayable(routing: Optional[List[object]], required: bool, step: int,
                what: Callable[[List[int]], str]) -> Tuple[Optional[List[object]], Dict[str, float]]:
    """The rows' routing for the actor and ``routing/missing_rows``: None when no row has routing; a partial
    capture raises ``PartialRoutingError`` (``what(missing rows)`` says which) when ``required``, else is dropped."""
    if routing is None or all(x is None for x in routing):
        return None, {}
    missing = [b for b, x in enumerate(routing) if x is None]
    if missing and required:
        raise PartialRoutingError(
            f"step {step + 1}: actor.routing_replay='r3' replays the rollout engine's MoE routing, but {what(missing)}"
            f": every server must capture routing ({ROUTED_EXPERTS_FLAG}), or set actor.routing_replay to none / r2")
    return (None if missing else routing), {"routing/missing_rows": float(len(missing))}


class SingleTurn:
    """The step generator of single-turn tasks: each prompt -> ``n_samples_per_prompt`` responses (``generate_step``).

    A step generator is chosen once per job (``build_step_generator``) and hands the rollout source each step's
    ``StepBatch``: ``generate(engine, step, version, rnd=0)`` on rank 0, with the engine (or the async producer's
    view of it) to sample from, the weight version the rollouts must carry and the generation round of the step
    (dynamic sampling's extra rounds draw the next prompts of ``draw``, the job's ``PromptDraw``)."""

    def __init__(self, task, cfg, draw: PromptDraw, replay: ReplayMode,
                 greedy_baseline: bool = False, reward_keys: Sequence[str] = ()):
        self.task, self.cfg, self.draw = task, cfg, draw
        self.replay = replay
        self.greedy_baseline, self.reward_keys = greedy_baseline, tuple(reward_keys)

    def generate(self, engine, step: int, version: str, rnd: int = 0) -> StepBatch:
        return generate_step(self.task, engine, self.cfg, step, version, rnd, replay=self.replay, draw=self.draw,
                             greedy_baseline=self.greedy_baseline, reward_keys=self.reward_keys)

    def close(self) -> None:
        """Nothing to release."""


def trained_mask(traj) -> List[int]:
    """The loss mask of a trajectory's response: its model tokens, or none at all when its environment failed
    (``env_error``: an infrastructure fault must not push the policy away from what it sampled; the row still
    counts in its group's reward baseline with reward 0, and in ``multi_turn/*`` and the failure counts)."""
    return [0] * len(traj.loss_mask) if traj.finish == "env_error" else traj.loss_mask


class MultiTurn:
    """The step generator of multi-turn tasks (``multi_turn.env`` set): each prompt -> ``n_samples_per_prompt``
    trajectories of model turns and environment replies (``rollout.multi_turn.run_trajectories``), the
    environments in ``pool`` (an ``envs.EnvPool`` this generator owns: ``close`` stops its workers).

    Prompts are drawn exactly as ``generate_step`` draws them (the job's ``PromptDraw``) and the first turn is sampled
    as a single-turn step samples its responses (same seed, ``n`` per prompt). Rewards are the environments'
    (0 for a trajectory that never got an answer, or whose environment failed). Rows carry ``loss_masks``
    (environment tokens 0) and per-token versions (an environment token has the version of the model turn before
    it, so only model tokens decide staleness). Environment failures
    count as failed rewards (``reward/failed``: exceptions and garbage, ``reward/timed_out``: timeouts) under
    ``data.max_reward_failure_frac``; metrics ``multi_turn/*`` (turns, environment token share, finish reasons,
    per-trajectory counts)."""

    def __init__(self, task, cfg, pool, tokenizer, draw: PromptDraw, limits: TurnLimits, replay: ReplayMode):
        self.task, self.cfg, self.pool, self.tokenizer, self.draw = task, cfg, pool, tokenizer, draw
        self.replay = replay
        self.limits = limits
        """The job plan's ``TurnLimits`` (``ResponseBudget.limits``), enforced on every trajectory."""
        self.encode = ObservationEncoder(tokenizer, cfg.multi_turn.observation_template)

    def decode(self, ids: List[int]) -> str:
        """The text of a model turn the environment reads: up to its EOS, special tokens dropped."""
        return response_text(self.tokenizer, ids)[0]

    def generate(self, engine, step: int, version: str, rnd: int = 0) -> StepBatch:
        cfg, task = self.cfg, self.task
        prompts = self.draw(step, rnd)
        n = cfg.rollout.n_samples_per_prompt
        env_seed = round_seed(cfg.trainer.seed * 1_000_003 + step, rnd)
        samples = [{"prompt": p.text, "answer": p.answer, "data_source": p.data_source, "extra_info": p.extra_info,
                    "seed": env_seed * 1009 + i} for i, p in enumerate(prompts)]
        failures: list = []
        trajs = run_trajectories(engine, self.pool, [p.prompt_ids for p in prompts], samples, n,
                                 sampling_params(cfg.rollout, task_eos_ids(task)), self.limits, self.encode,
                                 self.decode, seed=round_seed(cfg.trainer.seed * 7919 + step, rnd),
                                 keys=[(step, b) if rnd == 0 else (step, rnd, b) for b in range(len(prompts) * n)],
                                 expected_version=version,
                                 failures=failures)
        if failures:
            print(f"[megatron-rl] step {step + 1}: {len(failures)} environment call(s) failed (trajectory ended, "
                  f"reward 0); first: {failures[0][1].kind}: {failures[0][1].message}", file=sys.stderr, flush=True)
        routing, routing_stats = trajectory_routing(trajs, required=self.replay.needs_rollout_routing, step=step)
        prompt_rows = [prompts[b // n] for b in range(len(trajs))]
        rewards, metrics = [float(t.reward) for t in trajs], multi_turn_metrics(prompt_rows, trajs, task.stats())
        if hasattr(task, "score_texts"):  # reward.judge (tasks/judge.py JudgedTask): the judge reads the trajectories
            rewards, metrics = judge_trajectories(task, prompt_rows, trajs, self.tokenizer, self.decode, metrics)
        return StepBatch(prompt_ids=[list(t.prompt_ids) for t in trajs],
                         response_ids=[t.response_ids for t in trajs],
                         rollout_log_probs=[t.rollout_log_probs for t in trajs],
                         rewards=rewards, weight_version=version, routing=routing,
                         truncated=[t.finish in TRUNCATED_FINISHES for t in trajs],
                         metrics={**metrics, **routing_stats},
                         token_versions=[t.token_versions for t in trajs],
                         loss_masks=[trained_mask(t) for t in trajs])

    def close(self) -> None:
        """Stop the environment workers (by pid)."""
        self.pool.close()


#: Trajectory finishes that cut the response short (``StepBatch.truncated``).
TRUNCATED_FINISHES = ("length", "max_tokens")


def multi_turn_metrics(prompt_rows, trajs, task_stats: Dict[str, float]) -> Dict[str, float]:
    """The data / reward / length metrics of a multi-turn step and its ``multi_turn/*`` metrics: turns per
    trajectory, the share of response tokens written by environments, the share of each finish, and every
    per-trajectory count (``Trajectory.counts``) per trajectory."""
    n = len(trajs)
    plen = [len(p.prompt_ids) for p in prompt_rows]
    truncated = sum(t.finish in TRUNCATED_FINISHES for t in trajs)
    env_tokens = sum(t.num_env_tokens for t in trajs)
    all_tokens = sum(t.num_env_tokens + t.num_model_tokens for t in trajs)
    counts = {k: sum(float(t.counts.get(k, 0.0)) for t in trajs)
              for k in sorted(set(COUNT_KEYS) | {k for t in trajs for k in t.counts})}
    m = dict(task_stats)
    m.update({
        "data/prompt_length_mean": sum(plen) / len(plen), "data/prompt_length_max": float(max(plen)),
        "reward/failed": counts.get("env_exception", 0.0) + counts.get("env_garbage", 0.0),
        "reward/timed_out": counts.get("env_timeout", 0.0),
        "reward/raw_mean": sum(t.reward for t in trajs) / n,
        "response/truncated_frac": truncated / n, "response/truncated_count": float(truncated),
        "multi_turn/turns_mean": sum(t.turns for t in trajs) / n,
        "multi_turn/env_token_frac": env_tokens / all_tokens if all_tokens else 0.0,
    })
    for reason in FINISH_REASONS:
        if reason:
            m[f"multi_turn/finish_{reason}_frac"] = sum(t.finish == reason for t in trajs) / n
    for k, v in counts.items():
        m[f"multi_turn/{k}_per_traj"] = v / n
    return m


def trajectory_routing(trajs, required: bool, step: int = 0) -> Tuple[Optional[List[object]], Dict[str, float]]:
    """``step_routing`` for trajectories: every row's joined routing (``Trajectory.routing``), or None when no
    row has it; a partial capture fails with ``actor.routing_replay: r3`` (``PartialRoutingError``), else it is
    dropped and counted (``routing/missing_rows``)."""
    return _replayable([t.routing for t in trajs], required, step,
                       lambda missing: f"{len(missing)} of {len(trajs)} trajectories have none for some turn "
                                       f"(rows {_head(missing)})")


def build_step_generator(cfg, task, draw: Optional[PromptDraw], replay: ReplayMode,
                         greedy_baseline: bool = False, reward_keys: Sequence[str] = (), *,
                         budget: ResponseBudget, dynamic):
    """Rank 0: the job's step generator, chosen once: ``MultiTurn`` with the environment pool it owns when
    ``multi_turn.env`` is set, else ``SingleTurn`` (prompt -> response); wrapped in ``DynamicSampling`` when
    ``dynamic``, the job plan's dynamic-sampling choice (``algorithm.filter_groups`` when enabled), is not None. ``draw``: the job's ``PromptDraw`` (None: one built here for ``task``);
    ``replay``: the job plan's routing-replay mode;
    ``greedy_baseline`` / ``reward_keys``: single-turn rows also carry ReMax's greedy baselines / GDPO's reward
    components (the plan refuses both multi-turn); ``budget``: the job plan's response budget, whose ``limits``
    the multi-turn generator enforces.
    The job calls ``close()`` at its end."""
    m = cfg.multi_turn
    draw = draw or PromptDraw(task, cfg)
    if m.env is None:
        gen = SingleTurn(task, cfg, draw, replay, greedy_baseline, reward_keys)
    else:
        pool = EnvPool(m.env, m.env_kwargs, workers=m.env_workers, step_timeout_s=m.env_step_timeout_s)
        gen = MultiTurn(task, cfg, pool, task.tokenizer, draw, budget.limits, replay)
    return DynamicSampling(gen, cfg) if dynamic is not None else gen

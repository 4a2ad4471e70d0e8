"""The multi-turn driver: prompts -> ``Trajectory`` objects, alternating model turns and environment replies,
token in, token out.

    limits = plan.budget.limits   # TurnLimits, built once by the job plan (ResponseBudget.of)
    trajs = run_trajectories(engine, pool, prompt_ids, samples, n, sampling, limits,
                             encode_observation=ObservationEncoder(tokenizer, template),
                             decode_action=lambda ids: response_text(tokenizer, ids)[0], seed=s)

Rule: nothing the model produced is ever decoded and re-encoded -- its ids, log-probs and versions become a model
``Segment`` as the engine returned them. Every open trajectory advances one turn per engine call (one call per
distinct token budget). The turn loop (model turn, limits, environment), overlong handling and staleness:
docs/multi_turn.md, "The driver's turn loop".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from megatron_rl.envs.base import EnvFailure
from megatron_rl.rollout.base import RolloutError, SamplingParams, StaleRolloutError
from megatron_rl.rollout.budget import TurnLimits
from megatron_rl.rollout.finish import normalised_finish, stop_ids
from megatron_rl.rollout.routing import join_routing
from megatron_rl.rollout.trajectory import Segment, Trajectory

__all__ = ["TurnLimits", "ObservationEncoder", "run_trajectories", "OBSERVATION_FIELD"]

#: The placeholder of ``multi_turn.observation_template`` replaced by the environment's observation text.
OBSERVATION_FIELD = "{observation}"

#: Seed stride between turns (the async view's stride between segments).
TURN_SEED_STRIDE = 7919


class ObservationEncoder:
    """``encode(observation) -> ids``: the observation put into ``template`` (at ``{observation}``) and tokenized
    once, without special tokens added (the template spells the chat markup: end of the assistant turn, the
    tool / user turn, the next assistant header)."""

    def __init__(self, tokenizer, template: str):
        if OBSERVATION_FIELD not in template:
            raise ValueError(f"multi_turn.observation_template={template!r} must contain {OBSERVATION_FIELD}")
        self.tokenizer, self.template = tokenizer, template

    def __call__(self, observation: str) -> List[int]:
        text = self.template.replace(OBSERVATION_FIELD, observation)
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]


@dataclass
class _Open:
    """Driver state of one trajectory."""

    traj: Trajectory
    key: Hashable
    used: int = 0          # response tokens so far
    routed: int = 0        # positions the routing so far covers (fed to the engine by earlier calls)


def _check_version(rollouts, expected: Optional[str]) -> None:
    """The first turn starts from the step's weights (``expected``; None: not checked)."""
    if expected is None:
        return
    bad = [r.weight_version for r in rollouts if r.weight_version != expected]
    if bad:
        raise StaleRolloutError(f"multi-turn turn 1: {len(bad)} rollouts from weight version {bad[0]!r}, "
                                f"expected {expected!r}")


def run_trajectories(engine, pool, prompts: Sequence[Sequence[int]], samples: Sequence[Dict[str, Any]], n: int,
                     sampling: SamplingParams, limits: TurnLimits, encode_observation: Callable[[str], List[int]],
                     decode_action: Callable[[List[int]], str], seed: Optional[int] = None,
                     keys: Optional[Sequence[Hashable]] = None,
                     expected_version: Optional[str] = None, failures: Optional[list] = None) -> List[Trajectory]:
    """``len(prompts) * n`` trajectories, prompt-major (see the module docstring).

    ``samples[i]``: the row of prompt ``i`` every environment of it is reset with; ``keys``: one pool key per
    trajectory (default ``0 .. len(prompts) * n - 1``); ``expected_version``: the weight version the step
    must start from (None: not checked); ``failures``: a list that gets ``(key, EnvFailure)`` of every
    environment failure (for the caller's message). Engine failures propagate (``RolloutError``); environment failures
    end only their trajectory."""
    if len(samples) != len(prompts):
        raise ValueError(f"run_trajectories: {len(prompts)} prompts but {len(samples)} samples")
    count = len(prompts) * n
    keys = list(range(count)) if keys is None else list(keys)
    if len(keys) != count:
        raise ValueError(f"run_trajectories: {count} trajectories but {len(keys)} keys")
    rows = [_Open(Trajectory(prompt_ids=[int(t) for t in prompts[b // n]]), keys[b]) for b in range(count)]
    stops = stop_ids(sampling, getattr(engine, "eos_token_ids", ()))
    reset = pool.reset(keys, [samples[b // n] for b in range(count)])
    for row, failure in zip(rows, reset or [None] * count):
        if failure is not None:  # ended, but its first turn is still sampled (no row without a response)
            _fail(row, failure, failures)
    open_rows = list(rows)
    for turn in range(limits.max_turns):
        if not open_rows:
            break
        results = _model_turn(engine, open_rows, rows, n, sampling, limits, turn, seed, expected_version)
        acting, ended = [], []
        for row, r in results:
            ids = [int(t) for t in r.response_ids]
            finish = normalised_finish(r.finish_reason, ids, stops)
            # earlier calls fed (and routed) everything up to their last sampled token; this call fed the rest
            row.traj.routing = (r.routed_experts if row.traj.turns == 0
                                else join_routing(row.traj.routing, r.routed_experts, row.routed))
            row.traj.segments.append(Segment("model", ids, [float(x) for x in r.rollout_log_probs], r.token_versions,
                                             finish_reason=finish))
            row.used += len(ids)
            row.routed = len(row.traj.prompt_ids) + row.used - 1
            row.traj.turns += 1
            if row.traj.finish:  # its environment failed to start
                continue
            if finish == "length":
                row.traj.finish = "max_tokens" if row.used >= limits.max_total_tokens else "length"
                ended.append(row)
            else:
                acting.append(row)
        if acting:
            steps = pool.step([row.key for row in acting],
                              [decode_action(row.traj.segments[-1].ids) for row in acting])
            for row, out in zip(acting, steps):
                if isinstance(out, EnvFailure):
                    _fail(row, out, failures)
                    continue
                for k, v in out.info.items():
                    row.traj.counts[k] = row.traj.counts.get(k, 0.0) + float(v)
                if out.done:
                    row.traj.finish, row.traj.reward = "answer", float(out.reward)
                    continue
                if turn + 1 >= limits.max_turns:
                    row.traj.finish = "max_turns"
                    ended.append(row)
                    continue
                obs = encode_observation(out.observation)
                room = limits.max_total_tokens - row.used
                if len(obs) >= room:  # no room left for a model token after it
                    if len(obs) > room:
                        row.traj.counts["truncated_observation"] = row.traj.counts.get("truncated_observation",
                                                                                       0.0) + 1.0
                    row.traj.finish = "max_tokens"
                    ended.append(row)
                    continue
                row.traj.segments.append(Segment("env", obs))
                row.used += len(obs)
        if ended:
            pool.release([row.key for row in ended])
        open_rows = [row for row in open_rows if not row.traj.finish]
    return [row.traj for row in rows]


def _fail(row: _Open, failure: EnvFailure, failures: Optional[list]) -> None:
    """An environment failure ends the row's trajectory: finish "env_error", reward 0, counted under its kind."""
    traj = row.traj
    traj.finish, traj.reward = "env_error", 0.0
    traj.counts[failure.kind] = traj.counts.get(failure.kind, 0.0) + 1.0
    if failures is not None:
        failures.append((row.key, failure))


def _model_turn(engine, open_rows: List[_Open], rows: List[_Open], n: int, sampling: SamplingParams,
                limits: TurnLimits, turn: int, seed: Optional[int], expected_version: Optional[str]):
    """One model turn of every open trajectory: ``[(row, rollout)]`` in row order. The first turn samples ``n``
    per prompt in one call (as a single-turn step does); later turns continue each row with ``n=1``, one call
    per distinct token budget."""
    call_seed = None if seed is None else seed + TURN_SEED_STRIDE * turn
    if turn == 0:
        budget = min(limits.max_tokens_per_turn, limits.max_total_tokens)
        prompts = [rows[b].traj.prompt_ids for b in range(0, len(rows), n)]
        out = engine.generate(prompts, dataclasses.replace(sampling, max_new_tokens=budget), n=n, seed=call_seed)
        _check_length(out, len(rows))
        _check_version(out, expected_version)
        return list(zip(rows, out))
    by_budget: Dict[int, List[_Open]] = {}
    for row in open_rows:
        budget = min(limits.max_tokens_per_turn, limits.max_total_tokens - row.used)
        by_budget.setdefault(budget, []).append(row)
    got = {}
    for budget in sorted(by_budget, reverse=True):
        group = by_budget[budget]
        out = engine.generate([row.traj.prompt_ids + row.traj.response_ids for row in group],
                              dataclasses.replace(sampling, max_new_tokens=budget), n=1, seed=call_seed)
        _check_length(out, len(group))
        got.update({id(row): r for row, r in zip(group, out)})
    return [(row, got[id(row)]) for row in open_rows]


def _check_length(out, expected: int) -> None:
    if len(out) != expected:
        raise RolloutError(f"multi-turn: the engine returned {len(out)} rollouts for {expected} rows")

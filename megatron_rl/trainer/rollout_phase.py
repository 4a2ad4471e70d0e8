"""The rollout phase of a step: prompts -> engine -> rewards on global rank 0, shared with every rank.

Rank 0 owns the task and the engine (the embedded engine, or the HTTP client of SGLang servers that do
the heavy lifting). Prompt sampling and embedded generation are seeded by (trainer.seed, step) so a
resumed run draws exactly what the uninterrupted run drew, with no generator state to checkpoint.
SGLang samples server-side without a per-request seed, so with it a resumed run draws the same prompts
but different responses.
"""
from __future__ import annotations

import inspect
import random
from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist

from megatron_rl.rollout.base import SamplingParams


@dataclass
class StepRollouts:
    """One step's rollouts, prompt-major (n consecutive rows per prompt)."""

    prompt_ids: List[List[int]]
    response_ids: List[List[int]]
    rollout_log_probs: List[List[float]]
    rewards: List[float]
    weight_version: str


def sampling_params(rollout_cfg, eos_ids=()) -> SamplingParams:
    """SamplingParams from the ``rollout`` config section."""
    return SamplingParams(temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
                          max_new_tokens=rollout_cfg.max_new_tokens, stop_token_ids=tuple(eos_ids))


def generate_step(task, engine, cfg, step: int, expected_version: str) -> StepRollouts:
    """Rank 0: sample prompts, generate n responses each, score them. Raises RolloutError on failure
    (the step is then not applied) or StaleRolloutError if the engine serves other weights."""
    from megatron_rl.rollout.base import StaleRolloutError

    rng = random.Random(cfg.trainer.seed * 1_000_003 + step)
    prompts = task.sample(cfg.data.prompts_per_step, rng)
    n = cfg.rollout.n_samples_per_prompt
    kwargs = {}
    if "seed" in inspect.signature(engine.generate).parameters:  # the embedded engine; SGLang samples server-side
        kwargs["seed"] = cfg.trainer.seed * 7919 + step
    rollouts = engine.generate([p.prompt_ids for p in prompts], sampling_params(cfg.rollout), n=n, **kwargs)
    stale = [r.weight_version for r in rollouts if r.weight_version != expected_version]
    if stale:
        raise StaleRolloutError(f"step {step}: {len(stale)} rollouts from weight version {stale[0]!r}, "
                                f"expected {expected_version!r}")
    prompt_rows = [prompts[i // n] for i in range(len(rollouts))]
    rewards = task.rewards(prompt_rows, [r.response_ids for r in rollouts])
    return StepRollouts(prompt_ids=[list(p.prompt_ids) for p in prompt_rows],
                        response_ids=[list(r.response_ids) for r in rollouts],
                        rollout_log_probs=[list(r.rollout_log_probs) for r in rollouts],
                        rewards=[float(x) for x in rewards], weight_version=expected_version)


def share_from_rank0(obj: Optional[object]) -> object:
    """Broadcast a picklable object (rollouts, or an exception to re-raise) from global rank 0."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]

"""A step's rollouts as tensors on the actor's device: the one place the loop moves them there.

``step_inputs(payload, step, n_samples, pad_id, dp_rank, dp_size, device)`` returns this DP rank's
``StepInputs``: the ``RolloutBatch`` shard (whole prompt groups), its rewards, group index and per-token
policy lag, every tensor on ``device`` (the actor's: its log-probs are there, so the correction, the lag
metrics and the advantages meet one device). ``any_rank(flag)`` is the loop's stop flag: True on every rank
when any rank raised it (one MAX all-reduce through ``parallel.devices``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import RolloutBatch, row_blocks
from megatron_rl.parallel.devices import all_reduce_
from megatron_rl.trainer.async_rollout import token_lag_tensor

__all__ = ["StepInputs", "step_inputs", "shard_rows", "any_rank"]


@dataclass
class StepInputs:
    """This DP rank's part of a step (every tensor on the actor's device)."""

    shard: RolloutBatch
    """The rows of the rollout batch this DP rank trains on."""
    rewards: torch.Tensor
    """[b] float32 reward per row."""
    group_index: torch.Tensor
    """[b] int64 prompt group of each row (global row // n_samples_per_prompt)."""
    token_lag: torch.Tensor
    """[b, L-1] int64 weight versions between each response token's generation and this step (0 in sync mode)."""
    rows: range
    """The global rows of the shard."""


def shard_rows(num_rows: int, dp_rank: int, dp_size: int) -> range:
    """The rows ``RolloutBatch.shard`` gives this DP rank (whole groups: prompts_per_step % DP == 0)."""
    start, end = row_blocks(num_rows, dp_size)[dp_rank]
    return range(start, end)


def step_inputs(payload, step: int, n_samples: int, pad_id: int, dp_rank: int, dp_size: int,
                device: torch.device) -> StepInputs:
    """``payload``: the step's ``StepRollouts`` (prompt / response ids, rollout log-probs, rewards, routing,
    token versions); ``step``: completed steps (the trainer's weight version)."""
    batch = RolloutBatch.from_sequences(payload.prompt_ids, payload.response_ids, payload.rollout_log_probs,
                                        pad_id=pad_id, routing=payload.routing)
    shard = batch.shard(dp_rank, dp_size).to(device)
    rows = shard_rows(len(payload.rewards), dp_rank, dp_size)
    rewards = torch.tensor(payload.rewards[rows.start:rows.stop], dtype=torch.float32).to(device)
    group_index = torch.arange(rows.start, rows.stop, device=device) // n_samples
    versions = payload.token_versions or [[step] * len(r) for r in payload.response_ids]
    lag = token_lag_tensor([len(p) for p in payload.prompt_ids[rows.start:rows.stop]],
                           versions[rows.start:rows.stop], step, shard.max_length - 1).to(device)
    return StepInputs(shard=shard, rewards=rewards, group_index=group_index, token_lag=lag, rows=rows)


def any_rank(flag: bool, group: Optional[dist.ProcessGroup] = None) -> bool:
    """Collective over ``group`` (default: every rank): True when ``flag`` is True on any rank."""
    t = all_reduce_(torch.tensor([1.0 if flag else 0.0]), op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)

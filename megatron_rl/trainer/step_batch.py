"""One step's rows as one unit: ``StepBatch`` (what the rollout source hands the loop) and ``StepShard`` (this DP
rank's part of it, as tensors on the actor's device).

Every per-row quantity of a step -- prompt and response ids, rollout log-probs, rewards, prompt group, token
versions, MoE routing, truncation -- lives in ``StepBatch`` and is sharded by ``StepBatch.shard`` in one go, so no
parallel list can fall out of step with the rows of the ``RolloutBatch``:

    got = source.next(step)                                          # StepRows: this rank's rows only
    shard = got.shard(step, n_samples, pad_id, device)               # = batch.shard(step, n_samples, pad_id,
    shard.batch, shard.rewards, shard.group_index, shard.token_lag  #   dp_rank, dp_size, device) of the whole batch

Rank 0 cuts the whole batch with ``dp_rows`` + ``part`` and sends each rank its ``StepRows`` (``rollout_source``).

``StepShard`` tensors all sit on ``device`` (the actor's: its log-probs are there, so the correction, the lag
metrics and the advantages meet one device; the one place rollouts move there). ``any_rank(flag)`` is the loop's
stop flag: True on every rank when any rank raised it (one MAX all-reduce through ``parallel.devices``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import RolloutBatch, row_blocks
from megatron_rl.actor.micro_batching import balance_groups
from megatron_rl.parallel.devices import all_reduce_
from megatron_rl.rollout.versions import parse_version
from megatron_rl.trainer.async_rollout import token_lag_tensor

__all__ = ["StepBatch", "StepRows", "StepShard", "shard_rows", "balanced_rows", "stage_routing", "any_rank"]


@dataclass
class StepBatch:
    """One step's rollouts, prompt-major (n consecutive rows per prompt)."""

    prompt_ids: List[List[int]]
    """Per row: the prompt's token ids."""
    response_ids: List[List[int]]
    """Per row: the response's token ids, exactly as the engine sampled them."""
    rollout_log_probs: List[List[float]]
    """Per row, per response token: the engine's log-prob of it."""
    rewards: List[float]
    """Per row: the reward (with any overlong penalty)."""
    weight_version: str
    """The weight version the step's generation started from (``step-N``)."""
    routing: Optional[List[object]] = None
    """Per row: the engine's MoE routing ``[prompt + response - 1, moe_layers, topk]`` (uint8 / int16), or None
    when the engine captured none."""
    truncated: List[bool] = field(default_factory=list)
    """Per row: the response hit max_new_tokens (finish reason "length")."""
    metrics: Dict[str, float] = field(default_factory=dict)
    """The step's data / reward / length metrics (``rollout_phase`` module docstring)."""
    token_versions: List[List[int]] = field(default_factory=list)
    """Per row, per response token: the weight version (training steps done) that produced it
    (``Rollout.token_versions``); given empty, every token gets ``weight_version``'s."""
    loss_masks: List[List[int]] = field(default_factory=list)
    """Per row, per response token: 1 sampled by the model, 0 written by an environment (multi-turn
    ``Trajectory.loss_mask``); empty when every response token is the model's (single turn)."""
    scores: List[float] = field(default_factory=list)
    """Per row: the verifier's reward before the overlong penalty; empty when it equals ``rewards``."""
    reward_extras: List[Optional[Dict[str, float]]] = field(default_factory=list)
    """Per row: a dict reward's other numeric keys (verl's ``acc``; ``{}`` for a float reward, None where the reward
    failed); empty when the task reports none (multi-turn, built-in tasks). Rank 0's, for dynamic sampling: not
    sent to the other ranks (``part``)."""
    reward_baselines: List[float] = field(default_factory=list)
    """Per row: its prompt's greedy response's reward (ReMax's baseline, ``greedy_baseline.py``); empty otherwise."""
    reward_components: List[List[float]] = field(default_factory=list)
    """Per row: GDPO's reward components (``algorithm.gdpo_reward_keys``, ``reward_components.py``); empty
    otherwise."""
    rows_generated: int = 0
    """Rows generated and scored to make this batch (more than ``num_rows`` when dynamic sampling dropped prompt
    groups: the counts in ``metrics`` cover all of them); 0: ``num_rows``."""
    skipped: bool = False
    """The step trains nothing (dynamic sampling found too few groups with signal, ``on_exhausted: skip``): its
    rows are logged and dumped, the unchanged weights published as the next version."""

    def __post_init__(self):
        if not self.token_versions:  # the whole step from one version
            version = parse_version(self.weight_version)
            self.token_versions = [[version] * len(r) for r in self.response_ids]
        if len(self.token_versions) != len(self.response_ids):
            raise ValueError(f"StepBatch: {len(self.response_ids)} rows but token_versions for "
                             f"{len(self.token_versions)}")

    @property
    def num_rows(self) -> int:
        return len(self.rewards)

    @property
    def num_generated(self) -> int:
        """Rows generated and scored for this step (``rows_generated``, or ``num_rows``)."""
        return self.rows_generated or self.num_rows

    def shard(self, step: int, n_samples: int, pad_id: int, dp_rank: int, dp_size: int,
              device: torch.device, balance_tokens: bool = False) -> "StepShard":
        """This DP rank's whole prompt groups (``prompts_per_step % DP == 0``), every tensor on ``device``;
        ``step``: completed steps (the trainer's weight version, for the per-token lag). ``balance_tokens``
        (with ``actor.max_tokens_per_micro_batch``): the groups are spread over the DP ranks balancing their
        tokens (``micro_batching.balance_groups``; every rank the same number of groups) instead of contiguous
        blocks. With one mini-batch per step the result does not depend on it (the loss's denominators are
        global); with ``actor.ppo_mini_batches > 1`` each optimizer step takes a block of every rank's rows, so
        which rows share a step follows the split. The same as ``self.part(...).shard(...)``, which is what a rank
        that received only its rows does."""
        return self.part(self.dp_rows(n_samples, dp_rank, dp_size, balance_tokens), 0.0).shard(
            step, n_samples, pad_id, device)

    def dp_rows(self, n_samples: int, dp_rank: int, dp_size: int, balance_tokens: bool = False) -> List[int]:
        """The global rows of DP rank ``dp_rank`` (see ``shard``), in the order that rank trains them."""
        if balance_tokens and dp_size > 1 and self.num_rows % n_samples == 0:
            return balanced_rows([len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)], n_samples,
                                 dp_rank, dp_size)
        return list(shard_rows(self.num_rows, dp_rank, dp_size))

    def part(self, rows: Sequence[int], failed_frac: float, layers: Optional[Sequence[int]] = None) -> "StepRows":
        """What a rank that trains ``rows`` needs of this step: those rows and the step's whole-batch metrics
        (``failed_frac``: the share of rewards that failed); their routing of the MoE layers ``layers`` alone
        (indices into a record's dim 1: a pipeline stage's layers; None: every layer)."""
        pick = [int(i) for i in rows]

        def sel(values):
            return [values[i] for i in pick] if values else values

        routing = [stage_routing(self.routing[i], layers) for i in pick] if self.routing else None
        sub = StepBatch(prompt_ids=sel(self.prompt_ids), response_ids=sel(self.response_ids),
                        rollout_log_probs=sel(self.rollout_log_probs), rewards=sel(self.rewards),
                        weight_version=self.weight_version, routing=routing,
                        truncated=sel(self.truncated), metrics={}, token_versions=sel(self.token_versions),
                        loss_masks=sel(self.loss_masks), scores=sel(self.scores),
                        reward_baselines=sel(self.reward_baselines),
                        reward_components=sel(self.reward_components))
        width = max(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids))
        return StepRows(rows=sub, global_rows=pick, width=width, summary=self.summary(failed_frac),
                        metrics=dict(self.metrics), num_tokens=self.num_tokens, skipped=self.skipped)

    def summary(self, failed_frac: float) -> Dict[str, float]:
        """The step's reward and length metrics (``failed_frac``: the share of rewards that failed)."""
        resp_len = [len(r) for r in self.response_ids]
        return {"reward/mean": sum(self.rewards) / len(self.rewards),
                "reward/max": max(self.rewards), "reward/min": min(self.rewards),
                "reward/failed_frac": failed_frac,
                "response_length/mean": sum(resp_len) / len(resp_len), "response_length/max": max(resp_len)}

    @property
    def num_tokens(self) -> int:
        """Prompt + response tokens of every row."""
        return sum(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids))

    def records(self, step: int, versions: bool = True) -> Iterator[str]:
        """One JSON line per row for ``rollouts.jsonl``: ``token_versions`` per response token with ``versions``
        (the rollout source says whether tokens may lag: ``RolloutSource.dump_versions``), ``loss_mask`` per
        response token when the rows are multi-turn."""
        versions = self.token_versions if versions else [None] * len(self.response_ids)
        masks = self.loss_masks or [None] * len(self.response_ids)
        for p, r, lp, rw, tv, lm in zip(self.prompt_ids, self.response_ids, self.rollout_log_probs, self.rewards,
                                        versions, masks):
            rec = {"step": step, "prompt_ids": p, "response_ids": r, "rollout_log_probs": lp, "reward": rw,
                   "weight_version": self.weight_version}
            if tv is not None:
                rec["token_versions"] = tv
            if lm is not None:
                rec["loss_mask"] = lm
            yield json.dumps(rec)


@dataclass
class StepRows:
    """What one rank receives of a step (``StepBatch.part``): the rows it trains, where they sit in the step, and
    the step's whole-batch metrics -- not the other ranks' rows. Rank 0 also keeps the whole batch (``whole``)."""

    rows: StepBatch
    """This rank's rows (its DP shard, in training order), each with everything a row carries."""
    global_rows: List[int]
    """Their indices in the step's batch (prompt group = index // n_samples_per_prompt)."""
    width: int
    """The step's longest row (prompt + response): every rank pads its rows to it, as the whole batch is padded."""
    summary: Dict[str, float]
    """``StepBatch.summary`` of the whole step (reward and length metrics)."""
    metrics: Dict[str, float]
    """The whole step's data / reward metrics (``StepBatch.metrics``)."""
    num_tokens: int
    """Prompt + response tokens of the whole step."""
    skipped: bool = False
    """The step trains nothing (``StepBatch.skipped``): every rank receives it with its rows."""
    whole: Optional[StepBatch] = None
    """Rank 0: the whole batch (rollouts.jsonl); None elsewhere."""

    def shard(self, step: int, n_samples: int, pad_id: int, device: torch.device) -> "StepShard":
        """These rows as tensors on ``device`` (``StepBatch.shard``); ``step``: completed steps (for the lag)."""
        r = self.rows
        batch = RolloutBatch.from_sequences(r.prompt_ids, r.response_ids, r.rollout_log_probs, pad_id=pad_id,
                                            routing=r.routing, loss_masks=r.loss_masks or None)
        if batch.max_length < self.width:  # the whole batch's padded length (rounded up to it exactly)
            batch = batch.select(0, batch.num_rows, multiple_of=self.width)
        batch = batch.to(device)
        rewards = torch.tensor(r.rewards, dtype=torch.float32).to(device)
        group_index = torch.as_tensor(self.global_rows, dtype=torch.int64, device=device) // n_samples
        lag = token_lag_tensor([len(p) for p in r.prompt_ids], r.token_versions, step, batch.max_length - 1).to(device)
        extra = {name: torch.tensor(getattr(r, name), dtype=torch.float32).to(device)
                 for name in ("reward_baselines", "reward_components") if getattr(r, name)}
        return StepShard(batch=batch, rewards=rewards, group_index=group_index, token_lag=lag, rows=self.global_rows,
                         estimator_inputs=extra)


@dataclass
class StepShard:
    """This DP rank's part of a step (every tensor on the actor's device)."""

    batch: RolloutBatch
    """The rows of the rollout batch this DP rank trains on."""
    rewards: torch.Tensor
    """[b] float32 reward per row."""
    group_index: torch.Tensor
    """[b] int64 prompt group of each row (global row // n_samples_per_prompt)."""
    token_lag: torch.Tensor
    """[b, L-1] int64 weight versions between each response token's generation and this step (0 in sync mode)."""
    rows: Sequence[int]
    """The global rows of the shard, in the shard's order (a ``range`` unless balanced by tokens)."""
    estimator_inputs: Dict[str, torch.Tensor] = field(default_factory=dict)
    """The advantage estimator's extra per-row tensors (``reward_baselines`` [b] for ReMax, ``reward_components``
    [b, K] for GDPO), on the device."""


def stage_routing(record, layers: Optional[Sequence[int]]):
    """One row's routing record ``[tokens, moe_layers, topk]`` cut to the MoE layers ``layers`` (a copy holding
    only them); the record itself when ``layers`` is None, or every layer in order, or the record None."""
    if record is None or layers is None:
        return record
    record, layers = torch.as_tensor(record), [int(j) for j in layers]
    if record.dim() != 3 or (layers and max(layers) >= record.shape[1]):
        raise ValueError(f"routing record of shape {tuple(record.shape)} has no MoE layers {layers} "
                         f"([tokens, moe_layers, topk])")
    return record if layers == list(range(record.shape[1])) else record[:, layers]


def shard_rows(num_rows: int, dp_rank: int, dp_size: int) -> range:
    """The rows ``RolloutBatch.shard`` gives this DP rank (whole groups: prompts_per_step % DP == 0)."""
    start, end = row_blocks(num_rows, dp_size)[dp_rank]
    return range(start, end)


def balanced_rows(row_tokens: Sequence[int], n_samples: int, dp_rank: int, dp_size: int) -> List[int]:
    """The rows of this DP rank when whole prompt groups (``n_samples`` consecutive rows) are spread over the DP
    ranks balancing their tokens (``micro_batching.balance_groups``)."""
    groups = [sum(row_tokens[g * n_samples:(g + 1) * n_samples]) for g in range(len(row_tokens) // n_samples)]
    mine = balance_groups(groups, dp_size)[dp_rank]
    return [g * n_samples + i for g in mine for i in range(n_samples)]


def any_rank(flag: bool, group: Optional[dist.ProcessGroup] = None) -> bool:
    """Collective over ``group`` (default: every rank): True when ``flag`` is True on any rank."""
    t = all_reduce_(torch.tensor([1.0 if flag else 0.0]), op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)

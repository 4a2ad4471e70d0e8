"""``MicroBatcher``: how the actor groups a DP shard's rows into micro-batches, chosen once per actor.

Built from the layout (``ParallelDims``) and the ``actor:`` section: padded or packed rows
(``actor.sequence_packing``), a token budget or fixed rows (``actor.max_tokens_per_micro_batch`` /
``actor.micro_batch_size``), interleaved pipeline or not (``ParallelDims.interleaved``). It owns every fact these
choices imply; the actor, its log-prob pass and its train step ask it instead of re-deriving them:

* ``config_errors`` (the config's validation) and the constructor: the section's refusals, one list;
* ``balances_dp_tokens``: the trainer spreads a step's prompt groups over the DP ranks balancing their tokens;
* ``plan(lengths)``: a DP shard's micro-batches (``micro_batching.plan_micro_batches`` under the job's cost and
  budget), refused when the interleaved schedule would get fewer than PP of them;
* ``plan_is_rank_local``: whether every DP rank's plan succeeds or fails alike (else the actor agrees on errors);
* ``cut(batch, bounds, groups, per_token)``: each micro-batch's model inputs (``schedule``'s padded or packed cut;
  one shape for all under the interleaved schedule);
* ``vp_group_size(n)``: megatron's interleaved group size for a pass of n micro-batches (None without).

Usage::

    batcher = MicroBatcher.build(groups.dims, job_cfg.actor)     # ValueError naming the key on a bad combination
    plan = batcher.plan(batch.lengths.tolist())
    mbs = batcher.cut(batch.take(plan.order), plan.bounds, groups, per_token)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_rl.actor.batch import RolloutBatch
from megatron_rl.actor.micro_batching import (BUDGET_KEY, MicroBatchPlan, PackedCost, PaddedCost,
                                             interleaved_group_size, plan_micro_batches)
from megatron_rl.actor.schedule import MicroBatch, packed_micro_batches, padded_micro_batches
from megatron_rl.parallel.dims import ParallelDims

__all__ = ["MicroBatcher"]


def _errors(max_tokens: Optional[int], packed: bool, layout) -> List[str]:
    """The refusals of a token budget ``max_tokens`` with ``packed`` rows on ``layout`` (a ``ParallelConfig`` or
    ``ParallelDims``: its ``interleaved`` and ``vpp``)."""
    if max_tokens is None:
        return []
    if max_tokens < 1:
        return [f"{BUDGET_KEY}: must be >= 1 (or null: fixed micro_batch_size rows), got {max_tokens}"]
    if not packed and layout.interleaved:
        return [f"{BUDGET_KEY}: with parallel.virtual_pipeline_model_parallel_size={layout.vpp} it needs "
                f"actor.sequence_packing=true (the interleaved schedule takes micro-batches of one shape; a padded "
                f"token budget groups different numbers of rows)"]
    return []


@dataclass(frozen=True)
class MicroBatcher:
    """The micro-batching of one actor (module docstring); the constructor raises ``ValueError`` on a refused
    combination."""

    dims: ParallelDims
    """The layout: sequence multiples, PP, whether the interleaved schedule runs."""
    packed: bool = False
    """``actor.sequence_packing``: each micro-batch's rows packed into one THD sequence (else padded rows)."""
    max_tokens: Optional[int] = None
    """``actor.max_tokens_per_micro_batch``: the token budget of a micro-batch (None: fixed rows)."""
    micro_batch_size: int = 1
    """``actor.micro_batch_size``: rows per micro-batch without a token budget."""

    def __post_init__(self):
        errors = _errors(self.max_tokens, self.packed, self.dims)
        if errors:
            raise ValueError("; ".join(errors))

    @classmethod
    def build(cls, dims: ParallelDims, actor_cfg) -> "MicroBatcher":
        """The micro-batcher of an actor with layout ``dims`` and ``actor:`` section ``actor_cfg``."""
        return cls(dims, packed=bool(actor_cfg.sequence_packing), max_tokens=actor_cfg.max_tokens_per_micro_batch,
                   micro_batch_size=actor_cfg.micro_batch_size)

    @staticmethod
    def config_errors(actor_cfg, parallel_cfg) -> List[str]:
        """The refusals of the ``actor:`` section's micro-batching under the ``parallel:`` section, each naming its
        key (the config's validation; the constructor raises the same)."""
        return _errors(actor_cfg.max_tokens_per_micro_batch, bool(actor_cfg.sequence_packing), parallel_cfg)

    # ------------------------------------------------------------------ decisions
    @property
    def balances_dp_tokens(self) -> bool:
        """A step's prompt groups are spread over the DP ranks balancing their tokens (with a token budget), not
        in contiguous blocks."""
        return self.max_tokens is not None

    @property
    def cost(self):
        """Model tokens of a micro-batch of rows (``PaddedCost`` or ``PackedCost`` of the layout's multiples)."""
        if self.packed:
            return PackedCost(self.dims.seq_multiple, self.dims.cp_row_multiple)
        return PaddedCost(self.dims.seq_multiple)

    @property
    def plan_is_rank_local(self) -> bool:
        """Fixed rows without the interleaved schedule: a plan cannot fail on one DP rank only."""
        return self.max_tokens is None and not self.dims.interleaved

    def plan(self, lengths: Sequence[int], micro_batch_size: Optional[int] = None) -> MicroBatchPlan:
        """The micro-batches of a DP shard's rows of these ``lengths`` (``micro_batch_size`` overrides
        ``actor.micro_batch_size``; not used with a budget). Raises ValueError (``plan_micro_batches``'s, or a
        shard too small for the interleaved schedule: fewer than PP micro-batches)."""
        d = self.dims
        plan = plan_micro_batches(lengths, self.cost, micro_batch_size=micro_batch_size or self.micro_batch_size,
                                  max_tokens=self.max_tokens, min_micro_batches=d.pp if d.interleaved else 1)
        if d.interleaved and plan.num_micro_batches < d.pp:
            raise ValueError(f"interleaved pipeline (virtual_pipeline_model_parallel_size={d.vpp}) needs >= "
                             f"pipeline_model_parallel_size={d.pp} micro-batches per pass, this DP shard has "
                             f"{len(plan.order)} row(s): lower actor.micro_batch_size (or {BUDGET_KEY}) or send "
                             f"more rows per DP rank / mini-batch")
        return plan

    def cut(self, batch: RolloutBatch, bounds: Sequence[Tuple[int, int]], groups,
            per_token: Optional[Dict[str, Optional[torch.Tensor]]] = None) -> List[MicroBatch]:
        """The model inputs of each micro-batch: rows ``bounds`` of the (plan-ordered) ``batch`` and of its
        ``per_token`` [B, L-1] tensors, on this rank of ``groups`` (``ActorGroups``)."""
        cut = packed_micro_batches if self.packed else padded_micro_batches
        return cut(batch, bounds, groups, per_token, uniform=self.dims.interleaved)

    def vp_group_size(self, num_micro_batches: int) -> Optional[int]:
        """megatron's ``microbatch_group_size_per_vp_stage`` for a pass of ``num_micro_batches`` (None without the
        interleaved schedule)."""
        return interleaved_group_size(num_micro_batches, self.dims.pp) if self.dims.interleaved else None

"""A megatron language model without attention, for context-parallel tests on CPU.

megatron's local attention cannot run context parallelism (it needs Transformer Engine, i.e. a GPU), but the
actor's CP machinery (zigzag splits of tokens / positions / targets / per-token inputs, the gathers back, the
loss scaling over CP) can be proved with a model whose logits at a position depend only on that position:
``logits[b, t] = W tanh(e[token[b, t]] (+ p[position[b, t]]))``. Splitting the sequence over CP ranks is then
exact, so CP runs must equal CP1 runs. With ``use_positions`` the position id enters too: a packed sequence then
gives each row's values only when every segment's positions restart at 0 and each CP rank gets megatron's
per-segment chunks (tokens, positions and targets moved together).

``cp_rank`` is the common start of a forked rank of those tests (groups, the model in Megatron DDP with its
optimizer, the rank's DP shard); ``rank_result`` what the rank returns for the comparison with CP1.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch


def positionwise_lm(cp: int, vocab: int = 64, hidden: int = 16, use_positions: bool = False,
                    max_positions: int = 64):
    """The model (a ``MegatronModule`` with a pipeline hook) under a one-layer ``TransformerConfig`` with
    ``context_parallel_size=cp``; weights from a fixed seed (the same for every ``cp``)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    class PositionwiseLM(MegatronModule):
        """logits[b, t] = W tanh(e[token[b, t]] (+ p[position[b, t]])): no mixing across positions."""

        def __init__(self, config):
            super().__init__(config=config)
            self.model_type = ModelType.encoder_or_decoder
            g = torch.Generator().manual_seed(0)
            self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.5)
            self.out = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.5)
            self.pos = (torch.nn.Parameter(torch.randn(max_positions, hidden, generator=g) * 0.5)
                        if use_positions else None)

        def set_input_tensor(self, tensor):  # pipeline hook (single stage: unused)
            pass

        def forward(self, input_ids, position_ids, attention_mask=None, packed_seq_params=None):
            h = self.embed[input_ids]
            if self.pos is not None:
                h = h + self.pos[position_ids]
            return torch.tanh(h) @ self.out.t()

    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, context_parallel_size=cp,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32)
    return PositionwiseLM(cfg)


def positionwise_batch(prompt_lengths, response_lengths, vocab: int = 64, seed: int = 1):
    """A random rollout batch for these lengths with the train step's inputs: ``(batch, advantages [B, L-1],
    IS weights [B, L-1])`` (rollout log-probs in [-4, -1]; weights in [0.5, 1.5) on response tokens)."""
    from megatron_rl.actor.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in prompt_lengths]
    responses = [torch.randint(0, vocab, (r,), generator=g).tolist() for r in response_lengths]
    lps = [(-torch.rand(r, generator=g) * 3 - 1).tolist() for r in response_lengths]
    batch = RolloutBatch.from_sequences(prompts, responses, lps)
    W = batch.max_length - 1
    adv = torch.randn(len(prompt_lengths), generator=g)[:, None].expand(-1, W).contiguous()
    is_w = (torch.rand(len(prompt_lengths), W, generator=g) + 0.5) * batch.response_mask
    return batch, adv, is_w


class CPRank(NamedTuple):
    """One rank's part of a CP test (see ``cp_rank``)."""

    #: the rank's ``ActorGroups``
    groups: Any
    #: the model chunks, in Megatron DDP
    model: list
    #: the Megatron optimizer of ``model``
    opt: Any
    #: the whole batch (every DP rank's rows)
    batch: Any
    #: per-token advantages of the whole batch
    adv: torch.Tensor
    #: per-token IS weights of the whole batch
    is_w: torch.Tensor
    #: this DP rank's rows of ``batch``
    shard: Any
    #: where ``shard``'s rows stand in ``batch``
    rows: slice


def cp_rank(cp: int, build: Callable[[int], Any], data) -> CPRank:
    """Megatron's groups at context parallel ``cp`` (seed 1), then ``build(cp)`` in Megatron DDP with the
    Megatron optimizer (lr 1e-2, clipping at 1e6, no weight decay), and this DP rank's shard of ``data``
    (batch, advantages, IS weights as ``positionwise_batch`` returns them)."""
    from megatron_rl.actor.optimizer import build_optimizer, wrap_ddp
    from megatron_rl.config import ActorConfig
    from megatron_rl.parallel import ParallelConfig, initialize_model_parallel
    from megatron_rl.parallel.groups import ActorGroups

    initialize_model_parallel(ParallelConfig(context_parallel_size=cp), seed=1)
    groups = ActorGroups.from_parallel_state()
    model = wrap_ddp([build(cp)])
    opt = build_optimizer(model, ActorConfig(lr=1e-2, clip_grad=1e6, weight_decay=0.0))
    batch, adv, is_w = data
    shard = batch.shard(groups.dp_rank, groups.dp_size)
    start = sum(batch.shard(r, groups.dp_size).num_rows for r in range(groups.dp_rank))
    return CPRank(groups, model, opt, batch, adv, is_w, shard, slice(start, start + shard.num_rows))


def rank_result(groups, model, lp: torch.Tensor, ent: torch.Tensor, metrics: dict) -> dict:
    """What a CP test's rank returns: its DP rank, log-probs, entropies, metrics, and every parameter's
    gradient and updated weight (copies)."""
    return {"dp_rank": groups.dp_rank, "lp": lp, "ent": ent, "metrics": metrics,
            "grads": {n: p.main_grad.clone() for n, p in model[0].module.named_parameters()},
            "weights": {n: p.detach().clone() for n, p in model[0].module.named_parameters()}}

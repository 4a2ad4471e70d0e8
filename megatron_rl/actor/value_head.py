"""The critic's value head: GPTModel's output layer replaced by a scalar projection [hidden -> 1].

Rule: the head is replicated over TP (its one output cannot be split): with sequence parallel it gathers the
sequence first and its backward only splits (no reduce-scatter, each TP rank already holds the whole gradient),
and it is initialised from its own seeded generator so every TP / DP rank holds the same weights. Tied embeddings
are untied on every stage (the head no longer shares the embedding), so megatron all-reduces no embedding group.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["ValueHead", "attach_value_heads"]


class ValueHead(torch.nn.Module):
    """``score``: [hidden] -> 1 with bias (HF's ``*ForTokenClassification`` score with num_labels=1); called as
    megatron's output layer ``(hidden [s, b, h], weight=None, runtime_gather_output=None) -> ([s, b, 1], None)``."""

    def __init__(self, hidden_size: int, init_std: float, seed: int, dtype: torch.dtype, device,
                 sequence_parallel: bool, tp_group) -> None:
        super().__init__()
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        w = torch.randn(1, hidden_size, generator=gen, dtype=torch.float32) * float(init_std)
        self.weight = torch.nn.Parameter(w.to(device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
        self.sequence_parallel = bool(sequence_parallel)
        self.tp_group = tp_group

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                                 group=self.tp_group)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def attach_value_heads(chunks: Sequence[torch.nn.Module], init_std: float, seed: int, sequence_parallel: bool,
                       tp_group) -> None:
    """In place, before DDP: the last stage's output layer becomes a ``ValueHead``; every chunk untied."""
    for chunk in chunks:
        chunk.share_embeddings_and_output_weights = False
        if not chunk.post_process:
            continue
        old = chunk.output_layer
        ref = next(chunk.parameters())  # the dtype and device of this chunk's weights
        chunk.output_layer = ValueHead(chunk.config.hidden_size, init_std, seed, ref.dtype, ref.device,
                                       sequence_parallel, tp_group)
        del old

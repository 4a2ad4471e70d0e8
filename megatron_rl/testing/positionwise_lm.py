"""A megatron language model without attention, for context-parallel tests on CPU.

megatron's local attention cannot run context parallelism (it needs Transformer Engine, i.e. a GPU), but the
actor's CP machinery (zigzag splits of tokens / positions / targets / per-token inputs, the gathers back, the
loss scaling over CP) can be proved with a model whose logits at a position depend only on that position:
``logits[b, t] = W tanh(e[token[b, t]] (+ p[position[b, t]]))``. Splitting the sequence over CP ranks is then
exact, so CP runs must equal CP1 runs. With ``use_positions`` the position id enters too: a packed sequence then
gives each row's values only when every segment's positions restart at 0 and each CP rank gets megatron's
per-segment chunks (tokens, positions and targets moved together).
"""
from __future__ import annotations

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

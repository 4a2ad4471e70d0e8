"""Capture MoE routing from an HF ``transformers`` model while it generates (the embedded engine's R3).

Every MoE layer of Qwen2-MoE / Qwen3-MoE (transformers >= 5) has a router module (``*TopKRouter``,
``mlp.gate``) returning ``(router_logits, routing_weights, selected_experts)``; a forward hook keeps
``selected_experts`` ([tokens, topk], tokens = batch x positions of that forward, row-major) of each call.
The engine turns the calls of one generation into per-rollout tensors ``[prompt + response - 1,
moe_layers, topk]`` (uint8 when experts <= 256, else int16): every token the engine fed through the
model — the prompt, then each sampled token but the last — which is what ``RolloutBatch.routing``
replays (``megatron_rl.actor.routing``). ``join_routing`` stitches the routing of a row generated in several
calls (async segments, multi-turn turns) so every token keeps the routing it was sampled with.

Usage::

    cap = RouterCapture(model)             # None-safe: cap.enabled is False for dense models
    with cap:
        model(...)                         # prefill
        ids = cap.take()                   # [tokens, moe_layers, topk] int64 of that forward
"""
from __future__ import annotations

from typing import List, Optional

import torch

from megatron_rl.actor.routing import routing_dtype

__all__ = ["hf_moe_routers", "RouterCapture", "join_routing"]


def hf_moe_routers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The router modules of ``model``'s MoE layers, in layer order (empty for dense models): Qwen's
    ``*TopKRouter`` and DeepSeek-V3's ``DeepseekV3TopkRouter`` (same ``(logits, weights, indices)`` output)."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


class RouterCapture:
    """Forward hooks on every MoE router of an HF model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = hf_moe_routers(model)
        cfg = getattr(model, "config", None)
        self.num_experts = int(getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0) or 0)
        self.dtype = routing_dtype(self.num_experts) if self.routers else None
        self._calls: List[List[torch.Tensor]] = [[] for _ in self.routers]
        self._handles = []

    @property
    def enabled(self) -> bool:
        """The model has MoE routers."""
        return bool(self.routers)

    def __enter__(self) -> "RouterCapture":
        for j, r in enumerate(self.routers):
            self._handles.append(r.register_forward_hook(self._hook(j)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._calls = [[] for _ in self.routers]

    def _hook(self, j: int):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) >= 3):
                raise RuntimeError(f"RouterCapture: router {type(module).__name__} (MoE layer {j}) returned "
                                   f"{type(output).__name__}, expected (logits, weights, expert ids)")
            self._calls[j].append(output[2].detach())
        return hook

    def take(self) -> Optional[torch.Tensor]:
        """``[tokens, moe_layers, topk]`` expert ids (compact dtype) of the one forward since the last take."""
        if not self.routers:
            return None
        if any(len(c) != 1 for c in self._calls):
            raise RuntimeError(f"RouterCapture: expected one router call per MoE layer since the last take, got "
                               f"{[len(c) for c in self._calls]}")
        out = torch.stack([c[0] for c in self._calls], dim=1).to(self.dtype)
        self._calls = [[] for _ in self.routers]
        return out


def join_routing(before, cont, fed_before: int):
    """MoE routing of a row continued in a later engine call (an async segment, the next turn of a multi-turn
    trajectory): the first ``fed_before`` token positions as the earlier calls routed them (the weights and
    the context that sampled those tokens), the rest from the continuation call (whose prompt re-feeds the
    earlier tokens; only its new positions are kept). None when either call captured none."""
    if before is None or cont is None:
        return None
    return torch.cat([torch.as_tensor(before)[:fed_before], torch.as_tensor(cont)[fed_before:]], dim=0)

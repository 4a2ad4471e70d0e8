"""How a LoRA job's trained adapters reach the engine (``rollout.lora_sync``), chosen once with the job's
``WeightSyncSettings``.

Rule: ``merged`` changes only what the sender reads -- every adapted weight becomes W + (alpha/rank)·B·A
(``lora.merge``, fp32, cast once by the path's own cast to the engine dtype) -- so the bucketed modes, delta sync
and checksum verification run unchanged; ``adapter`` moves only A and B (docs/lora.md).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.lora.merge import lora_scale, merged_items

__all__ = ["LORA_SYNC_MODES", "LoraSync"]

#: ``rollout.lora_sync`` values: merged weights through the bucketed paths, or the adapters alone.
LORA_SYNC_MODES = ("merged", "adapter")


@dataclass(frozen=True)
class LoraSync:
    """A LoRA job's sync: which mode, and the adapters' scaling."""

    mode: str
    """``rollout.lora_sync``: "merged" or "adapter"."""
    rank: int
    """``actor.lora.rank`` (> 0)."""
    alpha: float
    """``actor.lora.alpha``."""

    @property
    def scale(self) -> float:
        """alpha / rank, PEFT's scaling."""
        return lora_scale(self.rank, self.alpha)

    def view(self, dtype: Optional[torch.dtype] = None):
        """The ``convert.live.TensorView`` the sender reads the model through: merged weights (fp32, or cast once
        to ``dtype``), adapters left out."""
        return functools.partial(merged_items, scale=self.scale, dtype=dtype)

    @classmethod
    def of(cls, lora, rollout) -> Optional["LoraSync"]:
        """The sync of ``actor.lora`` (None or rank 0: no adapters) with ``rollout.lora_sync``."""
        if lora is None or not int(getattr(lora, "rank", 0) or 0):
            return None
        mode = getattr(rollout, "lora_sync", "merged")
        if mode not in LORA_SYNC_MODES:
            raise ValueError(f"rollout.lora_sync: {mode!r} is not one of {', '.join(LORA_SYNC_MODES)}")
        return cls(mode=mode, rank=int(lora.rank), alpha=float(lora.alpha))

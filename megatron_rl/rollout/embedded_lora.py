"""LoRA adapters applied in the forward of the embedded engine's ``transformers`` model (adapter-only sync).

Rule: the base weights are never touched -- each adapted ``nn.Linear`` gets one forward hook adding
``scale * B(A(x))`` in the engine's dtype, and loading a version replaces every hook at once, after every tensor
of the new adapter was checked (all-or-nothing). Tensors arrive under PEFT's names
(``base_model.model.<HF module>.lora_A|B.weight``: ``convert.lora_export``).
"""
from __future__ import annotations

from typing import Dict, Mapping, Tuple

import torch
import torch.nn.functional as F

from megatron_rl.weight_sync.endpoint import WeightSyncError

__all__ = ["EmbeddedAdapters", "PEFT_PREFIX"]

PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


class EmbeddedAdapters:
    """The adapter of one model: ``load`` checks and installs a version; ``version`` is the one installed."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.version: str | None = None
        self._hooks: list = []

    def _pairs(self, tensors: Mapping[str, torch.Tensor]) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """{module path: (A, B)} checked against the model (every name, module kind and shape)."""
        out, bad = {}, []
        for key in tensors:
            if not key.endswith((_A, _B)) or not key.startswith(PEFT_PREFIX):
                bad.append(f"{key!r} is not a PEFT LoRA tensor name")
                continue
            path = key[len(PEFT_PREFIX):-len(_A)]
            if path in out:
                continue
            a, b = tensors.get(PEFT_PREFIX + path + _A), tensors.get(PEFT_PREFIX + path + _B)
            if a is None or b is None:
                bad.append(f"{path!r} has lora_A without lora_B or the reverse")
                continue
            try:
                module = self.model.get_submodule(path)
            except AttributeError:
                bad.append(f"{path!r}: no such module (experts fused by transformers cannot take per-expert "
                           f"adapters here: use rollout.lora_sync: merged)")
                continue
            if not isinstance(module, torch.nn.Linear):
                bad.append(f"{path!r} is a {type(module).__name__}, not nn.Linear")
                continue
            w = module.weight
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0] \
                    or a.shape[0] != b.shape[1]:
                bad.append(f"{path!r}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit weight {tuple(w.shape)}")
                continue
            out[path] = (a, b)
        if bad:
            raise WeightSyncError("adapter-only sync to the embedded engine: " + "; ".join(bad[:8]))
        return out

    def load(self, tensors: Mapping[str, torch.Tensor], scale: float, version: str) -> None:
        """Install the adapter ``tensors`` (PEFT names) with ``scale`` = alpha / rank, tagged ``version``; on
        error the previous adapter stays installed and ``WeightSyncError`` names the bad tensors."""
        pairs = self._pairs(tensors)
        dev = next(self.model.parameters()).device
        weights = {p: (a.detach().to(dev, self.dtype).contiguous(), b.detach().to(dev, self.dtype).contiguous())
                   for p, (a, b) in pairs.items()}
        self.clear()
        for path, (a, b) in weights.items():
            def hook(module, inputs, output, a=a, b=b):
                return output + scale * F.linear(F.linear(inputs[0], a), b)
            self._hooks.append(self.model.get_submodule(path).register_forward_hook(hook))
        self.version = version

    def clear(self) -> None:
        """Remove the installed adapter (the base model alone)."""
        for h in self._hooks:
            h.remove()
        self._hooks, self.version = [], None

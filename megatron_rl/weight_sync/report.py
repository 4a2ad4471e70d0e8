"""What one weight sync moved and verified (``SyncReport``), the source of the step's ``weight_sync/*`` metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

__all__ = ["SyncReport"]


@dataclass
class SyncReport:
    """What one sync moved (metrics of the step)."""

    bytes: int = 0
    """Bytes handed to the engine (in the engine's dtype; the export size for disk)."""
    buckets: int = 0
    """Buckets handed to the engine (0 for disk)."""
    verified: bool = False
    """The engine's copies of the sampled tensors matched the trainer's."""
    checked: List[str] = field(default_factory=list)
    """The engine tensors whose checksums were compared."""
    verified_frac: float = 0.0
    """Fraction of the model's parameters (elements) inside the engine tensors compared."""
    elements: int = 0
    """Delta syncs: elements of the tensors synced (0: not a delta sync)."""
    changed: int = 0
    """Delta syncs: elements sent as changed (a dense tensor counts whole)."""
    senders: int = 1
    """Trainer ranks that sent their own tensors to the engine (1 for disk and owned buckets)."""
    bytes_by_sender: Dict[int, int] = field(default_factory=dict)
    """Global rank -> bytes it sent (streamed syncs)."""

    def metrics(self) -> Dict[str, float]:
        """``weight_sync/bytes`` (= ``bytes_sent``: what the engine was sent), ``buckets``, ``verified``,
        ``verified_param_frac``, ``senders``; delta syncs add ``changed_frac`` (changed / all elements)."""
        out = {"weight_sync/bytes": float(self.bytes), "weight_sync/bytes_sent": float(self.bytes),
               "weight_sync/buckets": float(self.buckets), "weight_sync/verified": 1.0 if self.verified else 0.0,
               "weight_sync/verified_param_frac": float(self.verified_frac),
               "weight_sync/senders": float(self.senders)}
        if self.elements:
            out["weight_sync/changed_frac"] = self.changed / self.elements
        return out


"""The error that ends a rollout step: the caller must not apply the step (``RolloutError``).

Its one home below both the engines (``rollout/``) and the weight sync (``weight_sync/``): an engine raises its
subclasses while generating, the weight sync raises ``weight_sync.endpoint.WeightSyncError``.
"""
from __future__ import annotations

__all__ = ["RolloutError"]


class RolloutError(RuntimeError):
    """A rollout step failed; the caller must not apply the step."""

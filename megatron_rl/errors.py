"""Errors shared across layers: the one that ends a rollout step (``RolloutError``: the caller must not apply the
step) and a choice of the job that could not be built (``Unbuilt``: its problems, each naming its dotted key).

Their one home below the engines (``rollout/``), the weight sync (``weight_sync/``) and the job plan (``plan/``): an
engine raises ``RolloutError``'s subclasses while generating, the weight sync ``weight_sync.endpoint.WeightSyncError``;
a builder of the plan's objects raises ``Unbuilt`` (``plan.job._Problems`` collects it).
"""
from __future__ import annotations

from typing import List

__all__ = ["RolloutError", "Unbuilt"]


class RolloutError(RuntimeError):
    """A rollout step failed; the caller must not apply the step."""


class Unbuilt(Exception):
    """A choice of the job that could not be built: its problems, each naming its dotted key."""

    def __init__(self, problems: List[str]):
        super().__init__("; ".join(problems))
        self.problems = list(problems)

"""A step whose rewards mostly failed is an error, not a step trained on zeros.

The reward pool scores a failing or timed-out sample 0.0 and counts it (``reward/failed``,
``reward/timed_out`` in the step's metrics). A few such samples are noise; a step where more than
``data.max_reward_failure_frac`` of the samples failed (a reward that cannot import its dependency, a
``module:function`` that raises on every sample, a timeout too short for the verifier) would train on an
all-zero signal while every other metric looks normal. ``reward_failure_error`` returns the named error
for such a step; the loop raises it on every rank before the step trains.

Usage::

    frac = failed_fraction(payload.metrics, len(payload.rewards))            # metric reward/failed_frac
    err = reward_failure_error(payload.metrics, len(payload.rewards), 0.5, step=3)   # None or the error
"""
from __future__ import annotations

from typing import Mapping, Optional

from megatron_rl.rollout.base import RolloutError

__all__ = ["RewardFailureError", "failed_fraction", "reward_failure_error"]


class RewardFailureError(RolloutError):
    """More than ``data.max_reward_failure_frac`` of a step's rewards failed or timed out."""


def failed_fraction(metrics: Mapping[str, float], num_samples: int) -> float:
    """(``reward/failed`` + ``reward/timed_out``) / ``num_samples`` (0 when there are no samples)."""
    if num_samples <= 0:
        return 0.0
    return (float(metrics.get("reward/failed", 0.0)) + float(metrics.get("reward/timed_out", 0.0))) / num_samples


def reward_failure_error(metrics: Mapping[str, float], num_samples: int, max_frac: float,
                         step: int) -> Optional[RewardFailureError]:
    """The error for step ``step`` (1-based) when its failed fraction exceeds ``max_frac``, else None."""
    frac = failed_fraction(metrics, num_samples)
    if frac <= max_frac:
        return None
    failed, timed_out = int(metrics.get("reward/failed", 0)), int(metrics.get("reward/timed_out", 0))
    return RewardFailureError(
        f"step {step}: {failed} reward(s) failed and {timed_out} timed out of {num_samples} samples "
        f"({frac:.0%} > data.max_reward_failure_frac={max_frac:g}); the step is not trained. The first failure "
        f"is printed above by rank 0 (a missing reward dependency, a reward function that raises, or "
        f"data.reward_timeout_s too short)")

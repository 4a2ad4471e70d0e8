"""Exactly reducible loss metrics: each metric is a (sum, count) pair, merged by adding both.

The mean of a metric over the global batch is sum(sums) / sum(counts) over all micro-batches and
ranks — never a mean of per-micro-batch means. ``reduce_metrics`` does that across a process group
with ONE packed all_reduce; ``metrics_to_floats`` turns the result into plain floats for logging.

Usage::

    total = merge_metrics([out.metrics for out in micro_batch_outputs])   # local micro-batches
    total = reduce_metrics(total, group=dp_group)                           # across DP ranks
    log.update(metrics_to_floats(total, prefix="actor/"))                   # {"actor/pg_clipfrac": ...}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Mapping

import torch

from megatron_rl.parallel.devices import all_reduce_


@dataclass(frozen=True)
class SumCount:
    """A metric's sum over the tokens it covers and the number of those tokens (0-d float64 tensors)."""

    sum: torch.Tensor
    """Sum of the per-token values (detached)."""

    count: torch.Tensor
    """Number of tokens summed (valid tokens after rejection sampling)."""

    def __add__(self, other: "SumCount") -> "SumCount":
        return SumCount(self.sum + other.sum, self.count + other.count)

    def mean(self) -> float:
        """sum / count, or 0.0 when count == 0 (no valid token: defined, never NaN)."""
        c = float(self.count)
        return float(self.sum) / c if c > 0 else 0.0


def sum_count(values: torch.Tensor, valid: torch.Tensor) -> SumCount:
    """SumCount of ``values`` over the positions where ``valid`` (bool) is True, in float64."""
    v = torch.where(valid, values.detach().to(torch.float64), torch.zeros((), dtype=torch.float64,
                                                                          device=values.device))
    return SumCount(v.sum(), valid.sum().to(torch.float64))


def merge_metrics(metrics: Iterable[Mapping[str, SumCount]]) -> Dict[str, SumCount]:
    """Add per-micro-batch metric dicts key by key (keys missing from some dicts are allowed)."""
    out: Dict[str, SumCount] = {}
    for m in metrics:
        for k, v in m.items():
            out[k] = out[k] + v if k in out else v
    return out


def reduce_metrics(metrics: Mapping[str, SumCount], group=None) -> Dict[str, SumCount]:
    """Sum every (sum, count) over ``group`` with one packed all_reduce; ``group=None`` returns the
    metrics unchanged (no communication). All ranks must pass the same keys."""
    if group is None or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    packed = torch.stack([t for k in keys for t in (metrics[k].sum, metrics[k].count)]).to(torch.float64)
    all_reduce_(packed, group=group)  # staged for the group's backend
    return {k: SumCount(packed[2 * i], packed[2 * i + 1]) for i, k in enumerate(keys)}


def metrics_to_floats(metrics: Mapping[str, SumCount], prefix: str = "actor/") -> Dict[str, float]:
    """{prefix + name: mean} for logging (0.0 for a metric with no tokens)."""
    return {prefix + k: v.mean() for k, v in metrics.items()}

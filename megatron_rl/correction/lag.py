"""Policy-lag diagnostics for asynchronous training: the rollout-vs-trainer mismatch split by how many
weight versions old each token is.

In async mode ``pi_rollout`` (what the engine sampled with, any admissible version) differs from ``pi_old``
(the trainer's recompute at the current weights) by precision **and** policy lag; the IS weights and
rejection of ``compute_rollout_correction`` correct both together. These metrics separate them: tokens of
lag 0 carry the precision mismatch alone, lagged tokens carry lag + precision.

``policy_lag_metrics(train_lp, rollout_lp, mask, lag, max_lag, group)`` -> (keys are exact over ``group``:
token sums and counts are all-reduced in float64, two collectives). Every input lives on one device (the
actor's) and the sums are made there; ``parallel.devices`` stages them for the group's backend.

* ``rollout/staleness_mean``, ``rollout/staleness_max`` — lag in versions over valid tokens;
* ``rollout/staleness_frac_lag{l}`` for l = 0..max_lag — the histogram (fractions of valid tokens);
* ``rollout_corr/lag{l}_kl`` = mm_l(lp_r - lp_t), ``rollout_corr/lag{l}_k3_kl`` = mm_l(exp(d) - d - 1),
  d = clamp(lp_t - lp_r, +-20), mm_l the token mean over valid tokens of lag l (only for lags that have
  tokens, so no NaN; ``rollout/staleness_tokens_lag{l}`` gives the counts);
* ``rollout_corr/lagged_k3_kl`` (all lags > 0 together) and ``rollout_corr/lagged_token_fraction``.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_rl.numerics import clamp_log_ratio
from megatron_rl.parallel.devices import all_reduce_

__all__ = ["policy_lag_metrics"]


def policy_lag_metrics(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       token_lag: torch.Tensor, max_lag: int, group: Optional[dist.ProcessGroup] = None
                       ) -> Dict[str, float]:
    """See the module docstring. All tensors ``[B, T]``; ``token_lag`` int (negative lags are an error).
    ``group``: the data-parallel group over which the batch is split (None: no reduction)."""
    shapes = {"train_log_probs": train_log_probs.shape, "rollout_log_probs": rollout_log_probs.shape,
              "response_mask": response_mask.shape, "token_lag": token_lag.shape}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"policy_lag_metrics: shapes differ: {shapes}")
    devices = {"train_log_probs": train_log_probs.device, "rollout_log_probs": rollout_log_probs.device,
               "response_mask": response_mask.device, "token_lag": token_lag.device}
    if len(set(devices.values())) != 1:
        raise ValueError(f"policy_lag_metrics: tensors on different devices: "
                         f"{ {k: str(v) for k, v in devices.items()} }")
    if max_lag < 0:
        raise ValueError(f"policy_lag_metrics: max_lag must be >= 0, got {max_lag}")
    m = response_mask.bool()
    lag = token_lag.long()
    if bool(((lag < 0) | (lag > max_lag))[m].any()):
        raise ValueError(f"policy_lag_metrics: token_lag outside [0, {max_lag}] on valid tokens "
                         f"(min {int(lag[m].min())}, max {int(lag[m].max())})")
    d = clamp_log_ratio(train_log_probs.double() - rollout_log_probs.double())
    k1 = -d
    k3 = torch.exp(d) - d - 1.0
    L = max_lag + 1
    # per lag: [count, sum k1, sum k3]; then the sum of lags and the max lag
    dev = train_log_probs.device
    sums = torch.zeros(3 * L + 1, dtype=torch.float64, device=dev)
    for lv in range(L):
        sel = m & (lag == lv)
        sums[3 * lv] = sel.sum()
        sums[3 * lv + 1] = k1[sel].sum()
        sums[3 * lv + 2] = k3[sel].sum()
    sums[3 * L] = lag[m].double().sum()
    lag_valid = torch.where(m, lag, torch.full_like(lag, -1))  # -1: no valid token on this rank
    max_seen = (lag_valid.amax() if lag.numel() else torch.full((), -1, device=dev)).to(torch.float64).reshape(1)
    if group is not None:  # None: this process holds the whole batch
        all_reduce_(sums, group=group)
        all_reduce_(max_seen, op=dist.ReduceOp.MAX, group=group)
    counts = sums[0::3][:L]
    total = float(counts.sum())
    out: Dict[str, float] = {}
    if total == 0:
        return {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}
    out["rollout/staleness_mean"] = float(sums[3 * L]) / total
    out["rollout/staleness_max"] = float(max_seen)
    lagged_n = lagged_k3 = 0.0
    for lv in range(L):
        n = float(counts[lv])
        out[f"rollout/staleness_frac_lag{lv}"] = n / total
        out[f"rollout/staleness_tokens_lag{lv}"] = n
        if n > 0:
            out[f"rollout_corr/lag{lv}_kl"] = float(sums[3 * lv + 1]) / n
            out[f"rollout_corr/lag{lv}_k3_kl"] = float(sums[3 * lv + 2]) / n
        if lv > 0:
            lagged_n += n
            lagged_k3 += float(sums[3 * lv + 2])
    out["rollout_corr/lagged_token_fraction"] = lagged_n / total
    if lagged_n > 0:
        out["rollout_corr/lagged_k3_kl"] = lagged_k3 / lagged_n
    return out

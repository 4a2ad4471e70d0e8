"""The Optimal Token Baseline (verl 0.9.1's ``optimal_token_baseline``) and its multi-turn form
(``tir_optimal_token_baseline``): per group and per step t, B_t = sum_i G_t W_t / (sum_i W_t + epsilon) with G_t the
reward-to-go and W_t = sum_{j<=t} (1 - 2 pi_j + sum pi^2) [x rho_j^2 with IS weights] the cumulative path variance.
The rule that tells the two apart: the single-turn form aligns trajectories by token position (masked positions
count as zero weight), the multi-turn form by the index among each row's response tokens (observation tokens
squeezed out, a row with no response token skipped). ``handle_zero_tail`` zeroes the baseline of the one longest
row beyond the second-longest length. Single-sample groups: no baseline (advantage = return)."""
from __future__ import annotations

import torch

from megatron_rl.algo.groups import dense_group_ids

F64 = torch.float64


def _path_weights(response_mask, old_log_probs, sum_pi_squared, rollout_is_weights):
    w = 1 - 2 * torch.exp(old_log_probs.to(F64)) + sum_pi_squared.to(F64)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(F64) ** 2
    return (w * response_mask.to(F64)).cumsum(dim=-1)


def _baselines(R, W, M, lengths, gid, handle_zero_tail, epsilon, include):
    """Per-group per-position baselines ``[B, L]`` from returns ``R``, cumulative weights ``W`` and mask ``M``
    (aligned ``[B, L]``); rows outside ``include`` or in single-sample groups get 0."""
    base = torch.zeros_like(R)
    for g in torch.unique(gid[include]).tolist():
        rows = torch.nonzero((gid == g) & include).flatten()
        if rows.numel() < 2:
            continue
        num = (R[rows] * W[rows] * M[rows]).sum(dim=0)
        den = (W[rows] * M[rows]).sum(dim=0) + epsilon
        base[rows] = (num / den).unsqueeze(0)
        if handle_zero_tail:
            ln = lengths[rows]
            srt = torch.sort(ln).values
            top, second = int(srt[-1]), int(srt[-2])
            at = torch.nonzero(ln == top).flatten()
            if at.numel() == 1 and top > second:
                base[rows[at[0]], second:] = 0.0
    return base


@torch.no_grad()
def compute_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                             sum_pi_squared, rollout_is_weights=None, handle_zero_tail: bool = True,
                                             epsilon: float = 1e-8, **kwargs):
    """OTB aligned by token position: advantages = (G - B) x mask; returns = G (reward-to-go of the masked
    rewards)."""
    m = response_mask.to(F64)
    returns = (token_level_rewards.to(F64) * m).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    W = _path_weights(response_mask, old_log_probs, sum_pi_squared, rollout_is_weights)
    gid = dense_group_ids(index, returns.shape[0], returns.device)
    include = torch.ones_like(gid, dtype=torch.bool)
    base = _baselines(returns, W, m, m.sum(dim=-1), gid, handle_zero_tail, epsilon, include)
    dt = token_level_rewards.dtype
    return ((returns - base) * m).to(dt), returns.to(dt)


@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                                        sum_pi_squared, rollout_is_weights=None,
                                                        handle_zero_tail: bool = True, epsilon: float = 1e-8,
                                                        **kwargs):
    """OTB aligned by the index among each row's response tokens (multi-turn: observations squeezed out)."""
    m = response_mask.to(F64)
    mb = response_mask.bool()
    returns = (token_level_rewards.to(F64) * m).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    W = _path_weights(response_mask, old_log_probs, sum_pi_squared, rollout_is_weights)
    B = returns.shape[0]
    lengths = mb.sum(dim=-1)
    L = int(lengths.max()) if B else 0
    # the k-th response token of row i sits at column k of the squeezed [B, L] tensors
    col = (mb.cumsum(dim=-1) - 1).clamp(min=0)
    rows_i = torch.arange(B, device=returns.device).unsqueeze(-1).expand_as(col)
    Wq = torch.zeros(B, L, dtype=F64, device=returns.device)
    Rq = torch.zeros_like(Wq)
    Wq[rows_i[mb], col[mb]] = W[mb]
    Rq[rows_i[mb], col[mb]] = returns[mb]
    Mq = torch.ones_like(Wq)   # verl sums the zero-padded squeezed rows unmasked
    gid = dense_group_ids(index, B, returns.device)
    base = _baselines(Rq, Wq, Mq, lengths, gid, handle_zero_tail, epsilon, lengths > 0)
    advq = Rq - base
    adv = torch.zeros_like(returns)
    adv[mb] = advq[rows_i[mb], col[mb]]
    dt = token_level_rewards.dtype
    return (adv * m).to(dt), returns.to(dt)

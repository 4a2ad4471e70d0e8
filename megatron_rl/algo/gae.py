"""Token-level return estimators: GAE (with a critic's values), REINFORCE++ (discounted return) and ReMax (return
minus a greedy baseline), in verl 0.9.1's signatures and semantics. The rule: a token with ``response_mask`` 0 (an
observation / environment token, or padding) is skipped by the recursion -- its value and TD error do not enter,
the running quantity is carried through it unchanged (verl's multi-turn rule). Whitening is global over the batch
(``group``: the DP group, ``whiten.masked_whiten``)."""
from __future__ import annotations

import torch

from megatron_rl.algo.whiten import masked_whiten


@torch.no_grad()
def compute_gae_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                                 gamma: float, lam: float, group=None, all_reduce=None, **kwargs):
    """GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1} over the masked tokens; returns
    = A + V (before whitening); advantages whitened over the (global) batch. ``[B, T]`` each."""
    m = response_mask.to(torch.float64)
    r, v = token_level_rewards.to(torch.float64), values.to(torch.float64)
    B, T = r.shape
    next_v = torch.zeros(B, dtype=torch.float64, device=r.device)
    last = torch.zeros(B, dtype=torch.float64, device=r.device)
    adv = torch.zeros_like(r)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_v - v[:, t]
        cand = delta + gamma * lam * last
        next_v = torch.where(m[:, t] > 0, v[:, t], next_v)
        last = torch.where(m[:, t] > 0, cand, last)
        adv[:, t] = last
    returns = (adv + v).to(token_level_rewards.dtype)
    return masked_whiten(adv, response_mask, group, all_reduce).to(token_level_rewards.dtype), returns


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                                  config=None, group=None, all_reduce=None, **kwargs):
    """REINFORCE++: discounted return G_t = r_t + gamma G_{t+1} over the masked tokens (``config.gamma``),
    advantages = whitened G (global batch) x mask; returns = G x mask."""
    if config is None:
        raise ValueError("reinforce_plus_plus needs config (algorithm.gamma)")
    gamma = float(config.gamma)
    m = response_mask.to(torch.float64)
    r = token_level_rewards.to(torch.float64)
    running = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
    ret = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        new = r[:, t] + gamma * running
        ret[:, t] = new * m[:, t]
        running = torch.where(m[:, t] > 0, new, running)
    adv = masked_whiten(ret, response_mask, group, all_reduce) * m
    return adv.to(token_level_rewards.dtype), ret.to(token_level_rewards.dtype)


@torch.no_grad()
def compute_remax_outcome_advantage(token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor,
                                    response_mask: torch.Tensor, config=None, **kwargs):
    """ReMax: returns = reward-to-go of the masked rewards; advantages = returns - reward_baselines (the greedy
    response's reward, ``[B]``) x mask."""
    m = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * m).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * m, returns

"""PPO with a critic inside a step: values, GAE advantages and returns, the critic's update, verl's critic metrics.

    phase = CriticPhase(critic, cfg)              # the job's critic (plan.critic built it); NoCritic without one
    adv, returns, values = phase.advantages(rows, rewards, corr.loss_mask, group=actor.dp_group)   # [B, L-1] each
    metrics = phase.train(rows, values, returns, corr.loss_mask, group=actor.dp_group)   # critic/* (verl's names)
    if phase.actor_trains(step): actor.train_step(...)

Rule: the outcome reward sits on each row's last token (column length - 2; verl's ``token_level_rewards``); GAE and
the value loss run over the loss's mask -- verl's ``response_mask`` after the rollout correction's rejection
(decoupled mode replaces it before ``compute_advantage``), multi-turn environment tokens 0: skipped by the
recursion, as verl's -- and GAE whitens over the whole batch (the DP group); the actor skips its update while ``critic_warmup > step + 1`` (verl's comparison
with its 1-based global step).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron_rl.algo.gae import compute_gae_advantage_return
from megatron_rl.algo.whiten import global_sum
from megatron_rl.parallel.devices import all_reduce_

__all__ = ["CriticPhase", "NoCritic", "token_level_rewards", "explained_variance"]


def token_level_rewards(rows, rewards: torch.Tensor) -> torch.Tensor:
    """[B, L-1]: each row's reward at its last token's column (length - 2), 0 elsewhere."""
    B, W = rows.num_rows, rows.max_length - 1
    out = torch.zeros(B, W, dtype=torch.float32, device=rewards.device)
    if B:
        last = (rows.lengths.to(rewards.device) - 2).clamp(min=0)
        out[torch.arange(B, device=rewards.device), last] = rewards.to(torch.float32)
    return out


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, group=None) -> float:
    """verl's ``critic/vf_explained_var`` over the whole batch: 1 - var(R - V) / (var(R) + 1e-5), unbiased variances
    over the valid tokens (one all-reduce over ``group``); NaN with fewer than 2 valid tokens."""
    m = mask.to(torch.float64)
    r = returns.to(torch.float64) * m
    d = (returns.to(torch.float64) - values.to(torch.float64)) * m
    s = global_sum(torch.stack([m.sum(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()]), group, all_reduce_)
    n = float(s[0])
    if n < 2:
        return float("nan")
    var_r = (float(s[2]) - float(s[1]) ** 2 / n) / (n - 1)
    var_d = (float(s[4]) - float(s[3]) ** 2 / n) / (n - 1)
    return 1.0 - var_d / (var_r + 1e-5)


_token_level_rewards = token_level_rewards   # the advantages' keyword shadows the function


class NoCritic:
    """A job without a critic: the actor trains every step."""

    enabled = False

    def actor_trains(self, step: int) -> bool:
        return True


class CriticPhase:
    """The job's critic and its GAE settings (``critic:``, ``algorithm.gamma`` / ``lam``)."""

    enabled = True

    def __init__(self, critic, cfg) -> None:
        self.critic = critic
        self.gamma = float(cfg.algorithm.gamma)
        self.lam = float(cfg.algorithm.lam)
        self.warmup = int(cfg.critic.critic_warmup)

    def actor_trains(self, step: int) -> bool:
        """verl: ``critic_warmup > global_steps`` skips the actor (global_steps = step + 1)."""
        return not self.warmup > step + 1

    def token_level_scores(self, rows, rewards: torch.Tensor) -> torch.Tensor:
        """[B, L-1]: where GAE puts each row's reward (``token_level_rewards``), for the KL in the reward."""
        return token_level_rewards(rows, rewards)

    def advantages(self, rows, rewards: torch.Tensor, mask: torch.Tensor, group=None,
                   token_level_rewards: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(advantages, returns, values) [B, L-1] of this DP shard over ``mask`` (the loss's: after rejection);
        ``token_level_rewards``: the per-token rewards with the KL penalty (else ``rewards`` on each row's last
        token). Collective over the model-parallel group and ``group`` (the DP group: the whitening's)."""
        values = self.critic.compute_values(rows)
        mask = mask.to(device=values.device, dtype=torch.float32)
        tlr = (_token_level_rewards(rows, rewards.to(values.device)) if token_level_rewards is None
               else token_level_rewards.to(device=values.device, dtype=torch.float32))
        adv, returns = compute_gae_advantage_return(tlr, values, mask, gamma=self.gamma, lam=self.lam, group=group,
                                                    all_reduce=all_reduce_)
        return adv * mask, returns * mask, values

    def train(self, rows, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
              group=None) -> Dict[str, float]:
        """The critic's update on this shard over ``mask`` (the loss's), with verl's critic metrics (identical on
        every rank)."""
        mask = mask.to(device=values.device, dtype=torch.float32)
        out = self.critic.train_step(rows, values, returns, mask)
        out["critic/vf_explained_var"] = explained_variance(returns, values, mask, group)
        sums = global_sum(torch.stack([mask.to(torch.float64).sum(), (values.to(torch.float64) * mask).sum(),
                                       (returns.to(torch.float64) * mask).sum()]), group, all_reduce_)
        n = max(float(sums[0]), 1.0)
        out["critic/values/mean"] = float(sums[1]) / n
        out["critic/returns/mean"] = float(sums[2]) / n
        return out

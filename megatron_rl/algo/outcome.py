"""Outcome-reward estimators (one scalar per response: the sum of its token rewards) in verl 0.9.1's signatures
and semantics, vectorised over groups: GRPO (+ vectorized), GRPO pass@k, GDPO, REINFORCE++-baseline, RLOO
(+ vectorized), OPO, GPG. Each returns ``(advantages, returns)`` ``[B, T]`` (returns = advantages, as verl's).
The rule: group statistics need a prompt's samples on one rank; the statistics over the whole batch (GDPO's and
REINFORCE++-baseline's whitening, GPG's count of non-zero scores) are reduced over ``group`` (the DP group).
verl's quirks kept: a single-sample group gets mean 0 / std 1 (GRPO, GPG), no baseline (RLOO, OPO, RF++-baseline),
advantage 0 (``rloo_vectorized``)."""
from __future__ import annotations

import numpy as np
import torch

from megatron_rl.algo.groups import dense_group_ids, group_sum
from megatron_rl.algo.whiten import global_sum, masked_whiten

F64 = torch.float64


def _setup(token_level_rewards, index):
    scores = token_level_rewards.sum(dim=-1).to(F64)
    gid = dense_group_ids(index, scores.shape[0], scores.device)
    G = int(gid.max()) + 1 if gid.numel() else 0
    count = group_sum(torch.ones_like(scores), gid, G)
    return scores, gid, G, count


def _mean_std(scores, gid, G, count):
    """verl's per-group mean and unbiased std; single-sample groups: mean 0, std 1."""
    mean = group_sum(scores, gid, G) / count.clamp(min=1)
    sq = group_sum((scores - mean[gid]) ** 2, gid, G)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    single = count <= 1
    return torch.where(single, 0.0, mean), torch.where(single, 1.0, std)


def _out(scalars, response_mask, like):
    adv = (scalars.unsqueeze(-1) * response_mask.to(F64)).to(like.dtype)
    return adv, adv


@torch.no_grad()
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                                   norm_adv_by_std_in_grpo: bool = True, config=None, **kwargs):
    """GRPO: (s - group mean) [/ (group std + epsilon)] x mask (Dr.GRPO without the std)."""
    scores, gid, G, count = _setup(token_level_rewards, index)
    mean, std = _mean_std(scores, gid, G, count)
    a = scores - mean[gid]
    if norm_adv_by_std_in_grpo:
        a = a / (std[gid] + epsilon)
    return _out(a, response_mask, token_level_rewards)


compute_grpo_vectorized_outcome_advantage = compute_grpo_outcome_advantage


@torch.no_grad()
def compute_gdpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                                   norm_adv_by_std_in_grpo: bool = True, config=None, non_tensor_batch=None,
                                   batch=None, group=None, all_reduce=None, **kwargs):
    """GDPO: GRPO per reward component (``config.gdpo_reward_keys`` read from ``non_tensor_batch``; without
    them the one summed reward), weighted by ``config.gdpo_reward_weights`` and summed, then whitened over the
    whole batch x mask."""
    comps = [token_level_rewards.sum(dim=-1)]
    weights = None
    if config is not None and non_tensor_batch is not None and batch is not None:
        keys = config.get("gdpo_reward_keys", None)
        if not keys:
            raise ValueError("gdpo needs algorithm.gdpo_reward_keys (the reward components compute_score returns)")
        missing = [k for k in keys if k not in non_tensor_batch]
        if missing:
            raise ValueError(f"gdpo: reward component(s) {missing} (algorithm.gdpo_reward_keys) are not in the batch; "
                             f"it has {sorted(non_tensor_batch)}")
        comps = [torch.as_tensor(np.asarray(non_tensor_batch[k], dtype=np.float32)
                                 if not isinstance(non_tensor_batch[k], torch.Tensor) else non_tensor_batch[k],
                                 dtype=torch.float32, device=token_level_rewards.device) for k in keys]
        if config.get("gdpo_reward_weights", None) is not None:
            weights = [float(w) for w in config.get("gdpo_reward_weights")]
            if len(weights) != len(comps):
                raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} weights for "
                                 f"{len(comps)} gdpo_reward_keys")
    total = torch.zeros_like(response_mask, dtype=F64)
    for i, c in enumerate(comps):
        a, _ = compute_grpo_outcome_advantage(c.to(F64).unsqueeze(-1), response_mask, index, epsilon,
                                              norm_adv_by_std_in_grpo)
        total = total + (1.0 if weights is None else weights[i]) * a.to(F64)
    adv = masked_whiten(total, response_mask, group, all_reduce) * response_mask.to(F64)
    adv = adv.to(token_level_rewards.dtype)
    return adv, adv


@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                                         norm_adv_by_std_in_grpo: bool = True, config=None, **kwargs):
    """Pass@k: only a group's best response gets (r_max - r_second) [/ (group std + epsilon)]; verl reads the std
    switch from ``config.norm_adv_by_std_in_grpo`` (default True), not from the keyword. Groups of one: error."""
    if config is None:
        raise ValueError("grpo_passk needs config (algorithm.norm_adv_by_std_in_grpo)")
    norm = config.get("norm_adv_by_std_in_grpo", True)
    scores, gid, G, count = _setup(token_level_rewards, index)
    if G and bool((count < 2).any()):
        raise ValueError(f"grpo_passk needs >= 2 samples per group; a group has {int(count.min())} "
                         f"(rollout.n_samples_per_prompt)")
    adv = torch.zeros_like(scores)
    for g in range(G):   # per group: the top two (ties give 0, whichever row is first)
        rows = torch.nonzero(gid == g).flatten()
        r = scores[rows]
        top, idx = torch.topk(r, 2)
        a = top[0] - top[1]
        if norm:
            a = a / (r.std() + epsilon)
        adv[rows[idx[0]]] = a
    return _out(adv, response_mask, token_level_rewards)


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index,
                                                           epsilon: float = 1e-6, config=None, group=None,
                                                           all_reduce=None, **kwargs):
    """REINFORCE++-baseline: (s - group mean; single-sample groups: s) over the tokens, whitened over the whole
    batch, x mask."""
    scores, gid, G, count = _setup(token_level_rewards, index)
    mean, _ = _mean_std(scores, gid, G, count)
    m = response_mask.to(F64)
    a = (scores - mean[gid]).unsqueeze(-1) * m
    adv = (masked_whiten(a, response_mask, group, all_reduce) * m).to(token_level_rewards.dtype)
    return adv, adv


@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6, config=None,
                                   **kwargs):
    """RLOO: s - mean of the other samples (n/(n-1) (s - mean)); a single-sample group keeps s."""
    scores, gid, G, count = _setup(token_level_rewards, index)
    n = count[gid]
    mean = group_sum(scores, gid, G)[gid] / n
    a = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
    return _out(a, response_mask, token_level_rewards)


@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                                              config=None, **kwargs):
    """RLOO as verl's vectorised form: like ``rloo`` but a single-sample group gets 0."""
    scores, gid, G, count = _setup(token_level_rewards, index)
    n = count[gid]
    a = (n * scores - group_sum(scores, gid, G)[gid]) / (n - 1).clamp(min=1) * (n > 1)
    return _out(a, response_mask, token_level_rewards)


@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6, config=None,
                                  **kwargs):
    """OPO: s - the group's length-weighted mean reward (length = masked tokens); single-sample groups keep s."""
    scores, gid, G, count = _setup(token_level_rewards, index)
    length = response_mask.to(F64).sum(dim=-1)
    bsl = group_sum(length * scores, gid, G) / group_sum(length, gid, G)
    bsl = torch.where(count <= 1, 0.0, bsl)
    return _out(scores - bsl[gid], response_mask, token_level_rewards)


@torch.no_grad()
def compute_gpg_outcome_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                                  f_norm: float = 1.0, alpha: float = 1.0, config=None, group=None, all_reduce=None,
                                  **kwargs):
    """GPG: alpha (s - group mean) / f_norm with alpha = batch size / number of non-zero scores, both counted over
    the whole batch (the keyword ``alpha`` is ignored, as in verl)."""
    scores, gid, G, count = _setup(token_level_rewards, index)
    mean, _ = _mean_std(scores, gid, G, count)
    c = global_sum(torch.stack([torch.tensor(float(scores.shape[0]), dtype=F64, device=scores.device),
                                (scores != 0).sum().to(F64)]), group, all_reduce)
    a = c[0] / c[1].clamp(min=1) * (scores - mean[gid]) / f_norm
    return _out(a, response_mask, token_level_rewards)

"""The trainer's advantage estimator, built once (``plan/advantage.py``) and called by the step:
``Estimator.advantages(rewards, group_index, mask, group)`` -> ``[B, T]`` float32.

The rule: the call is verl's trainer's (``ray_trainer.compute_advantage``): ``grpo`` / ``rloo`` run this project's
group estimators (``advantages.py``: single-sample groups get 0), every other name runs ``advantage_fn(name)`` with
the keywords verl passes it -- token-level rewards (the scalar reward on each row's last token of ``mask``),
``response_mask``, ``index``, ``config`` (``AlgoParams``) -- plus ``group`` (the DP group) where its statistics span
the batch; the result is multiplied by ``mask`` (verl leaves GAE's and ReMax's off-mask entries, which no loss
reads). With KL in the reward the step passes verl's ``token_level_rewards`` [B, T] instead (``TOKEN_LEVEL``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from megatron_rl.algo.advantages import compute_advantages
from megatron_rl.algo.registry import EstimatorSpec, estimator_spec


KEY = "algorithm.adv_estimator"
#: Estimators the trainer runs (``plan/advantage.py`` refuses the rest with ``NOT_IN_TRAINER``'s reason).
TRAINER_ESTIMATORS = ("grpo", "rloo", "grpo_vectorized", "grpo_passk", "reinforce_plus_plus",
                      "reinforce_plus_plus_baseline", "rloo_vectorized", "opo", "gpg", "remax", "gdpo", "gae",
                      "optimal_token_baseline", "tir_optimal_token_baseline")
#: Estimators whose advantage is a difference within a prompt's group (>= 2 samples per prompt for a signal).
GROUP_ESTIMATORS = ("grpo", "rloo", "grpo_vectorized", "grpo_passk", "reinforce_plus_plus_baseline",
                    "rloo_vectorized", "opo", "gpg", "gdpo")
#: Estimators whose whitening shifts every row (a group of alike rewards does not get advantage 0).
WHITENED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo")
#: verl's estimators the trainer cannot feed yet, with the reason (``plan/advantage.py``, ``migrate verl``).
NOT_IN_TRAINER: Dict[str, str] = {}
#: verl's estimators that read ``token_level_rewards`` token by token (the others read ``.sum(-1)`` per row): with
#: KL in the reward the step passes them ``KLInReward.apply``'s per-token rewards.
TOKEN_LEVEL = ("gae", "reinforce_plus_plus", "remax", "optimal_token_baseline", "tir_optimal_token_baseline")

#: verl's trainer calls these without norm_adv_by_std_in_grpo: they always divide by the std there.
STD_ALWAYS = ("grpo_vectorized", "gdpo")


@dataclass(frozen=True)
class AlgoParams:
    """verl's ``AlgoConfig`` as its estimators read it (``config.gamma``, ``config.get(key, default)``)."""

    gamma: float = 1.0
    """Discount (``algorithm.gamma``)."""
    lam: float = 1.0
    """GAE's lambda (``algorithm.lam``)."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO-style std division (``algorithm.norm_adv_by_std_in_grpo``)."""
    gdpo_reward_keys: Optional[Tuple[str, ...]] = None
    """GDPO's reward components (``algorithm.gdpo_reward_keys``)."""
    gdpo_reward_weights: Optional[Tuple[float, ...]] = None
    """GDPO's component weights (``algorithm.gdpo_reward_weights``; None: 1 each)."""

    def get(self, key: str, default: Any = None) -> Any:
        """``getattr`` with a default, as verl's ``DictConfig.get``."""
        return getattr(self, key, default)


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: ``rewards[b]`` on row b's last token with ``mask`` 1 (a row without one: nowhere)."""
    m = mask > 0
    T = m.shape[-1]
    pos = (torch.where(m, torch.arange(T, device=m.device), -1).amax(dim=-1) if T
           else torch.full(rewards.shape, -1, dtype=torch.long, device=m.device))
    out = torch.zeros(m.shape, dtype=torch.float32, device=rewards.device)
    rows = torch.nonzero(pos >= 0).flatten()
    out[rows, pos[rows]] = rewards[rows].to(torch.float32)
    return out


@dataclass(frozen=True)
class Estimator:
    """``algorithm.adv_estimator`` with its parameters (built once by the job plan)."""

    name: str
    """verl's estimator name."""
    params: AlgoParams
    """What verl's estimators read from ``config``."""
    all_reduce: Optional[Callable[..., Any]] = field(default=None, compare=False, repr=False)
    """``all_reduce(t, group=...)``, an in-place SUM that stages ``t`` on the device the group's backend takes (the
    plan passes ``parallel.devices.all_reduce_``); None: ``dist.all_reduce`` as is."""

    @property
    def reward_keys(self) -> Tuple[str, ...]:
        """The reward components each row must carry (GDPO's ``gdpo_reward_keys``; empty otherwise)."""
        return tuple(self.params.gdpo_reward_keys or ()) if self.name == "gdpo" else ()

    @property
    def spec(self) -> EstimatorSpec:
        """What the estimator needs (``registry.ESTIMATOR_SPECS``)."""
        return estimator_spec(self.name)

    @property
    def reads_token_rewards(self) -> bool:
        """verl's function reads the rewards token by token (``TOKEN_LEVEL``), not their per-row sum."""
        return self.name in TOKEN_LEVEL

    @property
    def needs_sum_pi_squared(self) -> bool:
        """The log-prob pass must return sum pi^2 per token (the optimal token baselines)."""
        return "sum_pi_squared" in self.spec.needs

    def policy_inputs(self, old_log_probs: torch.Tensor, sum_pi_squared: Optional[torch.Tensor],
                      is_weights: Optional[torch.Tensor]) -> Dict[str, Optional[torch.Tensor]]:
        """What verl's ``compute_advantage`` hands the optimal token baselines from the policy: the loss's old
        log-probs (the rollout's in bypass mode), the log-prob pass's sum pi^2 and the correction's IS weights
        (``rollout_is_weights``; None without token / sequence IS). ``{}`` for the other estimators."""
        if not self.needs_sum_pi_squared:
            return {}
        if sum_pi_squared is None:
            raise ValueError(f"{KEY}={self.name!r}: the log-prob pass returned no sum_pi_squared (call "
                             f"compute_log_probs with compute_sum_pi_squared=True)")
        return dict(old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared, rollout_is_weights=is_weights)

    def advantages(self, rewards: torch.Tensor, group_index, mask: torch.Tensor, group: Optional[Any] = None,
                   token_level_rewards: Optional[torch.Tensor] = None, **inputs) -> torch.Tensor:
        """Token-level advantages ``[B, T]`` (float32) from the scalar ``rewards`` ``[B]`` and the loss's ``mask``
        ``[B, T]`` (after rejection). ``group``: the DP group (whole-batch statistics); ``token_level_rewards``:
        verl's per-token rewards ``[B, T]`` (KL in the reward) given to verl's function instead of ``rewards`` on
        each row's last token (``grpo`` / ``rloo`` read ``rewards``); ``inputs``: the extra tensors the spec
        needs (``values``, ...). Collective over ``group`` for ``spec.global_stats``."""
        if self.name in ("grpo", "rloo"):
            return compute_advantages(rewards, group_index, mask, estimator=self.name,
                                      norm_adv_by_std=self.params.norm_adv_by_std_in_grpo)
        needs = self.spec.needs + (("reward_components",) if self.name == "gdpo" else ())
        missing = [k for k in needs if k not in inputs]
        if missing:
            raise ValueError(f"algorithm.adv_estimator={self.name!r} needs {missing} with the step's rows, which "
                             f"carry none (rows generated for another estimator?)")
        if token_level_rewards is not None and tuple(token_level_rewards.shape) != tuple(mask.shape):
            raise ValueError(f"{KEY}={self.name!r}: token_level_rewards has shape "
                             f"{tuple(token_level_rewards.shape)}, the mask {tuple(mask.shape)}")
        tlr = last_token_rewards(rewards, mask) if token_level_rewards is None else token_level_rewards
        kw = dict(token_level_rewards=tlr.to(torch.float32), response_mask=mask.to(torch.float32),
                  index=group_index, config=self.params, **inputs)
        if self.name == "gdpo":   # verl passes the components in non_tensor_batch (``batch``: positions only)
            comps = kw.pop("reward_components")
            kw.update(non_tensor_batch={k: comps[:, i] for i, k in enumerate(self.reward_keys)}, batch={})
        if self.name == "gae":
            kw = dict(token_level_rewards=kw["token_level_rewards"], values=inputs["values"],
                      response_mask=kw["response_mask"], gamma=self.params.gamma, lam=self.params.lam)
        if self.spec.global_stats:
            kw.update(group=group, all_reduce=self.all_reduce)
        adv, _ = self.spec.fn(**kw)
        # 0 off the loss's tokens (verl's gae / remax are not; OPO's baseline of a group with no kept token is 0/0)
        return torch.where(kw["response_mask"] > 0, adv.to(torch.float32), torch.zeros((), device=adv.device))

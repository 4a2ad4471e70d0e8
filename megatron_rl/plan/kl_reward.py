"""The job's KL in the reward (``algorithm.use_kl_in_reward``), built once: ``KLInReward`` or None.

Rule: what is not built is refused naming its key -- verl's ``kl_penalty: full`` (verl raises NotImplementedError
for it) and dynamic sampling (``algorithm.filter_groups``), whose filter compares rewards before the penalty that
is computed from the step's log-probs.
"""
from __future__ import annotations

from typing import Optional

from megatron_rl.algo.kl_reward import KLInReward
from megatron_rl.losses.config import KL_TYPES
from megatron_rl.losses.kl import kl_penalty
from megatron_rl.parallel.devices import all_reduce_
from megatron_rl.plan.checks import Unbuilt

__all__ = ["build_kl_in_reward", "describe_kl_in_reward"]


def build_kl_in_reward(algorithm) -> Optional[KLInReward]:
    """``KLInReward`` of the ``algorithm:`` section when ``use_kl_in_reward``, else None; ``Unbuilt`` with every
    problem."""
    a = algorithm
    if not a.use_kl_in_reward:
        return None
    errs = []
    if a.kl_penalty == "full":
        errs.append("algorithm.kl_penalty: 'full' (the KL over the whole vocabulary) is not built: verl 0.9.1 "
                    "raises NotImplementedError for it; use kl, abs, mse or low_var_kl")
    elif a.kl_penalty not in KL_TYPES:
        errs.append(f"algorithm.kl_penalty: {a.kl_penalty!r} is not one of {', '.join(KL_TYPES)}")
    errs += a.kl_ctrl.errors()
    if a.advantage_estimator == "gdpo":
        errs.append("algorithm.use_kl_in_reward: no effect with algorithm.adv_estimator 'gdpo' (verl's gdpo "
                    "normalises the reward components of algorithm.gdpo_reward_keys and never reads the penalised "
                    "token_level_rewards); set use_kl_in_reward: false, or use the KL loss (actor.use_kl_loss)")
    if a.filter_groups is not None and a.filter_groups.enable:
        errs.append("algorithm.use_kl_in_reward: not built with algorithm.filter_groups.enable (dynamic sampling "
                    "filters groups on rank 0 before the log-probs the penalty needs exist)")
    if errs:
        raise Unbuilt(errs)
    return KLInReward(a.kl_penalty, a.kl_ctrl, kl_penalty, all_reduce_)


def describe_kl_in_reward(k: Optional[KLInReward]) -> str:
    """One line for ``describe``."""
    if k is None:
        return "KL in the reward: off"
    c = k.ctrl_cfg
    ctrl = (f"adaptive from beta {c.kl_coef:g} (target_kl {c.target_kl:g}, horizon {c.horizon:g})"
            if c.type == "adaptive" else f"fixed beta {c.kl_coef:g}")
    return f"KL in the reward: {k.kl_penalty}, {ctrl}"

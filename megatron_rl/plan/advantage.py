"""The job's advantage estimator, built once from ``algorithm:`` (``build_estimator``) and called by the step.

Rule: an estimator the trainer cannot feed is refused here, naming the key -- ``gae`` (needs a critic:
``critic.enable``), ``remax`` / ``gdpo`` with multi-turn rollouts (the greedy baseline and the reward components
are built single-turn only), ``gdpo`` without ``algorithm.gdpo_reward_keys``, ``remax`` with async interrupted
rollouts (newer weights between segments) or a dynamic-sampling top-up (its baseline is not the group's); and so
is what verl would silently ignore (``norm_adv_by_std_in_grpo: false`` where verl's trainer does not pass it on).
The estimator's whole-batch reductions go through ``parallel.devices.all_reduce_``."""
from __future__ import annotations

from typing import List

from megatron_rl.algo.estimator import (GROUP_ESTIMATORS, KEY, NOT_IN_TRAINER, STD_ALWAYS, WHITENED,
                                        AlgoParams, Estimator)
from megatron_rl.algo.registry import VERL_ESTIMATORS
from megatron_rl.parallel.devices import all_reduce_
from megatron_rl.plan.checks import Unbuilt

def estimator_errors(algorithm, n_samples_per_prompt: int, filter_groups_train: bool,
                     multi_turn: bool = False, interrupt: bool = False) -> List[str]:
    """Problems of ``algorithm.adv_estimator`` and its parameters (each naming its key)."""
    name, errs = algorithm.advantage_estimator, []
    if name not in VERL_ESTIMATORS:
        return [f"{KEY}: {name!r} is not one of {', '.join(VERL_ESTIMATORS)}"]
    if name in NOT_IN_TRAINER:
        errs.append(f"{KEY}: {name!r} {NOT_IN_TRAINER[name]}")
    if not (0 <= algorithm.gamma <= 1):
        errs.append(f"algorithm.gamma: must be in [0, 1], got {algorithm.gamma}")
    if not (0 <= algorithm.lam <= 1):
        errs.append(f"algorithm.lam: must be in [0, 1], got {algorithm.lam}")
    if name in STD_ALWAYS and not algorithm.norm_adv_by_std:
        errs.append(f"algorithm.norm_adv_by_std_in_grpo: false has no effect on {name!r} in verl (its trainer "
                    f"does not pass it; the std division always applies); use grpo for Dr.GRPO")
    if name in GROUP_ESTIMATORS and n_samples_per_prompt < 2:
        errs.append(f"rollout.n_samples_per_prompt: {name} needs >= 2 samples per prompt, got {n_samples_per_prompt}")
    if name in ("remax", "gdpo") and multi_turn:
        errs.append(f"{KEY}: {name!r} with multi_turn.env: its extra inputs (remax's greedy baseline, gdpo's reward "
                    f"components) are built for single-turn rollouts only")
    if name == "remax" and interrupt:
        errs.append(f"{KEY}: 'remax' with rollout.partial_rollout 'interrupt': the greedy baseline must come from the "
                    f"round's weights, but the producer may load newer ones between the segments of the sampled "
                    f"responses (StaleRolloutError); use partial_rollout 'finish'")
    keys, weights = algorithm.gdpo_reward_keys, algorithm.gdpo_reward_weights
    if name == "gdpo" and not keys:
        errs.append("algorithm.gdpo_reward_keys: required with adv_estimator gdpo (the keys of the reward "
                    "function's returned dict to normalise one by one)")
    if name != "gdpo" and (keys or weights):
        errs.append(f"algorithm.gdpo_reward_keys / gdpo_reward_weights: read by adv_estimator gdpo only, not {name!r}")
    if name == "gdpo" and keys and weights is not None and len(weights) != len(keys):
        errs.append(f"algorithm.gdpo_reward_weights: {len(weights)} weights for {len(keys)} gdpo_reward_keys")
    if name in WHITENED and filter_groups_train:
        errs.append(f"algorithm.filter_groups.on_exhausted: 'train' tops a batch up with groups of advantage 0, "
                    f"but {KEY}={name!r} whitens over the batch (those rows would train); use 'skip' or 'error'")
    if name == "remax" and filter_groups_train:
        errs.append(f"algorithm.filter_groups.on_exhausted: 'train' tops a batch up with groups of advantage 0, "
                    f"but {KEY}='remax' subtracts the greedy response's reward, not the group's mean (those rows "
                    f"would train); use 'skip' or 'error'")
    return errs


def build_estimator(cfg) -> Estimator:
    """The job's ``Estimator``; ``Unbuilt`` listing its problems."""
    a, fg = cfg.algorithm, cfg.algorithm.filter_groups
    errs = estimator_errors(a, cfg.rollout.n_samples_per_prompt,
                            fg is not None and fg.enable and fg.on_exhausted == "train",
                            cfg.multi_turn.env is not None,
                            cfg.rollout.mode == "async" and cfg.rollout.partial_rollout == "interrupt")
    if errs:
        raise Unbuilt(errs)
    return Estimator(a.advantage_estimator, AlgoParams(
        gamma=a.gamma, lam=a.lam, norm_adv_by_std_in_grpo=a.norm_adv_by_std,
        gdpo_reward_keys=tuple(a.gdpo_reward_keys) if a.gdpo_reward_keys else None,
        gdpo_reward_weights=tuple(a.gdpo_reward_weights) if a.gdpo_reward_weights is not None else None),
        all_reduce=all_reduce_)


def describe_advantages(est: Estimator, corr) -> str:
    """One line for ``describe``: the estimator and the rejection its mask comes from (a defaulted KPop phi is
    said: ``rollout_rs_threshold`` null takes 2.0)."""
    p = est.params
    if est.name == "gpg":
        how = "GPG's alpha over DP"
    elif est.spec.global_stats:
        how = "whitened over DP"
    else:
        how = "per prompt group" if est.name in GROUP_ESTIMATORS else "per row"
    line = f"advantages: {est.name} (gamma {p.gamma:g}; {how})"
    bounds = getattr(corr, "rs_bounds", None) or {}
    if bounds:
        parts = [f"{o} <= {b.upper:g}" if b.lower is None else f"{o} in [{b.lower:g}, {b.upper:g}]"
                 for o, b in bounds.items()]
        line += "; rejection: " + ", ".join(parts)
        if "binary_kl" in bounds and corr.rollout_rs_threshold is None:
            line += " (binary_kl's phi defaulted: algorithm.rollout_correction.rollout_rs_threshold is null)"
    return line

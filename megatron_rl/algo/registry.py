"""verl 0.9.1's advantage estimators by name: ``advantage_fn(name)`` returns the callable that takes verl's keyword
arguments for that estimator (``token_level_rewards``, ``response_mask``, ``index``, ``values``, ``gamma``, ``lam``,
``config``, ``epsilon``, ``norm_adv_by_std_in_grpo``, ``reward_baselines``, ``old_log_probs``, ``sum_pi_squared``,
...) and returns ``(advantages, returns)`` as verl's registered function does, so it can be swapped in for
``core_algos.get_adv_estimator_fn(name)``. One extra keyword, ``group`` (default None: the local batch), is the
process group over which whole-batch statistics are reduced (``GLOBAL_STATS``: docs/advantages.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

from megatron_rl.algo import gae, outcome, token_baseline


@dataclass(frozen=True)
class EstimatorSpec:
    """What an estimator needs beyond rewards, mask and groups."""

    fn: Callable
    """verl's signature, returns (advantages, returns)."""
    needs: Tuple[str, ...] = ()
    """Extra inputs: "values" (a critic), "reward_baselines" (ReMax's greedy rollout), "old_log_probs" and
    "sum_pi_squared" (the optimal token baseline)."""
    global_stats: bool = False
    """Statistics over the whole batch (whitening, GPG's alpha): reduced over the DP group."""


_OTB_NEEDS = ("old_log_probs", "sum_pi_squared")
ESTIMATOR_SPECS: Dict[str, EstimatorSpec] = {
    "gae": EstimatorSpec(gae.compute_gae_advantage_return, ("values",), True),
    "grpo": EstimatorSpec(outcome.compute_grpo_outcome_advantage),
    "grpo_vectorized": EstimatorSpec(outcome.compute_grpo_vectorized_outcome_advantage),
    "grpo_passk": EstimatorSpec(outcome.compute_grpo_passk_outcome_advantage),
    "gdpo": EstimatorSpec(outcome.compute_gdpo_outcome_advantage, (), True),
    "reinforce_plus_plus": EstimatorSpec(gae.compute_reinforce_plus_plus_outcome_advantage, (), True),
    "reinforce_plus_plus_baseline": EstimatorSpec(outcome.compute_reinforce_plus_plus_baseline_outcome_advantage,
                                                  (), True),
    "remax": EstimatorSpec(gae.compute_remax_outcome_advantage, ("reward_baselines",)),
    "rloo": EstimatorSpec(outcome.compute_rloo_outcome_advantage),
    "rloo_vectorized": EstimatorSpec(outcome.compute_rloo_vectorized_outcome_advantage),
    "opo": EstimatorSpec(outcome.compute_opo_outcome_advantage),
    "gpg": EstimatorSpec(outcome.compute_gpg_outcome_advantage, (), True),
    "optimal_token_baseline": EstimatorSpec(token_baseline.compute_optimal_token_baseline_advantage, _OTB_NEEDS),
    "tir_optimal_token_baseline": EstimatorSpec(
        token_baseline.compute_multi_turn_optimal_token_baseline_advantage, _OTB_NEEDS),
}
#: verl 0.9.1's registered estimator names (``algorithm.adv_estimator``).
VERL_ESTIMATORS = tuple(ESTIMATOR_SPECS)
#: Estimators whose statistics span the whole batch (reduced over DP).
GLOBAL_STATS = tuple(n for n, s in ESTIMATOR_SPECS.items() if s.global_stats)


def estimator_spec(name: str) -> EstimatorSpec:
    """The spec of estimator ``name``; a ValueError naming ``algorithm.adv_estimator`` and the choices."""
    if name not in ESTIMATOR_SPECS:
        raise ValueError(f"algorithm.adv_estimator={name!r} is not one of {', '.join(VERL_ESTIMATORS)}")
    return ESTIMATOR_SPECS[name]


def advantage_fn(name: str) -> Callable:
    """verl's estimator ``name`` (``core_algos.get_adv_estimator_fn``'s names) as a callable with its keywords."""
    return estimator_spec(name).fn

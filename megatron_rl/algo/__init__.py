"""RL algorithm pieces that are not losses: advantage estimators (``advantages``; verl's estimators by name:
``advantage_fn``)."""
from megatron_rl.algo.advantages import (
    BASELINE_OVER,
    ESTIMATORS,
    compute_advantages,
    group_advantage_scalars,
)
from megatron_rl.algo.gae import compute_gae_advantage_return
from megatron_rl.algo.registry import (ESTIMATOR_SPECS, GLOBAL_STATS, VERL_ESTIMATORS, EstimatorSpec, advantage_fn,
                                       estimator_spec)
from megatron_rl.algo.whiten import masked_whiten

__all__ = ["ESTIMATOR_SPECS", "GLOBAL_STATS", "VERL_ESTIMATORS", "EstimatorSpec", "advantage_fn", "estimator_spec",
           "compute_gae_advantage_return", "masked_whiten", "BASELINE_OVER", "ESTIMATORS", "compute_advantages", "group_advantage_scalars"]

"""RL algorithm pieces that are not losses: advantage estimators (``advantages``)."""
from megatron_rl.algo.advantages import (
    BASELINE_OVER,
    ESTIMATORS,
    compute_advantages,
    group_advantage_scalars,
)

__all__ = ["BASELINE_OVER", "ESTIMATORS", "compute_advantages", "group_advantage_scalars"]

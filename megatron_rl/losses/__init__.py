"""Policy losses for RL post-training with rollout correction: one row per objective, composed with the IS weights.

Modules (imports point down the list):
  params.py       the objective parameters (verl's names) and their ranges
  config.py       ``PolicyLossConfig`` (clip ratios, objective parameters, aggregation, KL loss, entropy bonus)
  terms.py        what a term function takes and returns (``ObjectiveInputs`` -> ``ObjectiveTerms``)
  selection.py    Clip-Cov / KL-Cov / M2PO batch selections over the DP group (radix select, no gather)
  objectives.py   token-local term functions (verl's vanilla, reinforce, cispo, sapo, dppo_*, gpg, dro, *_cov)
  sequence.py     GSPO, GMPO (geo_mean), OPSM term functions from per-sequence sums over the CP group
  registry.py     ``Objective`` rows and every table derived from them (``OBJECTIVES``, ``LOSS_TYPES``, ...)
  aggregation.py  the five aggregation modes with global denominators (exact over micro-batches and DP)
  kl.py / metrics.py / validation.py   KL estimators, exactly reducible (sum, count) metrics, input checks
  policy.py       ``PolicyLoss`` (built once: ``build_policy_loss``), ``LossBatch``, ``compute_policy_loss``

Which objective to pick, their parameters and how to add one: docs/objectives.md.
Tests: ``pytest tests/*/test_losses*.py tests/unit/test_objectives_config.py``.
"""
from .aggregation import (LossDenominators, aggregate_loss, global_denominators, local_denominators,
                          sequence_token_counts, with_norm_divisor)
from .config import KL_TYPES, LOSS_AGG_MODES, PolicyLossConfig
from .kl import kl_penalty
from .metrics import SumCount, merge_metrics, metrics_to_floats, reduce_metrics
from .objectives import ppo_clip_per_token, reinforce_per_token
from .policy import LossBatch, PolicyLoss, PolicyLossOutput, build_policy_loss, compute_policy_loss
from .registry import LOSS_TYPES, OBJECTIVES, Objective, batch_selection, objective

__all__ = [
    "PolicyLossConfig", "LOSS_TYPES", "LOSS_AGG_MODES", "KL_TYPES",
    "Objective", "OBJECTIVES", "objective", "batch_selection",
    "PolicyLoss", "LossBatch", "build_policy_loss", "compute_policy_loss", "PolicyLossOutput",
    "ppo_clip_per_token", "reinforce_per_token",
    "LossDenominators", "aggregate_loss", "global_denominators", "local_denominators",
    "sequence_token_counts", "with_norm_divisor",
    "kl_penalty",
    "SumCount", "merge_metrics", "reduce_metrics", "metrics_to_floats",
]

"""Policy losses for RL post-training with rollout correction.

Modules (one job each):
  config.py       ``PolicyLossConfig`` (clip ratios, objective parameters, aggregation, KL loss), ``LOSS_TYPES``
  policy.py       every objective composed with the IS weights / mask (``compute_policy_loss``, ``select_loss_inputs``)
  objectives.py   token-local objectives: PPO-clip, REINFORCE and verl's cispo, sapo, dppo_*, gpg, dro, clip/kl_cov
  sequence.py     GSPO, GMPO (geo_mean), OPSM from per-sequence sums over the CP group
  selection.py    Clip-Cov / KL-Cov / M2PO batch token selections over the DP group (radix select, no gather)
  aggregation.py  the five aggregation modes with global denominators (exact over micro-batches and DP)
  kl.py           KL estimators k1/abs/k2/k3 and the straight-through "+" variants (k3 value, k2 gradient)
  metrics.py      (sum, count) metrics merged / all-reduced exactly
  validation.py   shape / dtype / mask / NaN checks with one host sync

Typical train-step use (per optimizer step; ``loss_type`` and ``bypass_mode`` come from
``algorithm.rollout_correction``, their one owner)::

    from megatron_rl.losses import (PolicyLossConfig, compute_policy_loss, global_denominators,
                                    select_loss_inputs, merge_metrics, reduce_metrics, metrics_to_floats)
    den = global_denominators([mb.response_mask for mb in micro_batches], group=dp_group)
    for mb in micro_batches:
        old, w = select_loss_inputs(loss_type, bypass_mode, mb.rollout_log_probs, mb.old_log_probs,
                                    mb.is_weights)
        out = compute_policy_loss(logp, old, mb.advantages, mb.response_mask, cfg, loss_type=loss_type,
                                  is_weights=w, ref_log_probs=mb.ref_log_probs, denominators=den)
        out.loss.backward()      # sum over micro-batches and DP ranks == full-batch loss

Tests: ``pytest tests/*/test_losses*.py``.
"""
from .aggregation import (LossDenominators, aggregate_loss, global_denominators, local_denominators,
                          sequence_token_counts, with_norm_divisor)
from .config import KL_TYPES, LOSS_AGG_MODES, LOSS_TYPES, PolicyLossConfig
from .kl import kl_penalty
from .metrics import SumCount, merge_metrics, metrics_to_floats, reduce_metrics
from .policy import (PolicyLossOutput, compute_policy_loss, ppo_clip_per_token, reinforce_per_token,
                     select_loss_inputs)

__all__ = [
    "PolicyLossConfig", "LOSS_TYPES", "LOSS_AGG_MODES", "KL_TYPES",
    "compute_policy_loss", "select_loss_inputs", "PolicyLossOutput", "ppo_clip_per_token",
    "reinforce_per_token",
    "LossDenominators", "aggregate_loss", "global_denominators", "local_denominators",
    "sequence_token_counts", "with_norm_divisor",
    "kl_penalty",
    "SumCount", "merge_metrics", "reduce_metrics", "metrics_to_floats",
]

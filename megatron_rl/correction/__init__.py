"""Rollout correction: repair the mismatch between rollout log-probs (e.g. SGLang bf16) and the
trainer's recomputed log-probs (Megatron fp32) with importance sampling (truncated: TIS, masked:
MIS / IcePop; token, sequence or geometric level), rejection sampling (k1/k2/k3 statistics at token
or sequence level), a catastrophic-token veto and off-policy diagnostics — exact under data,
context and pipeline parallelism.

    from megatron_rl.correction import RolloutCorrectionConfig, compute_rollout_correction
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)   # or a preset
    res = compute_rollout_correction(train_lp, rollout_lp, response_mask, cfg, group=None, cp_group=None)
    res.weights, res.response_mask, res.metrics

Bypass mode: the policy loss recomputes weights and rejection per micro-batch from its current log-probs
(``correct_in_loss``, verl's bypass loss); ``res.loss_mask`` is the mask it starts from.
"""
from megatron_rl.correction.config import PRESETS, RolloutCorrectionConfig
from megatron_rl.correction.core import CorrectionResult, compute_rollout_correction
from megatron_rl.correction.in_loss import LossCorrection, correct_in_loss
from megatron_rl.correction.pipeline import broadcast_from_last_stage

__all__ = ["RolloutCorrectionConfig", "PRESETS", "CorrectionResult", "compute_rollout_correction",
           "broadcast_from_last_stage", "LossCorrection", "correct_in_loss"]

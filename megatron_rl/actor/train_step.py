"""One optimizer step of the policy loss through megatron's 1F1B schedule, Megatron DDP and optimizer.

``train_mini_batch``: global loss denominators over the DP group, then micro-batches whose last stage computes
vocab-parallel log-probs + entropy and ``compute_policy_loss``; megatron's optimizer clips and steps. The rule to
keep: the policy loss is already normalised over the global batch, so the loss_func returns
``loss * num_microbatches * dp_size`` (dp_size WITHOUT CP) to undo megatron-core's own scaling, and gradients are
exactly those of the global loss. Bypass mode recomputes the correction in every micro-batch
(``correction.correct_in_loss``); metrics are (sum, count) pairs reduced exactly over DP x CP. The steps in full:
docs/actor.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import RolloutBatch
from megatron_rl.actor.batcher import MicroBatcher
from megatron_rl.actor.schedule import MicroBatch, actor_device, run_schedule
from megatron_rl.correction.config import RolloutCorrectionConfig
from megatron_rl.correction.in_loss import correct_in_loss
from megatron_rl.logprobs import vocab_parallel_logprobs
from megatron_rl.losses import (LossBatch, LossDenominators, PolicyLoss, SumCount, compute_policy_loss,
                                global_denominators, merge_metrics, reduce_metrics)
from megatron_rl.losses.metrics import sum_count
from megatron_rl.parallel.groups import ActorGroups

__all__ = ["train_mini_batch", "PER_TOKEN_INPUTS"]

PER_TOKEN_INPUTS = ("old_log_probs", "advantages", "response_mask", "is_weights", "ref_log_probs", "token_select")
"""Per-token [B, L-1] inputs of the loss (is_weights / ref_log_probs / token_select may be None;
token_select: the clip_cov / kl_cov batch selection, ``PolicyLoss.select``)."""


_GLOBAL_LOSSES = ("pg_loss", "entropy_loss")
"""Aggregated losses (global denominators in every micro-batch): the step's value is their sum over micro-batches
and ranks, not a mean."""


@dataclass(frozen=True)
class _MicroBatchLoss:
    """Last stage: the policy loss of one micro-batch from its vocab-parallel logits, scaled for megatron (see the
    module docstring), plus its (sum, count) metrics."""

    loss: PolicyLoss
    """The job's policy loss."""
    denominators: LossDenominators
    """The optimizer step's global denominators."""
    temperature: float
    """Logits are divided by it."""
    tp_group: object
    """Tensor-parallel group (vocab-parallel log-probs)."""
    scale: float
    """num_microbatches * dp_size (megatron's loss scaling undone)."""
    cp_group: object
    """Context-parallel group of the per-sequence sums, or None."""
    bypass: Optional[RolloutCorrectionConfig]
    """Bypass mode: the correction settings whose weights and rejection each micro-batch recomputes from its
    log-probs; None otherwise."""

    def __call__(self, mb: MicroBatch, logits: torch.Tensor):
        logp, ent = vocab_parallel_logprobs(logits, mb.targets, tp_group=self.tp_group, temperature=self.temperature,
                                            compute_entropy=True)
        # packed: the packed sequence's positions -> the rows the loss's inputs are laid out in (padded: as is)
        logp, ent = mb.layout.loss_rows(logp), mb.layout.loss_rows(ent)
        p = mb.per_token
        w, pg_mask, pg_svt = p["is_weights"], None, None
        if self.bypass is not None:  # verl's bypass loss: weights and rejection of the current pi_theta vs pi_rollout
            lc = correct_in_loss(logp.detach(), p["old_log_probs"], p["response_mask"], self.bypass,
                                 cp_group=self.cp_group)
            w = lc.weights if self.loss.applies_is_weights else None
            pg_mask, pg_svt = lc.keep, lc.kept_tokens
        out = compute_policy_loss(self.loss, LossBatch(
            logp, p["old_log_probs"], p["advantages"], p["response_mask"], is_weights=w,
            ref_log_probs=p["ref_log_probs"], denominators=self.denominators, seq_valid_tokens=mb.seq_valid_tokens,
            cp_group=self.cp_group, token_select=p.get("token_select"), entropy=ent, pg_mask=pg_mask,
            pg_seq_valid_tokens=pg_svt))
        metrics = dict(out.metrics)
        valid = p["response_mask"] != 0
        metrics["entropy"] = sum_count(ent, valid)
        # metrics stay on the logits' device: they are all-reduced (NCCL needs CUDA tensors on GPU)
        one = torch.ones((), dtype=torch.float64, device=logits.device)
        metrics["pg_loss"] = SumCount(out.pg_loss.detach().to(torch.float64).reshape(()), one)
        if out.entropy_loss is not None:  # the entropy bonus's aggregated entropy (global denominators: summed)
            metrics["entropy_loss"] = SumCount(out.entropy_loss.detach().to(torch.float64).reshape(()), one)
        return out.loss * self.scale, {"metrics": metrics}


def forward_step(loss_func, mb: MicroBatch, model):
    """megatron's forward step: the model's output on ``mb`` and ``loss_func`` bound to ``mb``."""
    output = model(mb.tokens, mb.position_ids, attention_mask=None, **mb.model_kwargs)
    return output, functools.partial(loss_func, mb)


def broadcast_object(obj, groups: ActorGroups):
    """The last pipeline stage's picklable ``obj`` on every rank of the PP group."""
    if groups.pp_size == 1:
        return obj
    box = [obj]
    src = dist.get_process_group_ranks(groups.pp_group)[-1]
    dist.broadcast_object_list(box, src=src, group=groups.pp_group)
    return box[0]


def train_mini_batch(model_chunks: Sequence[torch.nn.Module], optimizer, batch: RolloutBatch,
                     per_token: Dict[str, Optional[torch.Tensor]], loss: PolicyLoss, *,
                     temperature: float, bounds: Sequence[Tuple[int, int]], groups: ActorGroups,
                     batcher: MicroBatcher, replay=None,
                     bypass_correction: Optional[RolloutCorrectionConfig] = None) -> Dict[str, float]:
    """Forward/backward over this rank's rows of one mini-batch and one optimizer step.

    ``bypass_correction`` (bypass mode, ``loss.bypass_mode``; ppo_clip or reinforce): every micro-batch recomputes
    the IS weights and the rejection from its log-probs (see the module docstring); ``per_token['old_log_probs']``
    are then the rollout's, ``response_mask`` the mask before rejection and ``is_weights`` must be None. num_tokens,
    ppo_kl and the clip fractions then count the tokens the rejection kept.

    ``replay``: a ``router_replay.ReplayPass`` replaying MoE routing in every forward (and recompute).
    ``bounds``: the micro-batches, contiguous [start, end) row blocks (``MicroBatcher.plan``), cut into model inputs
    by ``batcher`` (the actor's: the job plan's). Neither changes the loss (its
    denominators are global and the loss sees each micro-batch's rows, ``MicroBatch.layout.loss_rows``), except
    bypass mode's ``rollout_is_batch_normalize``: it divides by each micro-batch's mean weight on its DP rank, so
    the loss then depends on the cut (the DP size, ``micro_batch_size`` / ``max_tokens_per_micro_batch``, packing).

    ``loss``: the job's ``PolicyLoss`` (``megatron_rl.losses.build_policy_loss``).
    ``per_token`` maps each name of ``PER_TOKEN_INPUTS`` to a [B, L-1] tensor (column t scores token
    t+1) or None (is_weights, ref_log_probs). Returns floats: pg_loss (the global batch's aggregated
    policy loss), entropy_loss (with an entropy bonus: the global batch's aggregated entropy), pg_clipfrac,
    pg_clipfrac_lower, ppo_kl, entropy, kl_loss (with a KL loss; token means of the KL estimate) — token means
    over the global batch's valid tokens —, num_tokens (valid tokens
    of the global batch), grad_norm (before clipping), update_successful. Collective over every rank.
    """
    missing = [k for k in ("old_log_probs", "advantages", "response_mask") if per_token.get(k) is None]
    if missing:
        raise ValueError(f"train_mini_batch: missing per-token input(s) {missing}")
    unknown = sorted(set(per_token) - set(PER_TOKEN_INPUTS))
    if unknown:
        raise ValueError(f"train_mini_batch: unknown per-token input(s) {unknown}; valid: {PER_TOKEN_INPUTS}")
    inputs = {k: per_token.get(k) for k in PER_TOKEN_INPUTS}
    if (bypass_correction is not None) != loss.bypass_mode:
        raise ValueError(f"train_mini_batch: loss.bypass_mode={loss.bypass_mode} but bypass_correction is "
                         f"{'given' if bypass_correction is not None else 'None'}: bypass mode needs both")
    if bypass_correction is not None:
        if not bypass_correction.bypass_mode:
            raise ValueError("train_mini_batch: bypass_correction has bypass_mode=False (decoupled: pass the "
                             "correction's is_weights and response_mask instead)")
        if inputs["is_weights"] is not None:
            raise ValueError("train_mini_batch: is_weights given in bypass mode: the loss computes the IS weights "
                             "from the current log-probs (CorrectionResult.loss_inputs gives None)")
    if loss.config.loss_agg_mode == "seq-mean-token-sum-norm" and loss.config.loss_scale_factor is None:
        # a micro-batch's width is not verl's response-mask width: the caller gives the response budget
        raise ValueError("train_mini_batch: seq-mean-token-sum-norm needs loss.config.loss_scale_factor (the job's "
                         "response budget, losses.with_norm_divisor); rows here hold prompt + response")
    dev = actor_device()
    inputs = {k: None if v is None else v.to(dev) for k, v in inputs.items()}
    den = global_denominators(inputs["response_mask"], group=groups.dp_group if groups.dp_size > 1 else None)
    mbs = batcher.cut(batch, bounds, groups, per_token=inputs)
    scale = float(len(mbs) * groups.dp_size)
    cp_group = groups.cp_group if groups.cp_size > 1 else None   # per-sequence sums of gspo / geo_mean / opsm
    loss_func = _MicroBatchLoss(loss, den, float(temperature), groups.tp_group, scale, cp_group, bypass_correction)
    for chunk in model_chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    step = functools.partial(forward_step, loss_func)
    if replay is not None:
        step = replay.wrap(step)
    results = run_schedule(model_chunks, mbs, step, forward_only=False,
                           vp_group_size=batcher.vp_group_size(len(mbs)))
    if replay is not None:
        replay.micro_batches = mbs
    update_successful, grad_norm, _ = optimizer.step()
    metrics: Optional[Dict[str, float]] = None
    if groups.is_last_stage:
        merged = merge_metrics(r["metrics"] for r in results)
        merged = reduce_metrics(merged, group=groups.dp_cp_group if groups.dp_size * groups.cp_size > 1 else None)
        metrics = {k: v.mean() for k, v in merged.items() if k not in _GLOBAL_LOSSES}
        metrics.update({k: float(merged[k].sum) for k in _GLOBAL_LOSSES if k in merged})
        metrics["num_tokens"] = float(merged["ppo_kl"].count)
    metrics = broadcast_object(metrics, groups)
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["update_successful"] = float(bool(update_successful))
    return metrics

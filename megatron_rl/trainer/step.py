"""One RL step (the plan's advantage estimator, rollout correction), the same for every mode: ``train_step(job, step)``.

Per step, on every rank (torchrun / srun; gloo on CPU, NCCL on GPU)::

    got       = job.source.next(step)                         # rank 0 generates (sync) or takes (async); each
    shard     = got.shard(...)                                # rank gets its DP shard's whole prompt groups
    old_lp    = actor.compute_log_probs(shard, T)              # recompute: the actor's forward, fp32 log-softmax
    corr      = compute_rollout_correction(old_lp, rollout_lp, mask, ...)   # IS / RS / veto, exact over DP
    rewards   = job.kl_reward.estimator_rewards(...)           # verl's KL in the reward (algorithm.use_kl_in_reward)
    adv       = job.plan.estimator.advantages(rewards, ...)    # with the loss's mask (corr.loss_mask)
    old, w    = corr.loss_inputs(old_lp, rollout_lp)          # the loss's old policy and IS weights (bypass_mode)
    metrics   = actor.train_step(shard, old, adv, corr.loss_mask, w, T)
    weights   -> job.source.publisher.publish(step-N)          # to the engine now (sync) or to the producer (async)

With a critic (``gae``) the advantages are GAE over its values and it trains before the actor (docs/critic.md).
Rule: a step dynamic sampling skipped (``StepRows.skipped``, which every rank receives with its rows) trains
nothing and only publishes the unchanged weights as the next version. Watchdog bounds, bypass mode:
docs/trainer.md.
"""
from __future__ import annotations

import time
from typing import Dict, Optional, Tuple

from megatron_rl.actor.schedule import actor_device
from megatron_rl.config.timeouts import rollout_phase_key, rollout_phase_timeout_s
from megatron_rl.correction import compute_rollout_correction
from megatron_rl.correction.lag import policy_lag_metrics
from megatron_rl.rollout.versions import version_tag
from megatron_rl.trainer.step_batch import StepBatch, StepRows

__all__ = ["train_step"]


def train_step(job, step: int) -> Tuple[Dict[str, float], Optional[StepBatch]]:
    """Train step ``step`` (0-based; ``step`` versions done) and publish version ``step + 1``. Returns the step's
    metrics and its whole batch on rank 0 (None elsewhere: a rank receives only its rows). Collective."""
    cfg, actor, wd, source = job.cfg, job.actor, job.watchdog, job.source
    T = cfg.rollout.temperature
    t_step = time.perf_counter()
    # rank 0 may generate up to max_num_gen_batches rounds (dynamic sampling): phase_timeout_s per round, every rank
    with wd.phase("rollout", step + 1, timeout_s=rollout_phase_timeout_s(cfg), config_key=rollout_phase_key(cfg)):
        got = source.next(step)   # this rank's rows (its DP shard) and the step's whole-batch metrics
    t_rolled = time.perf_counter()
    if got.skipped:  # dynamic sampling found too few groups with signal: every rank skips the same step
        return _skipped(job, step, got, t_step, t_rolled)
    shard = got.shard(step, cfg.rollout.n_samples_per_prompt, job.pad_id, actor_device())
    rows = shard.batch
    est = job.plan.estimator
    with wd.phase("logprob", step + 1):  # train_step reports entropy; sum pi^2 for the optimal token baselines
        old_lp, _, *spp = actor.compute_log_probs(rows, T, compute_entropy=False,
                                                  compute_sum_pi_squared=est.needs_sum_pi_squared)
        ref_lp = job.reference.log_probs(rows, T)  # one pass for the KL loss and the KL in the reward (or None)
    with wd.phase("correction", step + 1):
        corr = compute_rollout_correction(old_lp, rows.rollout_log_probs, rows.response_mask,
                                          cfg.algorithm.rollout_correction, group=actor.dp_group)
        lag_metrics = policy_lag_metrics(old_lp, rows.rollout_log_probs, rows.response_mask, shard.token_lag,
                                         source.max_lag, group=actor.dp_group)
    old, w = corr.loss_inputs(old_lp, rows.rollout_log_probs)  # the correction decided the loss's old policy
    # verl's apply_kl_penalty: score - beta x kld(old || ref) per token (summed per row for the summing estimators)
    critic, critic_metrics = job.critic, {}
    rewards, tlr, kl_metrics = job.kl_reward.estimator_rewards(
        shard.rewards, old, ref_lp, rows.response_mask, corr.loss_mask, est.reads_token_rewards, group=actor.dp_group,
        scores=critic.token_level_scores(rows, shard.rewards) if critic.enabled else None)
    if critic.enabled:  # gae: GAE over the critic's values and the loss's mask, as verl (trainer/critic_step.py)
        with wd.phase("values", step + 1):
            adv, returns, values = critic.advantages(rows, rewards, corr.loss_mask, group=actor.dp_group,
                                                     token_level_rewards=tlr)
    else:  # the plan's estimator; whole-batch statistics (REINFORCE++ whitening, GPG's alpha) reduced over DP
        adv = est.advantages(rewards, shard.group_index, corr.loss_mask.float(), group=actor.dp_group,
                             token_level_rewards=tlr, **shard.estimator_inputs,
                             **est.policy_inputs(old, spp[0] if spp else None, w))
    with wd.phase("train", step + 1):
        if critic.enabled:
            critic_metrics = critic.train(rows, values, returns, corr.loss_mask, group=actor.dp_group)
        actor_metrics = (actor.train_step(rows, old, adv, corr.loss_mask, w, T, ref_log_probs=ref_lp)
                         if critic.actor_trains(step) else {})
    with wd.phase("weight_sync", step + 1):
        sync_metrics = source.publisher.publish(version_tag(step + 1))
    t_end = time.perf_counter()
    dt = t_end - t_step
    timing = {f"timing/{name}_s": wd.elapsed[name] for name in ("rollout", "logprob", "correction", "train",
                                                                 "weight_sync")}
    metrics = {
        **got.summary,
        **actor_metrics, **critic_metrics, **kl_metrics, **corr.metrics, **lag_metrics, **got.metrics,
        # the share of this step's wall time in which the producer generated while the trainer worked
        "perf/rollout_overlap_frac": source.overlap_s(t_rolled, t_end) / dt,
        **timing, "timing/step_s": dt, **sync_metrics,
        "perf/tokens_per_s": got.num_tokens / dt,
    }
    return metrics, got.whole


def _skipped(job, step: int, got: StepRows, t_step: float, t_rolled: float) -> Tuple[Dict[str, float], Optional[StepBatch]]:
    """A step dynamic sampling skipped (``algorithm.filter_groups.on_exhausted: skip``; rank 0 warned): nothing is
    trained, the unchanged weights are published as version ``step + 1`` (the schedule of versions, sync and async,
    goes on); its metrics are the rollout's and the timings of what ran."""
    with job.watchdog.phase("weight_sync", step + 1):
        sync_metrics = job.source.publisher.publish(version_tag(step + 1))
    t_end = time.perf_counter()
    return {**got.summary, **got.metrics, "timing/rollout_s": t_rolled - t_step,
            "timing/weight_sync_s": job.watchdog.elapsed["weight_sync"], "timing/step_s": t_end - t_step,
            **sync_metrics}, got.whole

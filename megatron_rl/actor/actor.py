"""``MegatronActor``: the facade the RL loop uses — log-prob pass, train step, checkpoints, HF export.

Life cycle (every rank; after ``init_distributed()`` and
``initialize_model_parallel(cfg.parallel, seed=cfg.trainer.seed, model=cfg.model)``)::

    actor = MegatronActor(plan.actor)                      # ActorSpec; builds, loads actor.load_hf, DDP, optimizer
    shard = batch.shard(actor.dp_rank, actor.dp_size)      # this DP rank's rows of the RolloutBatch
    old_lp, ent = actor.compute_log_probs(shard, temperature)          # [B, L-1] on all ranks of the MP group
    res = compute_rollout_correction(old_lp, shard.rollout_log_probs, shard.response_mask, cfg,
                                     group=actor.dp_group, cp_group=None)   # old_lp holds whole rows
    old, w = res.loss_inputs(old_lp, shard.rollout_log_probs)         # what the loss uses (bypass_mode, loss_type)
    metrics = actor.train_step(shard, old, advantages, res.loss_mask, w, temperature)
    actor.save_checkpoint(dir, step, {"data_cursor": 7}); step, extra = actor.load_checkpoint(dir)
    actor.export_hf(out_dir)                  # collective; rank 0 writes HF safetensors (SGLang sync)
    sd = actor.full_state_dict_hf()           # collective; rank 0 gets {hf_name: tensor}, others None

Every method is collective over all ranks (each rank passes its own DP shard; ranks of one
model-parallel group pass the same shard). Per-token tensors are [B, L-1]: column t scores token t+1.
"""
from __future__ import annotations

import contextlib
import functools
import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch

from megatron_rl.actor.batch import BatchError, RolloutBatch, row_blocks
from megatron_rl.actor.checkpoint import load_checkpoint, load_model_state, save_checkpoint
from megatron_rl.actor.forward import check_token_ids, compute_log_probs
from megatron_rl.actor.micro_batching import MicroBatchPlan
from megatron_rl.actor.main_params import load_keeping_fp32, set_main_params
from megatron_rl.actor.lr_schedule import optimizer_steps_per_train_step, restore_scheduler, scheduler_changes
from megatron_rl.actor.optimizer import build_optimizer, optimizer_settings, wrap_ddp
from megatron_rl.actor.optimizer_state import settings_changes, settings_line
from megatron_rl.actor.router_replay import RoutingReplay, agree_on_error
from megatron_rl.actor.routing import RoutingError, RoutingSpec
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.actor.train_step import train_mini_batch
from megatron_rl.convert import (HFTarget, export_model_to_hf, gather_hf_state_dict, hf_target,
                                 load_checkpoint_into_model)
from megatron_rl.lora.apply import adapters_disabled, apply_lora
from megatron_rl.lora.base import base_record
from megatron_rl.lora.merge import merged_items
from megatron_rl.models import build_gpt_model
from megatron_rl.parallel.groups import ActorGroups

__all__ = ["MegatronActor", "plan_pass"]

_SCHEDULER_KEY = "opt_param_scheduler"  # megatron's scheduler state inside a checkpoint's extra state
_SETTINGS_KEY = "optimizer_settings"  # the actor's optimizer keys at save (optimizer.OPTIMIZER_KEYS)


def plan_pass(batcher, batch: RolloutBatch, micro_batch_size: Optional[int] = None) -> MicroBatchPlan:
    """A pass's micro-batches (``MicroBatcher.plan``; the actor's and the critic's). Collective unless the plan
    cannot differ between DP ranks (``MicroBatcher.plan_is_rank_local``): a row that fits no micro-batch, or a shard
    too small for the interleaved schedule, raises on every rank."""
    plan, msg = None, None
    try:
        plan = batcher.plan(batch.lengths.tolist(), micro_batch_size)
    except ValueError as e:
        msg = f"micro-batches of this DP shard: {e}"
    if batcher.plan_is_rank_local:
        if msg:
            raise BatchError(msg)
        return plan
    # a row over the budget, or too few rows for the interleaved schedule, on one DP rank ends the pass on all
    agree_on_error(msg, error=BatchError)
    return plan


class MegatronActor:
    """The Megatron-Core policy model of this rank, its DDP wrapper and optimizer."""

    def __init__(self, spec: ActorSpec, frozen: bool = False) -> None:
        """Build the model chunks for this rank (``spec.model`` under ``spec.parallel``, in ``spec.precision``),
        load ``actor.load_hf`` if set (any TP/PP/EP layout), wrap in Megatron DDP and build the Megatron optimizer
        (``actor.use_distributed_optimizer``). ``frozen``: an actor that is never trained (the KL reference): its
        weights only, in the params dtype (``requires_grad`` False, no DDP gradient buffer, no optimizer or main
        parameters, no host fp32 copy); it runs ``compute_log_probs`` only. Requires megatron's parallel state to
        match ``spec.parallel``; every choice comes made in ``spec`` (the job plan's)."""
        if spec.model is None:
            raise ValueError("MegatronActor: spec.model is None (give a model section or actor.load_hf)")
        self.spec = spec
        self.model_cfg = spec.model
        self.parallel_cfg = spec.parallel
        self.actor_cfg = spec.actor
        self.objective = spec.objective
        """The policy objective: its loss type and settings, bypass or not; the old log-probs and IS weights the
        loss uses come with each step (``CorrectionResult.loss_inputs``)."""
        self.loss = spec.objective.loss
        """The job's ``PolicyLoss`` (its objective's row, ``actor.policy_loss``, the mode), built once by the plan."""
        self.groups = ActorGroups.from_parallel_state(sequence_parallel=self.parallel_cfg.sequence_parallel)
        if spec.batcher.dims != self.groups.dims:
            raise ValueError(f"MegatronActor: the plan's layout {spec.batcher.dims} is not the one megatron's "
                             f"parallel state holds {self.groups.dims}")
        self.precision = spec.precision
        self.lora = None if frozen else spec.lora
        """``LoraSpec``: adapters on the frozen base (docs/lora.md), or None."""
        self._lora_base: Optional[Dict[str, str]] = None  # the base's record, computed on first use
        # megatron-core recomputes activations in backward (actor.recompute_*): same loss and gradients; a LoRA
        # actor is megatron's local spec (the layers its adapters are built on)
        chunks = build_gpt_model(self.model_cfg, self.parallel_cfg, params_dtype=self.precision.params_dtype,
                                 use_transformer_engine=False if self.lora is not None else None,
                                 **spec.recompute.transformer_config_kwargs())
        self.precision.apply_output_layer(chunks)
        self.hf_dir = self.actor_cfg.load_hf
        fp32 = {}  # bf16 actor: the fp32 main parameters come from the loaded values, not their bf16 rounding
        if self.hf_dir:
            fp32 = load_keeping_fp32(chunks, lambda: load_checkpoint_into_model(chunks, self.hf_dir, self.model_cfg,
                                                                                self.groups),
                                     self.hf_dir, keep=not frozen and self.lora is None)
        if self.lora is not None:  # the base frozen (no gradient buffer, no main parameters, no Adam state)
            apply_lora(chunks, self.lora)
        self.frozen = frozen
        """Never trained (the KL reference): the bare model chunks, no gradients, no DDP buffers, no optimizer."""
        if frozen:
            for c in chunks:
                c.requires_grad_(False)
            self.model, self.optimizer, self.scheduler = list(chunks), None, None
        else:
            self.model = wrap_ddp(chunks, self.actor_cfg)
            self.optimizer = build_optimizer(self.model, self.actor_cfg, self.precision)
            set_main_params(self.optimizer, fp32)
            # megatron-core's OptimizerParamScheduler: warm-up / decay of actor.lr, one step per optimizer step
            self.scheduler = spec.lr_schedule.build(self.optimizer)
        self._hf_target: Optional[HFTarget] = None  # built on first export (may need a HF model_type)
        # padded / packed rows, token budget / fixed rows, interleaved or not: decided by the plan, once
        self.batcher = spec.batcher
        # MoE routing replay: hooks in every router of an MoE model (router_replay), the mode (replay_modes)
        self.replay = spec.replay
        spec_r = RoutingSpec.from_model_config(self.model_cfg)
        if spec_r is None and self.replay.needs_moe:
            raise RoutingError(f"actor.routing_replay={self.replay.name!r} needs an MoE model (model.num_moe_experts)")
        self.routing = RoutingReplay(self.model, spec_r, self.groups) if spec_r is not None else None
        self.routing_metrics: Dict[str, float] = {}  # rollout_corr/router_* of the last log-prob pass

    # ------------------------------------------------------------------ groups
    @property
    def dp_group(self):
        """Data-parallel group without CP (ranks holding different rows of the rollout batch): the
        ``group`` for ``compute_rollout_correction`` on ``compute_log_probs`` output."""
        return self.groups.dp_group

    @property
    def dp_cp_group(self):
        """Data-parallel group with CP (ranks holding distinct tokens when sequences are CP-split).
        ``compute_log_probs`` returns whole (CP-gathered) rows, so reductions over its output — e.g.
        ``compute_rollout_correction(group=actor.dp_group, cp_group=None)`` — use ``dp_group``."""
        return self.groups.dp_cp_group

    @property
    def cp_group(self):
        """Context-parallel group."""
        return self.groups.cp_group

    @property
    def pp_group(self):
        """Pipeline-parallel group."""
        return self.groups.pp_group

    @property
    def tp_group(self):
        """Tensor-parallel group."""
        return self.groups.tp_group

    @property
    def dp_rank(self) -> int:
        """This rank's index among the DP shards (``RolloutBatch.shard(dp_rank, dp_size)``)."""
        return self.groups.dp_rank

    @property
    def dp_size(self) -> int:
        """Number of DP shards of the rollout batch (DP without CP)."""
        return self.groups.dp_size

    @property
    def is_last_stage(self) -> bool:
        """This rank runs the output layer."""
        return self.groups.is_last_stage

    # ------------------------------------------------------------------ log-prob pass
    def _plan(self, batch: RolloutBatch, micro_batch_size: Optional[int] = None) -> MicroBatchPlan:
        """This pass's micro-batches (``MicroBatcher.plan``). Collective unless the plan cannot differ between DP
        ranks (``MicroBatcher.plan_is_rank_local``): a row that fits no micro-batch, or a shard too small for the
        interleaved schedule, raises on every rank."""
        return plan_pass(self.batcher, batch, micro_batch_size)

    @staticmethod
    def _in_plan_order(batch: RolloutBatch, plan: MicroBatchPlan, per_token: Optional[Dict] = None):
        """(the batch and the ``per_token`` [B, L-1] tensors with their rows in the plan's order, the inverse
        permutation — a host index, moved to each tensor it reorders — or None when the order is unchanged)."""
        if list(plan.order) == list(range(batch.num_rows)):
            return batch, per_token, None
        order = torch.as_tensor(plan.order, dtype=torch.int64, device="cpu")
        inv = torch.empty_like(order)
        inv[order] = torch.arange(batch.num_rows)
        per_token = None if per_token is None else {
            k: None if v is None else v[order.to(v.device)] for k, v in per_token.items()}
        return batch.take(plan.order), per_token, inv

    def compute_log_probs(self, batch: RolloutBatch, temperature: float, compute_entropy: bool = True,
                          micro_batch_size: Optional[int] = None, compute_sum_pi_squared: bool = False,
                          ) -> Tuple[Optional[torch.Tensor], ...]:
        """(log_probs [B, L-1], entropy [B, L-1]) of this rank's DP shard under softmax(logits / T), on
        every rank of the model-parallel group; 0 at padding columns. fp32, no grad. With
        ``compute_sum_pi_squared`` a third [B, L-1] tensor: sum_j p_j^2 of that softmax per column (the optimal
        token baseline's input; one more all-reduce of [tokens] over TP).
        ``micro_batch_size`` defaults to ``actor.micro_batch_size`` (forward-only can afford more; not used with
        ``actor.max_tokens_per_micro_batch``)."""
        check_token_ids(batch, self.model_cfg.vocab_size)
        plan = self._plan(batch, micro_batch_size)
        ordered, _, inv = self._in_plan_order(batch, plan)
        rp = self.replay.log_prob_pass(self.routing, ordered) if self.routing is not None else None
        try:
            out = compute_log_probs(self.model, ordered, bounds=plan.bounds, temperature=temperature,
                                    groups=self.groups, compute_entropy=compute_entropy, batcher=self.batcher,
                                    replay=rp, compute_sum_pi_squared=compute_sum_pi_squared)
            if rp is not None:  # router agreement with the rollout (reported by the next train_step); r2 record
                self.routing_metrics = self.replay.finish_log_prob_pass(self.routing, rp, ordered, batch, inv)
        finally:
            if rp is not None:
                rp.close()
        if inv is None:
            return out
        return tuple(None if x is None else x[inv.to(x.device)] for x in out)

    # ------------------------------------------------------------------ train step
    def _require_trainable(self, what: str) -> None:
        if self.frozen:
            raise RuntimeError(f"MegatronActor.{what}: this actor is frozen (the KL reference: no optimizer)")

    def train_step(self, batch: RolloutBatch, old_log_probs: Optional[torch.Tensor], advantages: torch.Tensor,
                   response_mask: torch.Tensor, is_weights: Optional[torch.Tensor], temperature: float,
                   ref_log_probs: Optional[torch.Tensor] = None) -> Dict[str, float]:
        """Train on this rank's DP shard: ``ppo_epochs`` passes x ``ppo_mini_batches`` optimizer steps.

        Args:
            batch: this rank's DP shard (``RolloutBatch``).
            old_log_probs: [B, L-1] the old policy of the loss's ratio: the trainer's log-probs before this step
                (``compute_log_probs``), or the rollout's in bypass mode — ``CorrectionResult.loss_inputs``.
            advantages: [B] (broadcast over each row's tokens) or [B, L-1].
            response_mask: [B, L-1] ``CorrectionResult.loss_mask``: the mask after rejection sampling (decoupled), or
                before it in bypass mode, where every micro-batch rejects from its current log-probs.
            is_weights: [B, L-1] the IS weights the loss applies (detached) or None — the second item of
                ``CorrectionResult.loss_inputs``; applied as given. Bypass mode: must be None (each micro-batch of
                each optimizer step computes pi_theta / pi_rollout of its current log-probs, verl's bypass loss;
                ``correction.correct_in_loss``).
            temperature: the rollout temperature (logits are divided by it).
            ref_log_probs: [B, L-1] reference-policy log-probs, needed when policy_loss.kl_loss_coef > 0.
        The objective is ``self.loss`` (the spec's: ``algorithm.rollout_correction.loss_type``).
        Returns ``{"actor/<metric>": float}``: means over the optimizer steps of pg_loss, pg_clipfrac,
        pg_clipfrac_lower, ppo_kl, entropy, grad_norm, num_tokens (and kl_loss) and of the learning rate each
        applied (actor/lr; the schedule advances after each applied update), plus actor/num_optimizer_steps.
        Identical on every rank.
        """
        self._require_trainable("train_step")
        B, W = batch.num_rows, batch.max_length - 1
        check_token_ids(batch, self.model_cfg.vocab_size)
        if old_log_probs is None:
            raise ValueError("train_step: old_log_probs is None: pass the old log-probs the loss uses "
                             "(CorrectionResult.loss_inputs: the recomputed ones, or the rollout's in bypass mode)")
        if self.objective.bypass_correction is not None and is_weights is not None:
            raise ValueError("train_step: is_weights given in bypass mode: the loss computes the IS weights and the "
                             "rejection from the current log-probs in every micro-batch; pass CorrectionResult."
                             "loss_inputs (None) and loss_mask (the mask before rejection)")
        if advantages.dim() == 1:
            if advantages.shape[0] != B:
                raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected [{B}] or [{B}, {W}]")
            advantages = advantages.reshape(B, 1).expand(B, W)
        old, w = old_log_probs, is_weights
        # clip_cov / kl_cov / m2po: token selection over this step's whole batch (all DP ranks), before any split
        select, response_mask, select_metrics = self.loss.select(
            old, batch.rollout_log_probs, advantages.to(torch.float32), response_mask,
            group=self.groups.dp_group if self.groups.dp_size > 1 else None)
        per_token = {"old_log_probs": old, "advantages": advantages.to(torch.float32),
                     "response_mask": response_mask, "is_weights": w, "ref_log_probs": ref_log_probs,
                     "token_select": select}
        for k, v in per_token.items():
            if v is not None and tuple(v.shape) != (B, W):
                raise ValueError(f"train_step: {k} has shape {tuple(v.shape)}, expected [B, L-1] = [{B}, {W}]")
        ac = self.actor_cfg
        blocks = row_blocks(B, ac.ppo_mini_batches, "rows of this DP shard over actor.ppo_mini_batches")
        replayed = self.replay.train_routing(self.routing, batch) if self.routing else None
        if replayed is not None:  # r3: the rollout's routing; r2: the log-prob pass's; for every train forward
            batch = dataclasses.replace(batch, routing=replayed)
        steps, lrs = [], []
        for _ in range(ac.ppo_epochs):
            for start, end in blocks:
                sub = batch.select(start, end)
                sub_tok = {k: None if v is None else v[start:end, : sub.max_length - 1] for k, v in per_token.items()}
                plan = self._plan(sub)
                sub, sub_tok, _ = self._in_plan_order(sub, plan, sub_tok)
                rp = self.routing.begin(sub.lengths, sub.routing, record=False) if replayed is not None else None
                lrs.append(float(self.optimizer.param_groups[0]["lr"]))  # the lr this optimizer step applies
                try:
                    steps.append(train_mini_batch(self.model, self.optimizer, sub, sub_tok, self.loss,
                                                  temperature=temperature, bounds=plan.bounds,
                                                  groups=self.groups, batcher=self.batcher, replay=rp,
                                                  bypass_correction=self.objective.bypass_correction))
                finally:
                    if rp is not None:
                        rp.close()
                if steps[-1]["update_successful"]:  # megatron advances its schedule on applied updates only
                    self.scheduler.step(increment=1)
        out = {f"actor/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]}
        out["actor/lr"] = sum(lrs) / len(lrs)
        out["actor/num_optimizer_steps"] = float(len(steps))
        out.update({f"actor/{k}": v for k, v in select_metrics.items()})
        out.update(self.routing_metrics)  # rollout_corr/router_agreement* of this batch's log-prob pass
        self.routing_metrics = {}
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt_dir: str, step: int, extra_state: Optional[Dict[str, Any]] = None) -> str:
        """Save model, optimizer, learning-rate schedule and RNG state (+ ``extra_state``, picklable, from rank 0)
        under ``ckpt_dir``; collective. Returns the directory written."""
        self._require_trainable("save_checkpoint")
        extra = dict(extra_state or {})
        for key in (_SCHEDULER_KEY, _SETTINGS_KEY):
            if key in extra:
                raise ValueError(f"save_checkpoint: extra_state key {key!r} is the actor's own")
        extra[_SCHEDULER_KEY] = self.scheduler.state_dict()
        extra[_SETTINGS_KEY] = optimizer_settings(self.actor_cfg)
        return save_checkpoint(ckpt_dir, step, self.model, self.optimizer, self.groups, self.model_cfg,
                               self.parallel_cfg, extra, lora=self._lora_record())

    def load_checkpoint(self, ckpt_dir: str) -> Tuple[int, Dict[str, Any]]:
        """Restore what ``save_checkpoint`` wrote; returns (step, extra_state). Raises
        ``CheckpointLayoutError`` naming saved vs requested layout when they differ in a way that
        cannot be loaded. The optimizer state (main parameters, moments, step) comes from the checkpoint, its
        settings (``optimizer.OPTIMIZER_KEYS``: betas, lr schedule, weight decay, clip_grad) from this run's
        config; rank 0 prints one line naming each that differs from the checkpoint's."""
        self._require_trainable("load_checkpoint")
        step, extra, group_diff = load_checkpoint(ckpt_dir, self.model, self.optimizer, self.groups,
                                                  self.model_cfg, self.parallel_cfg, lora=self._lora_record())
        saved_settings, sched = extra.pop(_SETTINGS_KEY, None), extra.pop(_SCHEDULER_KEY, None)
        # a checkpoint written before the settings were recorded: its scheduler state names the schedule's
        old = scheduler_changes(sched, self.scheduler) if saved_settings is None else {}
        # the schedule continues at the saved optimizer step (a checkpoint without one: step x optimizer steps per
        # training step); this run's lr / weight decay settings win
        restore_scheduler(self.scheduler, sched, step * optimizer_steps_per_train_step(self.actor_cfg))
        changes = {**group_diff, **old, **settings_changes(saved_settings, optimizer_settings(self.actor_cfg))}
        line = settings_line(changes, f"from {ckpt_dir}")
        if line and torch.distributed.get_rank() == 0:
            print(line, flush=True)
        return step, extra

    def load_model_state(self, ckpt_dir: str) -> int:
        """The model part alone of a ``save_checkpoint`` checkpoint (the adapters of a LoRA actor), at any layout --
        also across expert_model_parallel_size 1 <-> > 1, which ``load_checkpoint`` refuses; the optimizer state
        (Adam's moments, step), the scheduler, RNG and loop state are not read. fp32 actors and checkpoints only
        (``checkpoint.load_model_state``); LoRA actors only (the adapters: what the tests prove). Returns the
        checkpoint's step."""
        self._require_trainable("load_model_state")
        if self._lora_record() is None:
            raise ValueError("MegatronActor.load_model_state: built for a LoRA actor (actor.lora.rank > 0) only; "
                             "a full model resumes with load_checkpoint")
        return load_model_state(ckpt_dir, self.model, self.model_cfg, lora=self._lora_record())

    # ------------------------------------------------------------------ LoRA
    def adapters_off(self):
        """Context manager: inside it the policy is its frozen base (every adapter off) -- the KL reference of a LoRA
        actor; without adapters, no change."""
        return adapters_disabled(self.model) if self.lora is not None else contextlib.nullcontext()

    def _lora_record(self) -> Optional[Dict[str, Any]]:
        """Collective (first call): {"config": actor.lora, "base": {"path", "sha256"}} of a LoRA actor (rank 0 reads
        the base, every rank gets its record), None without adapters."""
        if self.lora is None:
            return None
        if self._lora_base is None:
            box = [base_record(self.hf_dir) if torch.distributed.get_rank() == 0 else None]
            torch.distributed.broadcast_object_list(box, src=0)
            self._lora_base = box[0]
        return {"config": self.lora.config.to_dict(), "base": dict(self._lora_base)}

    def _export_view(self, view):
        """How the model is exported: ``view``, else for a LoRA actor its adapters merged into the base weights
        (``lora.merge``: fp32, cast once by whoever reads it), else the parameters as they are."""
        if view is None and self.lora is not None:
            return functools.partial(merged_items, scale=self.lora.config.scaling)
        return view

    # ------------------------------------------------------------------ HF export
    def full_state_dict_hf(self) -> Optional[Dict[str, torch.Tensor]]:
        """Collective: rank 0 returns the full model as a HF state dict (CPU tensors, HF names); other
        ranks return None. For the embedded engine's in-process weight sync."""
        return gather_hf_state_dict(self.model, self.model_cfg, self.hf_target.geometry, self.groups,
                                    self._export_view(None))

    def export_hf(self, out_dir: str, view=None) -> Optional[list]:
        """Collective: rank 0 writes a HF safetensors directory (weights + config/tokenizer from
        actor.load_hf, or a generated config.json) to ``out_dir`` and returns the weight files (``view``: how
        the model is read, ``convert.live.TensorView``; a LoRA actor's default: its adapters merged)."""
        return export_model_to_hf(self.model, self.model_cfg, self.hf_target, out_dir, self.groups,
                                  view=self._export_view(view))

    @property
    def hf_target(self) -> HFTarget:
        """What the model is exported as (config / tokenizer of actor.load_hf, or a generated config)."""
        if self._hf_target is None:
            self._hf_target = hf_target(self.model_cfg, self.hf_dir)
        return self._hf_target

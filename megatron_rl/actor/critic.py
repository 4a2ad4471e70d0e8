"""``MegatronCritic``: PPO's value model beside the actor, built from the actor's machinery.

    critic = MegatronCritic(plan.critic)                     # CriticSpec: the actor's model + layout, its optimizer
    values = critic.compute_values(shard)                    # [B, L-1] fp32, column t = V(state before token t+1)
    metrics = critic.train_step(shard, values, returns, response_mask)   # {"critic/vf_loss": ...}
    critic.save_checkpoint(dir, step); critic.load_checkpoint(dir)

Rule: the same ranks, layout, micro-batcher, schedule, DDP, optimizer and checkpoint code as ``MegatronActor``; only
the output layer (``value_head.ValueHead``) and the loss (``losses.compute_value_loss``) differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from megatron_rl.actor.actor import MegatronActor, plan_pass
from megatron_rl.actor.batch import RolloutBatch, row_blocks
from megatron_rl.actor.batcher import MicroBatcher
from megatron_rl.actor.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.actor.critic_hf import ValueSource, load_value_model
from megatron_rl.actor.forward import check_token_ids
from megatron_rl.actor.lr_schedule import LRSchedule, optimizer_steps_per_train_step, restore_scheduler
from megatron_rl.actor.main_params import load_keeping_fp32, set_main_params
from megatron_rl.actor.optimizer import build_optimizer, optimizer_settings, wrap_ddp
from megatron_rl.actor.optimizer_state import settings_changes, settings_line
from megatron_rl.actor.precision import Precision
from megatron_rl.actor.value_head import attach_value_heads
from megatron_rl.actor.value_pass import compute_values, train_value_mini_batch
from megatron_rl.convert import load_checkpoint_into_model
from megatron_rl.models import build_gpt_model
from megatron_rl.models.recompute import Recompute
from megatron_rl.parallel.groups import ActorGroups

__all__ = ["CriticSpec", "MegatronCritic"]

_SCHEDULER_KEY = "opt_param_scheduler"
_SETTINGS_KEY = "critic_settings"  # the critic's keys at save (``settings``), compared on resume


@dataclass(frozen=True)
class CriticSpec:
    """Everything ``MegatronCritic`` is built from (the job plan's ``critic``)."""

    model: Any
    """The actor's ``model:`` section (the critic's body; its output layer becomes the value head)."""
    parallel: Any
    """The ``parallel:`` section: the actor's layout."""
    optim: Any
    """An ``ActorConfig`` whose optimizer keys are the critic's (``plan.critic.OPTIMIZER_KEYS``) and every other
    key the actor's (micro-batching, precision, distributed optimizer, recompute, ``load_hf``)."""
    precision: Precision
    """Parameter dtype (the actor's; the value head never runs in a fp32 output layer)."""
    batcher: MicroBatcher
    """The actor's micro-batcher."""
    lr_schedule: LRSchedule
    """Warm-up / decay of ``critic.lr`` in critic optimizer steps."""
    cliprange_value: float
    """``critic.cliprange_value``."""
    recompute: Recompute
    """megatron-core's activation recomputation: the actor's (``actor.recompute_*``), the plan's object."""
    loss_agg_mode: str
    """``critic.loss_agg_mode``."""
    loss_scale_factor: Optional[float]
    """The ``seq-mean-token-sum-norm`` divisor (``actor.policy_loss.loss_scale_factor`` as verl's critic takes
    it, else the job's response budget), else None."""
    seed: int
    """Seed of the value head's initialisation (``trainer.seed``)."""
    weights: Optional[ValueSource] = None
    """Where the body (and, from a classifier, the head) is loaded from (``critic.load_hf``, else
    ``actor.load_hf``); None: random weights."""


class MegatronCritic:
    """The value model of this rank: megatron-core GPTModel chunks with a value head, DDP and optimizer."""

    def __init__(self, spec: CriticSpec) -> None:
        self.spec = spec
        self.model_cfg, self.parallel_cfg, self.optim_cfg = spec.model, spec.parallel, spec.optim
        self.groups = ActorGroups.from_parallel_state(sequence_parallel=self.parallel_cfg.sequence_parallel)
        if spec.batcher.dims != self.groups.dims:
            raise ValueError(f"MegatronCritic: the plan's layout {spec.batcher.dims} is not the one megatron's "
                             f"parallel state holds {self.groups.dims}")
        self.batcher = spec.batcher
        chunks = build_gpt_model(self.model_cfg, self.parallel_cfg, params_dtype=spec.precision.params_dtype,
                                 **spec.recompute.transformer_config_kwargs())
        src = spec.weights
        hf = src.path if src is not None and src.head is None else None
        fp32 = {}
        if hf:  # a CausalLM's (or converted directory's) body; the head starts fresh
            fp32 = load_keeping_fp32(chunks, lambda: load_checkpoint_into_model(chunks, hf, self.model_cfg,
                                                                                self.groups), hf, keep=True)
            dropped = {id(p) for c in chunks if c.post_process for p in c.output_layer.parameters()}
            fp32 = {k: v for k, v in fp32.items() if k not in dropped}  # the LM head is not kept
        tp = self.groups.tp_size
        attach_value_heads(chunks, self.model_cfg.init_method_std, spec.seed,
                           sequence_parallel=self.parallel_cfg.sequence_parallel and tp > 1,
                           tp_group=self.groups.tp_group)
        if src is not None and src.head is not None:  # a value / reward model: body and head (its score)
            fp32 = load_keeping_fp32(chunks, lambda: load_value_model(chunks, src, self.model_cfg, self.groups),
                                     src.path, keep=True)
        self.model = wrap_ddp(chunks, self.optim_cfg)
        self.optimizer = build_optimizer(self.model, self.optim_cfg, spec.precision)
        set_main_params(self.optimizer, fp32)
        self.scheduler = spec.lr_schedule.build(self.optimizer)

    @property
    def dp_rank(self) -> int:
        """This rank's DP shard index (the actor's)."""
        return self.groups.dp_rank

    @property
    def dp_size(self) -> int:
        """Number of DP shards (the actor's)."""
        return self.groups.dp_size

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, L-1] fp32 values of this rank's DP shard on every rank of the model-parallel group (0 at padding);
        column t is the value of the state before token t+1 (verl's alignment). No grad."""
        check_token_ids(batch, self.model_cfg.vocab_size)
        plan = plan_pass(self.batcher, batch)
        ordered, _, inv = MegatronActor._in_plan_order(batch, plan)
        out = compute_values(self.model, ordered, bounds=plan.bounds, groups=self.groups, batcher=self.batcher)
        return out if inv is None else out[inv.to(out.device)]

    def train_step(self, batch: RolloutBatch, values: torch.Tensor, returns: torch.Tensor,
                   response_mask: torch.Tensor) -> Dict[str, float]:
        """``critic.ppo_epochs`` x ``critic.ppo_mini_batches`` optimizer steps of the clipped value loss on this
        rank's DP shard. ``values``: the values before this step (``compute_values``); ``returns``, ``response_mask``:
        [B, L-1]. Returns ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/grad_norm``,
        ``critic/lr`` (means over the optimizer steps), ``critic/num_optimizer_steps``; identical on every rank."""
        B, W = batch.num_rows, batch.max_length - 1
        check_token_ids(batch, self.model_cfg.vocab_size)
        per_token = {"values": values, "returns": returns, "response_mask": response_mask}
        for k, v in per_token.items():
            if v is None or tuple(v.shape) != (B, W):
                raise ValueError(f"critic.train_step: {k} has shape {None if v is None else tuple(v.shape)}, "
                                 f"expected [B, L-1] = [{B}, {W}]")
        per_token = {k: v.to(torch.float32) for k, v in per_token.items()}
        oc = self.optim_cfg
        blocks = row_blocks(B, oc.ppo_mini_batches, "rows of this DP shard over critic.ppo_mini_batches")
        steps, lrs = [], []
        for _ in range(oc.ppo_epochs):
            for start, end in blocks:
                sub = batch.select(start, end)
                sub_tok = {k: v[start:end, : sub.max_length - 1] for k, v in per_token.items()}
                plan = plan_pass(self.batcher, sub)
                sub, sub_tok, _ = MegatronActor._in_plan_order(sub, plan, sub_tok)
                lrs.append(float(self.optimizer.param_groups[0]["lr"]))
                steps.append(train_value_mini_batch(
                    self.model, self.optimizer, sub, sub_tok, cliprange_value=self.spec.cliprange_value,
                    loss_agg_mode=self.spec.loss_agg_mode, bounds=plan.bounds, groups=self.groups,
                    batcher=self.batcher, loss_scale_factor=self.spec.loss_scale_factor))
                if steps[-1]["update_successful"]:
                    self.scheduler.step(increment=1)
        out = {f"critic/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0] if k != "update_successful"}
        out["critic/lr"] = sum(lrs) / len(lrs)
        out["critic/num_optimizer_steps"] = float(len(steps))
        return out

    def settings(self) -> Dict[str, Any]:
        """The critic's keys that decide its updates (optimizer, schedule, mini-batches, epochs, value loss)."""
        oc = self.optim_cfg
        return {**optimizer_settings(oc), "ppo_mini_batches": oc.ppo_mini_batches, "ppo_epochs": oc.ppo_epochs,
                "cliprange_value": self.spec.cliprange_value, "loss_agg_mode": self.spec.loss_agg_mode}

    def save_checkpoint(self, ckpt_dir: str, step: int) -> str:
        """Model, optimizer, schedule, the critic's settings (and RNG) under ``ckpt_dir``; collective."""
        return save_checkpoint(ckpt_dir, step, self.model, self.optimizer, self.groups, self.model_cfg,
                               self.parallel_cfg, {_SCHEDULER_KEY: self.scheduler.state_dict(),
                                                   _SETTINGS_KEY: self.settings()})

    def load_checkpoint(self, ckpt_dir: str) -> Tuple[int, Dict[str, Any]]:
        """Restore what ``save_checkpoint`` wrote; returns (step, extra state). This run's settings win; rank 0
        prints one line naming each ``critic.<key>`` that differs from the checkpoint's."""
        step, extra, group_diff = load_checkpoint(ckpt_dir, self.model, self.optimizer, self.groups,
                                                  self.model_cfg, self.parallel_cfg)
        restore_scheduler(self.scheduler, extra.pop(_SCHEDULER_KEY, None),
                          step * optimizer_steps_per_train_step(self.optim_cfg))
        changes = {**{k.replace("actor.", "critic.", 1): v for k, v in group_diff.items()},
                   **{k.replace("actor.", "critic.", 1): v
                      for k, v in settings_changes(extra.pop(_SETTINGS_KEY, None), self.settings()).items()}}
        line = settings_line(changes, f"the critic from {ckpt_dir}")
        if line and torch.distributed.get_rank() == 0:
            print(line, flush=True)
        return step, extra

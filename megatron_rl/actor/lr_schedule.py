"""The learning-rate schedule of the actor: megatron-core's ``OptimizerParamScheduler`` with Megatron-LM's keys.

    steps = LRSchedule.from_actor(cfg.actor, cfg.trainer.steps)   # warm-up / decay lengths in optimizer steps
    scheduler = steps.build(optimizer)                    # sets every param group's lr and weight decay
    ... optimizer.step(); scheduler.step(increment=1)     # once per successful optimizer step
    state = scheduler.state_dict(); restore_scheduler(scheduler, state)   # checkpoint / resume

Units are optimizer steps (Megatron-LM's iterations): a training step makes ``actor.ppo_epochs x
actor.ppo_mini_batches`` of them, so the whole run has ``trainer.steps`` times that many — the default decay
length. ``actor.lr_warmup_fraction`` (verl's ``lr_warmup_steps_ratio``) warms up for
``int(fraction x lr_decay_steps)`` steps (verl rounds down too; Megatron-LM takes the fraction of the decay
steps). Semantics are megatron's: linear warm-up from ``lr_warmup_init`` to ``lr`` over the warm-up steps
(step 0 runs at ``lr_warmup_init``), then ``lr_decay_style`` from ``lr`` down to ``min_lr`` at
``lr_decay_steps``, ``min_lr`` after it (``constant``: ``lr`` for ever). Weight decay stays constant
(``actor.weight_decay`` times megatron's per-group ``wd_mult``). The configuration of the running job wins on
resume: only the step count comes from the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["LR_DECAY_STYLES", "LRSchedule", "lr_schedule_errors", "optimizer_steps_per_train_step",
           "restore_scheduler", "scheduler_changes"]

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
"""megatron-core's ``OptimizerParamScheduler`` decay styles offered as ``actor.lr_decay_style``."""


def optimizer_steps_per_train_step(actor_cfg) -> int:
    """Optimizer steps one training step makes (``ppo_epochs x ppo_mini_batches``)."""
    return int(actor_cfg.ppo_epochs) * int(actor_cfg.ppo_mini_batches)


@dataclass(frozen=True)
class LRSchedule:
    """A job's schedule in optimizer steps, resolved from ``actor.*`` and ``trainer.steps``."""

    max_lr: float
    """``actor.lr``: the learning rate after warm-up."""
    min_lr: float
    """``actor.min_lr``: the learning rate at and after ``decay_steps``."""
    init_lr: float
    """``actor.lr_warmup_init``: the learning rate of step 0 of the warm-up."""
    warmup_steps: int
    """Optimizer steps of the linear warm-up (0: none)."""
    decay_steps: int
    """Optimizer step at which the decay reaches ``min_lr``."""
    decay_style: str
    """One of ``LR_DECAY_STYLES``."""
    weight_decay: float
    """``actor.weight_decay`` (constant)."""

    @classmethod
    def from_actor(cls, ac, steps: int) -> "LRSchedule":
        """The schedule of ``actor:`` section ``ac`` over ``trainer.steps`` = ``steps`` (validated by
        ``lr_schedule_errors``; raises ValueError naming the key when it is not valid)."""
        errs = lr_schedule_errors(ac, steps)
        if errs:
            raise ValueError("; ".join(errs))
        decay = _decay_steps(ac, steps)
        return cls(max_lr=float(ac.lr), min_lr=float(ac.min_lr), init_lr=float(ac.lr_warmup_init),
                   warmup_steps=_warmup_steps(ac, decay), decay_steps=decay, decay_style=ac.lr_decay_style,
                   weight_decay=float(ac.weight_decay))

    def build(self, optimizer):
        """megatron-core's ``OptimizerParamScheduler`` over ``optimizer`` (a megatron optimizer, chained or not);
        it sets every param group's lr (the group's ``max_lr`` / ``min_lr``, from ``OptimizerConfig``) and weight
        decay (times the group's ``wd_mult``) for step 0 at once."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        return OptimizerParamScheduler(
            optimizer, init_lr=self.init_lr, max_lr=self.max_lr, min_lr=self.min_lr,
            lr_warmup_steps=self.warmup_steps, lr_decay_steps=self.decay_steps, lr_decay_style=self.decay_style,
            start_wd=self.weight_decay, end_wd=self.weight_decay, wd_incr_steps=self.decay_steps,
            wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def restore_scheduler(scheduler, state: Optional[dict], num_steps: int) -> None:
    """Continue ``scheduler`` from a checkpoint: the step count of its saved ``state`` (megatron's
    ``state_dict``), or ``num_steps`` for a checkpoint written without one; the running job's settings win
    (``override_opt_param_scheduler``), also over the ``max_lr`` / ``min_lr`` that loading the optimizer's
    state put back into its param groups (torch restores a group's every key, and megatron's scheduler reads
    these before its own)."""
    for group in scheduler.optimizer.param_groups:
        group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
    scheduler.num_steps = 0  # megatron's load_state_dict adds the saved count to the current one
    if state is None:
        scheduler.step(increment=int(num_steps))
    else:
        scheduler.load_state_dict(state)


#: megatron's scheduler state keys -> the settings of this run they come from (the warm-up / decay in optimizer steps)
_SCHEDULER_NAMES = {"max_lr": "actor.lr", "min_lr": "actor.min_lr", "start_wd": "actor.weight_decay",
                    "end_wd": "actor.weight_decay", "lr_decay_style": "actor.lr_decay_style",
                    "lr_warmup_steps": "lr warm-up optimizer steps (actor.lr_warmup_steps / lr_warmup_fraction)",
                    "lr_decay_steps": "lr decay optimizer steps (actor.lr_decay_steps)"}


def scheduler_changes(saved: Optional[Mapping[str, Any]], scheduler) -> Dict[str, Tuple[Any, Any]]:
    """{name: (checkpoint's, this run's)} of the schedule settings in a checkpoint's scheduler state (megatron's
    ``state_dict``) that differ from ``scheduler``'s, built from this run's config: what a checkpoint written before
    the optimizer settings were recorded tells of them. ``saved`` None: {}."""
    if not saved:
        return {}
    now = scheduler.state_dict()
    out: Dict[str, Tuple[Any, Any]] = {}
    for key, name in _SCHEDULER_NAMES.items():
        if key in saved and saved[key] != now.get(key):
            out.setdefault(name, (saved[key], now.get(key)))
    return out


def _decay_steps(ac, trainer_steps: int) -> int:
    if ac.lr_decay_steps is not None:
        return int(ac.lr_decay_steps)
    return int(trainer_steps) * optimizer_steps_per_train_step(ac)


def _warmup_steps(ac, decay_steps: int) -> int:
    if ac.lr_warmup_fraction is not None:
        return int(float(ac.lr_warmup_fraction) * decay_steps)
    return int(ac.lr_warmup_steps)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def lr_schedule_errors(ac, trainer_steps: int) -> List[str]:
    """Violations of the schedule keys of ``actor`` (``ac``), each naming its dotted key."""
    errs = []
    if ac.lr_decay_style not in LR_DECAY_STYLES:
        errs.append(f"actor.lr_decay_style: {ac.lr_decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}")
    if not _is_int(ac.lr_warmup_steps) or ac.lr_warmup_steps < 0:
        errs.append(f"actor.lr_warmup_steps: must be an integer >= 0, got {ac.lr_warmup_steps!r}")
    frac = ac.lr_warmup_fraction
    if frac is not None:
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac < 1.0:
            errs.append(f"actor.lr_warmup_fraction: must be in [0, 1) (or null), got {frac!r}")
        if ac.lr_warmup_steps != 0:
            errs.append(f"actor.lr_warmup_fraction: set together with actor.lr_warmup_steps "
                        f"({ac.lr_warmup_steps!r}); give one of the two")
    if ac.lr_decay_steps is not None and (not _is_int(ac.lr_decay_steps) or ac.lr_decay_steps < 1):
        errs.append(f"actor.lr_decay_steps: must be an integer >= 1 (or null: every optimizer step of the run), "
                    f"got {ac.lr_decay_steps!r}")
    lr = ac.lr
    for key in ("min_lr", "lr_warmup_init"):
        v = getattr(ac, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= lr:
            errs.append(f"actor.{key}: must be in [0, actor.lr = {lr!r}], got {v!r}")
    if errs or not _is_int(trainer_steps) or trainer_steps < 1:
        return errs
    decay = _decay_steps(ac, trainer_steps)
    warmup = _warmup_steps(ac, decay)
    if warmup >= decay:
        key = "lr_warmup_fraction" if frac is not None else "lr_warmup_steps"
        errs.append(f"actor.{key}: the warm-up ({warmup} optimizer steps) must be shorter than the decay "
                    f"(actor.lr_decay_steps = {decay} optimizer steps"
                    + ("" if ac.lr_decay_steps is not None else
                       " = trainer.steps x actor.ppo_epochs x actor.ppo_mini_batches") + ")")
    return errs

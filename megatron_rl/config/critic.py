"""The ``critic:`` section: PPO's value model (verl's ``critic.*`` names; ``critic_warmup`` is verl's
``trainer.critic_warmup``).

Rule: the critic is the actor's architecture with a scalar value head, on the actor's ranks and layout, initialised
from ``critic.load_hf`` (null: ``actor.load_hf``'s body); its optimizer keys are its own and every other actor key (micro-batching, precision,
distributed optimizer, recompute) is the actor's. docs/critic.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron_rl.losses.config import LOSS_AGG_MODES

__all__ = ["CriticConfig"]


@dataclass
class CriticConfig:
    """PPO's value model (critic)."""

    enable: Optional[bool] = None
    """Train a critic (verl's ``critic.enable``); null: on exactly when ``algorithm.advantage_estimator`` is
    ``gae`` (verl's ``need_critic``). The choice is said at the job's start."""
    lr: float = 1e-5
    """Adam learning rate of the critic (verl's ``critic.optim.lr``; its default)."""
    lr_warmup_steps: int = 0
    """Critic optimizer steps of linear warm-up (as ``actor.lr_warmup_steps``)."""
    lr_warmup_fraction: Optional[float] = None
    """Warm-up as a fraction of ``lr_decay_steps`` (verl's ``critic.optim.lr_warmup_steps_ratio``)."""
    lr_warmup_init: float = 0.0
    """Learning rate of the first warm-up step."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine | inverse-square-root (as ``actor.lr_decay_style``)."""
    lr_decay_steps: Optional[int] = None
    """Critic optimizer step where the decay reaches ``min_lr`` (null: every critic optimizer step of the run)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay (verl's ``critic.optim.weight_decay`` default)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    clip_grad: float = 1.0
    """Gradient-norm clipping of the critic (verl's ``critic.optim.clip_grad``)."""
    ppo_mini_batches: Optional[int] = None
    """Critic optimizer steps per rollout batch and epoch; null: ``actor.ppo_mini_batches`` (verl's
    ``critic.ppo_mini_batch_size`` defaults to the actor's)."""
    ppo_epochs: Optional[int] = None
    """Passes of the critic over the rollout batch (verl's ``critic.ppo_epochs``); null: ``actor.ppo_epochs``
    (verl's default)."""
    cliprange_value: float = 0.5
    """Value clip: predictions are clipped to old values +- this (verl's ``critic.cliprange_value``)."""
    loss_agg_mode: Optional[str] = None
    """Aggregation of the value loss (verl's ``critic.loss_agg_mode``; same modes as the policy loss); null:
    ``actor.policy_loss.loss_agg_mode`` (verl's default)."""
    load_hf: Optional[str] = None
    """HF directory of the critic's weights (verl's ``critic.model.path``), of the actor's model's shapes: a
    ``*ForTokenClassification`` / ``*ForSequenceClassification`` with num_labels 1 gives the body and the value head
    (its ``score``), a ``*ForCausalLM`` the body with a fresh head; null: ``actor.load_hf`` (verl's default)."""
    critic_warmup: int = 0
    """verl's ``trainer.critic_warmup``: the actor does not update while this exceeds the 1-based step (verl's
    comparison), so the first ``critic_warmup - 1`` steps train the critic only (0 and 1: none)."""

    def errors(self) -> List[str]:
        """This section's own problems, each naming its key."""
        out = []
        if self.enable not in (None, True, False):
            out.append(f"critic.enable: must be true, false or null, got {self.enable!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            out.append(f"critic.lr: must be > 0, got {self.lr!r}")
        if not (isinstance(self.cliprange_value, (int, float)) and self.cliprange_value > 0):
            out.append(f"critic.cliprange_value: must be > 0, got {self.cliprange_value!r}")
        if self.loss_agg_mode is not None and self.loss_agg_mode not in LOSS_AGG_MODES:
            out.append(f"critic.loss_agg_mode: {self.loss_agg_mode!r} must be one of {list(LOSS_AGG_MODES)}")
        for key in ("ppo_epochs", "ppo_mini_batches"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                out.append(f"critic.{key}: must be an int >= 1 (or null: the actor's), got {v!r}")
        if isinstance(self.critic_warmup, bool) or not isinstance(self.critic_warmup, int) or self.critic_warmup < 0:
            out.append(f"critic.critic_warmup: must be an int >= 0, got {self.critic_warmup!r}")
        return out

    def enabled(self, advantage_estimator: str) -> bool:
        """Whether the job trains a critic (``enable``, or null: the estimator is ``gae``)."""
        return advantage_estimator == "gae" if self.enable is None else bool(self.enable)

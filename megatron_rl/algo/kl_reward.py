"""KL in the reward (verl's ``algorithm.use_kl_in_reward``): token_level_rewards = token_level_scores - beta * kld.

verl 0.9.1's ``apply_kl_penalty`` (``ray_trainer.py``) and its controllers (``core_algos.py``: ``FixedKLController``,
``AdaptiveKLController``, ``get_kl_controller``), with the batch statistics exact over DP: ``current_kl`` (the
mean over sequences of each sequence's masked-mean kld) and the batch size the adaptive controller steps by are
sums all-reduced over the DP group, so beta is the same on every rank and equal to a single-process run's. Rule:
beta is read BEFORE the update (the step's rewards use the coefficient the controller held when the step began),
and the controller's state is saved with each checkpoint (``state_dict``). Formulas: docs/kl_reward.md.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["KL_CTRL_TYPES", "KLControlConfig", "KLInReward", "NoKLInReward", "AdaptiveKLController",
           "FixedKLController", "build_kl_controller", "token_level_scores"]

KL_CTRL_TYPES = ("fixed", "adaptive")
"""``algorithm.kl_ctrl.type`` values (verl's ``get_kl_controller``)."""


@dataclass
class KLControlConfig:
    """verl's ``algorithm.kl_ctrl`` block (``KLControlConfig``; verl 0.9.1's defaults)."""

    type: str = "fixed"
    """"fixed": beta stays ``kl_coef``; "adaptive": beta *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) x
    batch_size / horizon after each step (Ziegler et al. 2019, verl's ``AdaptiveKLController``)."""
    kl_coef: float = 0.001
    """beta: the fixed coefficient, or the adaptive controller's initial one."""
    horizon: int = 10000
    """Adaptive: the sequences over which the proportional error is applied (> 0)."""
    target_kl: float = 0.1
    """Adaptive: the per-sequence mean KL the controller steers to (> 0)."""

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "KLControlConfig":
        """Build from the (checked) keys of the YAML block; an empty or null block is verl's default."""
        return cls(**(d or {}))

    def errors(self, key: str = "algorithm.kl_ctrl") -> List[str]:
        """Violations, each naming its dotted key."""
        errs = []
        if self.type not in KL_CTRL_TYPES:
            errs.append(f"{key}.type: {self.type!r} is not one of {', '.join(KL_CTRL_TYPES)}")
        if isinstance(self.kl_coef, bool) or not isinstance(self.kl_coef, (int, float)) \
                or not math.isfinite(self.kl_coef) or self.kl_coef < 0:
            errs.append(f"{key}.kl_coef: {self.kl_coef!r} must be a finite number >= 0")
        if self.type == "adaptive":
            if isinstance(self.horizon, bool) or not isinstance(self.horizon, (int, float)) or not self.horizon > 0:
                errs.append(f"{key}.horizon: {self.horizon!r} must be > 0 with type adaptive (verl asserts it)")
            if isinstance(self.target_kl, bool) or not isinstance(self.target_kl, (int, float)) \
                    or not (math.isfinite(self.target_kl) and self.target_kl > 0):
                errs.append(f"{key}.target_kl: {self.target_kl!r} must be a finite number > 0 with type adaptive "
                            f"(the controller divides by it)")
        return errs


class FixedKLController:
    """beta = ``kl_coef`` for ever (verl's ``FixedKLController``)."""

    type = "fixed"

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No change."""


class AdaptiveKLController:
    """verl's ``AdaptiveKLController`` (https://arxiv.org/pdf/1909.08593.pdf), the same arithmetic in Python
    floats (verl: ``np.clip`` on a float; the product is a float64 either way)."""

    type = "adaptive"

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """beta *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon."""
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def build_kl_controller(cfg: KLControlConfig):
    """The controller of ``algorithm.kl_ctrl`` (verl's ``get_kl_controller``); ``ValueError`` naming the key."""
    errs = cfg.errors()
    if errs:
        raise ValueError("; ".join(errs))
    if cfg.type == "fixed":
        return FixedKLController(cfg.kl_coef)
    return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)


def token_level_scores(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """verl's ``token_level_scores`` [B, T] (float32): each row's scalar reward on its last response token (the
    last column where ``response_mask`` is 1; a row without one: the last column, as verl's index -1), 0
    elsewhere. ``scores.sum(-1)`` is ``rewards``."""
    if rewards.dim() != 1 or response_mask.dim() != 2 or rewards.shape[0] != response_mask.shape[0]:
        raise ValueError(f"token_level_scores: rewards [B] and response_mask [B, T] expected, got "
                         f"{tuple(rewards.shape)} and {tuple(response_mask.shape)}")
    if rewards.device != response_mask.device:
        raise ValueError(f"token_level_scores: rewards on {rewards.device}, response_mask on {response_mask.device}")
    B, T = response_mask.shape
    cols = torch.arange(T, device=response_mask.device).expand(B, T)
    last = torch.where(response_mask != 0, cols, torch.full_like(cols, -1)).max(dim=-1).values
    last = torch.where(last < 0, torch.full_like(last, T - 1), last)
    scores = torch.zeros(B, T, dtype=torch.float32, device=rewards.device)
    return scores.scatter(1, last[:, None], rewards.to(torch.float32)[:, None])


class KLInReward:
    """The step's KL penalty in the reward: a controller (its state: beta) and the per-token estimator.

    ``estimator(old_log_probs, ref_log_probs, kl_penalty) -> kld [B, T]`` is verl's ``kl_penalty`` and
    ``all_reduce(t, group=...)`` an in-place SUM all-reduce; the job plan passes ``megatron_rl.losses.kl.kl_penalty``
    and ``megatron_rl.parallel.devices.all_reduce_`` (staged on the device the group's backend takes): this layer
    imports neither."""

    def __init__(self, kl_penalty: str, ctrl: KLControlConfig, estimator: Callable[..., torch.Tensor],
                 all_reduce: Optional[Callable[..., Any]] = None):
        self.kl_penalty = kl_penalty
        self.ctrl_cfg = ctrl
        self.controller = build_kl_controller(ctrl)
        self.estimator = estimator
        self.all_reduce = all_reduce or (lambda t, group=None: dist.all_reduce(t, group=group))

    def apply(self, token_level_scores: torch.Tensor, old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
              response_mask: torch.Tensor, group=None) -> Tuple[torch.Tensor, Dict[str, float]]:
        """``(token_level_rewards [B, T], metrics)`` of this rank's rows, verl's ``apply_kl_penalty``: kld =
        estimator(old, ref) x mask; rewards = scores - beta x kld; then the controller steps with the whole
        batch's ``current_kl`` and size (all-reduced over ``group``: collective on every DP rank, also one
        with no rows). Metrics ``actor/reward_kl_penalty`` (current_kl) and ``actor/reward_kl_penalty_coeff``
        (the beta applied)."""
        if ref_log_probs is None:
            raise ValueError("algorithm.use_kl_in_reward: the reference log-probs are None (no reference model "
                             "was built)")
        for name, t in (("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs),
                        ("response_mask", response_mask)):
            if tuple(t.shape) != tuple(token_level_scores.shape):
                raise ValueError(f"KL in the reward: {name} has shape {tuple(t.shape)}, token_level_scores "
                                 f"{tuple(token_level_scores.shape)}")
            if t.device != token_level_scores.device:
                raise ValueError(f"KL in the reward: {name} on {t.device}, token_level_scores on "
                                 f"{token_level_scores.device}")
        mask = response_mask.to(token_level_scores.dtype)
        kld = self.estimator(old_log_probs, ref_log_probs, self.kl_penalty).detach()
        kld = torch.where(response_mask != 0, kld, torch.zeros_like(kld))  # verl: kld * response_mask
        beta = self.controller.value
        rewards = token_level_scores - beta * kld
        # verl: masked_mean(kld, mask, -1) = sum / (count + 1e-8) per row, then the mean over rows
        per_row = kld.to(torch.float64).sum(-1) / (mask.to(torch.float64).sum(-1) + 1e-8)
        stats = torch.stack([per_row.sum(), torch.tensor(float(per_row.shape[0]), dtype=torch.float64,
                                                         device=per_row.device)])
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            self.all_reduce(stats, group=group)
        total, rows = stats.tolist()
        current_kl = total / rows if rows > 0 else 0.0
        self.controller.update(current_kl=current_kl, n_steps=int(rows))
        return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}

    def sequence_rewards(self, rewards: torch.Tensor, old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                         response_mask: torch.Tensor, group=None) -> Tuple[torch.Tensor, Dict[str, float]]:
        """Scalar rewards [B] for GRPO / RLOO: ``apply`` on ``token_level_scores(rewards)``, summed per row as
        verl's outcome estimators do (``scores = token_level_rewards.sum(-1)``)."""
        tlr, metrics = self.apply(token_level_scores(rewards, response_mask), old_log_probs, ref_log_probs,
                                  response_mask, group)
        return tlr.sum(-1), metrics

    def estimator_rewards(self, rewards: torch.Tensor, old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                          response_mask: torch.Tensor, loss_mask: torch.Tensor, token_level: bool, group=None,
                          scores: Optional[torch.Tensor] = None
                          ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Dict[str, float]]:
        """What the step hands the advantage estimator: ``(rewards [B], token_level_rewards [B, T] or None,
        metrics)``. Summing estimators (``token_level`` False): ``sequence_rewards`` and None. Token-level ones
        (gae, reinforce_plus_plus, remax, the optimal token baselines): ``apply`` with the scores on each row's
        last token of ``loss_mask`` (where the estimator puts them without KL) and the kld over
        ``response_mask`` (before rejection), so beta = 0 gives the rewards without KL exactly. ``scores``: the
        token-level scores where the estimator puts them instead (the critic's GAE: each row's last token)."""
        if not token_level:
            r, metrics = self.sequence_rewards(rewards, old_log_probs, ref_log_probs, response_mask, group)
            return r, None, metrics
        if scores is None:
            scores = token_level_scores(rewards, loss_mask)
        tlr, metrics = self.apply(scores, old_log_probs, ref_log_probs, response_mask, group)
        return rewards, tlr, metrics

    # ---- checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps: the settings and the current beta."""
        return {"kl_penalty": self.kl_penalty, **asdict(self.ctrl_cfg), "value": self.controller.value}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> Optional[str]:
        """Resume: an adaptive controller continues at the saved beta when the checkpoint's controller was
        adaptive too; a fixed one keeps ``kl_coef``. Returns a line saying what changed against the checkpoint
        (the caller prints it), or None when it continues as saved."""
        cfg = self.ctrl_cfg
        if not state:
            return (f"algorithm.use_kl_in_reward: the checkpoint holds no KL controller state: beta starts at "
                    f"algorithm.kl_ctrl.kl_coef={cfg.kl_coef:g}")
        changed = [f"{k} {state.get(k)!r} -> {v!r}" for k, v in (("kl_penalty", self.kl_penalty),
                                                                   *asdict(cfg).items()) if state.get(k) != v]
        if cfg.type == "adaptive" and state.get("type") == "adaptive":
            self.controller.value = float(state["value"])
            if not changed:
                return None
            return (f"algorithm.kl_ctrl: changed since the checkpoint ({', '.join(changed)}); the adaptive beta "
                    f"continues at the saved {self.controller.value:g}")
        if not changed:
            return None
        return (f"algorithm.kl_ctrl: changed since the checkpoint ({', '.join(changed)}); beta = "
                f"{self.controller.value:g} (the checkpoint's was {float(state.get('value', float('nan'))):g})")


class NoKLInReward:
    """``algorithm.use_kl_in_reward: false``: the rewards as scored."""

    def sequence_rewards(self, rewards, old_log_probs, ref_log_probs, response_mask, group=None):
        """``(rewards, {})``."""
        return rewards, {}

    def estimator_rewards(self, rewards, old_log_probs, ref_log_probs, response_mask, loss_mask, token_level,
                          group=None, scores=None):
        """``(rewards, None, {})``: the estimator places the scores itself."""
        return rewards, None, {}

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """Nothing to keep."""
        return None

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> Optional[str]:
        """A checkpoint's KL controller state is dropped (said)."""
        if state:
            return ("algorithm.use_kl_in_reward is false: the checkpoint's KL controller state (beta "
                    f"{float(state.get('value', float('nan'))):g}) is not used")
        return None

"""One row per policy objective (``Objective``); every table about the objectives is derived from ``OBJECTIVES``.

A row says what the loss needs to know about an objective: its term function, what it reads, the inputs and
parameters it needs, whether bypass mode runs it and whether the IS weights apply there, its batch selection
and its own aggregation. Adding an objective = one row here + its term function + tests (docs/objectives.md).
A loss type is looked up once, where its section is read (``RolloutCorrectionConfig.objective``); the job's
``PolicyLoss`` is built from the row (``policy.build_policy_loss``) and everything after asks the row.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import objectives as tok
from . import selection as sel
from . import sequence as seq
from .config import PolicyLossConfig, choice
from .params import (CLIP_COV_LB, CLIP_COV_RATIO, CLIP_COV_SEED, CLIP_COV_UB, CLIP_RATIO_C, CLIP_RATIO_HIGH,
                     CLIP_RATIO_LOW, DRO_BETA, KL_COV_RATIO, M2_THRESHOLD, OPSM_DELTA, PARAMETERS, PPO_KL_COEF,
                     TAU_NEG, TAU_POS, Param)
from .terms import ObjectiveInputs, ObjectiveTerms

TOKEN, SEQUENCE, BATCH = "token", "sequence", "batch"
"""What an objective reads: each token alone; per-sequence sums (over the CP group); batch statistics (a
selection over the DP group, once per training step)."""

INPUTS = ("rollout_log_probs",)
"""Inputs an objective may need beyond log_probs, old_log_probs, advantages and response_mask."""


@dataclass(frozen=True)
class Objective:
    """One policy objective (``algorithm.rollout_correction.loss_type``)."""

    name: str
    """The loss type (verl's ``actor.policy_loss.loss_mode`` name where verl has it)."""

    terms: Callable[[ObjectiveInputs], ObjectiveTerms]
    """Its term function: one micro-batch's per-token loss and metric indicators."""

    reference: str
    """The peer function it follows (the tests compare against it)."""

    reads: str = TOKEN
    """``TOKEN``, ``SEQUENCE`` (per-sequence sums over the CP group) or ``BATCH`` (needs ``selection``)."""

    parameters: Tuple[Param, ...] = ()
    """The ``actor.policy_loss`` parameters it reads (verl's names, with their ranges)."""

    required: Tuple[Param, ...] = ()
    """Parameters without a default that it needs (among ``parameters``)."""

    inputs: Tuple[str, ...] = ()
    """Inputs it needs beyond the usual four (from ``INPUTS``): its batch selection reads them."""

    bypass: bool = False
    """Bypass mode runs it (verl's bypass loss replaces any other loss_mode: ppo_clip and reinforce)."""

    bypass_is_weights: bool = False
    """In bypass mode the loss applies the IS weights pi_theta / pi_rollout (reinforce); False: its ratio
    pi_theta / pi_rollout already is the correction (ppo_clip). Decoupled, every objective applies them."""

    selection: Optional[Callable[..., sel.Selected]] = None
    """Its batch selection (``selection.py``), run once per training step before the micro-batches are cut."""

    aggregation: Optional[str] = None
    """The aggregation it imposes on its policy term whatever ``loss_agg_mode`` says (None: the config's)."""

    alias_of: Optional[str] = None
    """The row it is another name of (verl's ``vanilla`` is ``ppo_clip``)."""

    def __post_init__(self) -> None:
        if (self.reads == BATCH) != (self.selection is not None) or self.reads not in (TOKEN, SEQUENCE, BATCH):
            raise ValueError(f"objective {self.name!r}: reads={self.reads!r} needs a selection exactly when 'batch'")
        if not set(self.required) <= set(self.parameters) or not set(self.inputs) <= set(INPUTS):
            raise ValueError(f"objective {self.name!r}: required parameters / inputs outside its own")

    def check_bypass(self, bypass_mode: bool) -> None:
        """Raise ValueError when bypass mode is on and does not run this objective."""
        if bypass_mode and not self.bypass:
            raise ValueError(f"loss_type {self.name!r} with bypass_mode=True: bypass mode runs "
                             f"{', '.join(BYPASS_LOSS_TYPES)} only (verl's bypass_mode loss replaces loss_mode)")

    def old_from_rollout(self, bypass_mode: bool) -> bool:
        """The loss's old policy is the rollout engine's log-probs (bypass mode), not the trainer's recompute."""
        self.check_bypass(bypass_mode)
        return bypass_mode

    def applies_is_weights(self, bypass_mode: bool) -> bool:
        """The loss multiplies the correction's IS weights into its per-token loss in this mode."""
        self.check_bypass(bypass_mode)
        return self.bypass_is_weights if bypass_mode else True

    def loss_inputs(self, bypass_mode: bool, rollout_log_probs: torch.Tensor, old_log_probs: Optional[torch.Tensor],
                    is_weights: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The (old log-probs, IS weights) the loss uses: decoupled, the trainer's recomputed ``old_log_probs``
        (required) and the correction's weights pi_old / pi_rollout; bypass, ``rollout_log_probs`` and the weights
        only where ``applies_is_weights`` (reinforce: those of the current log-probs, ``correction.in_loss``)."""
        weighted = self.applies_is_weights(bypass_mode)
        if self.old_from_rollout(bypass_mode):
            return rollout_log_probs, (is_weights if weighted else None)
        if old_log_probs is None:
            raise ValueError("old_log_probs is None but bypass_mode=False: the decoupled loss needs the "
                             "trainer's recomputed log-probs (or set bypass_mode=True to use rollout_log_probs)")
        return old_log_probs, is_weights

    def parameter_errors(self, config: PolicyLossConfig) -> List[str]:
        """Problems of ``config`` for this objective: a parameter set (to a value other than its default) that it
        does not read, or a required parameter left unset. Messages name the dotted key."""
        errors = []
        defaults = {f.name: f.default for f in dataclasses.fields(PolicyLossConfig)}
        for p in PARAMETERS:
            value = getattr(config, p.name)
            if p not in self.parameters and value != defaults[p.name]:
                readers = [m for m in MODE_PARAMETERS[p.name] if OBJECTIVES[m].alias_of is None]
                errors.append(f"actor.policy_loss.{p.name}: set to {value!r} but loss_type {self.name!r} "
                              f"(algorithm.rollout_correction.loss_type) does not use it; it is read by "
                              f"{', '.join(readers)}")
        errors += [f"actor.policy_loss.{p.name}: required by loss_type {self.name!r} (no default)"
                   for p in self.required if getattr(config, p.name) is None]
        return errors

    def summary(self, bypass_mode: bool, config: PolicyLossConfig) -> str:
        """One line naming the objective, its mode and the parameters it reads (``megatron-rl check``)."""
        params = [f"{p.name}={getattr(config, p.name)!r}" for p in PARAMETERS if p in self.parameters]
        agg = f"{self.aggregation} ({self.name}'s own)" if self.aggregation else (
            f"{config.pg_loss_agg_mode} (policy term; KL / entropy: {config.loss_agg_mode})"
            if config.pg_loss_agg_mode and config.pg_loss_agg_mode != config.loss_agg_mode else config.loss_agg_mode)
        return (f"objective: {self.name} ({'bypass' if bypass_mode else 'decoupled'}; "
                f"{', '.join(params) if params else 'no objective parameters'}; loss_agg_mode={agg}"
                + (f"; kl_loss {config.kl_loss_type} x {config.kl_loss_coef}" if config.kl_loss_coef > 0 else "")
                + (f"; entropy bonus x {config.entropy_coeff}" if config.entropy_coeff != 0 else "") + ")")

    def select(self, config: PolicyLossConfig, old_log_probs: torch.Tensor,
               rollout_log_probs: Optional[torch.Tensor], advantages: torch.Tensor, response_mask: torch.Tensor,
               group=None) -> sel.Selected:
        """The training step's batch selection (collective over ``group``; without a selection: nothing to do,
        no communication) -> (token_select, response_mask, metrics), see ``selection.Selected``."""
        if self.selection is None:
            return None, response_mask, {}
        for p in self.required:
            if getattr(config, p.name) is None:
                raise ValueError(f"actor.policy_loss.{p.name} must be set ({p.rule}) with loss_type {self.name!r}")
        if "rollout_log_probs" in self.inputs and rollout_log_probs is None:
            raise ValueError(f"loss_type {self.name!r} needs the rollout engine's log-probs (its batch selection "
                             f"reads log pi_rollout - log pi_old); the batch has none")
        # the inputs may come from different places (host / device)
        return self.selection(config, old_log_probs, rollout_log_probs, advantages.to(old_log_probs.device),
                              response_mask, group)


_PPO = (CLIP_RATIO_LOW, CLIP_RATIO_HIGH, CLIP_RATIO_C)
_CLIP = (CLIP_RATIO_LOW, CLIP_RATIO_HIGH)
_VERL = "verl 0.9.1 core_algos.compute_policy_loss_"
_PPO_CLIP = Objective("ppo_clip", tok.vanilla, _VERL + "vanilla", parameters=_PPO, bypass=True)

_ROWS = (
    _PPO_CLIP,
    Objective("reinforce", tok.reinforce, _VERL + "reinforce (rollout correction)", bypass=True,
              bypass_is_weights=True),
    dataclasses.replace(_PPO_CLIP, name="vanilla", alias_of="ppo_clip"),
    Objective("gspo", seq.gspo, _VERL + "gspo", reads=SEQUENCE, parameters=_CLIP),
    Objective("geo_mean", seq.geo_mean, _VERL + "geo_mean", reads=SEQUENCE, parameters=_CLIP,
              aggregation="seq-mean-token-sum"),
    Objective("cispo", tok.cispo, _VERL + "cispo", parameters=_CLIP),
    Objective("sapo", tok.sapo, _VERL + "sapo", parameters=(TAU_POS, TAU_NEG), aggregation="seq-mean-token-mean"),
    Objective("dppo_tv", tok.dppo_tv, _VERL + "dppo_tv", parameters=_PPO),
    Objective("dppo_kl", tok.dppo_kl, _VERL + "dppo_kl", parameters=_PPO),
    Objective("gpg", tok.gpg, _VERL + "gpg"),
    Objective("clip_cov", tok.clip_cov, _VERL + "clip_cov", reads=BATCH,
              selection=sel.covariance_selection_of("clip_cov"),
              parameters=_CLIP + (CLIP_COV_RATIO, CLIP_COV_LB, CLIP_COV_UB, CLIP_COV_SEED)),
    Objective("kl_cov", tok.kl_cov, _VERL + "kl_cov", reads=BATCH, selection=sel.covariance_selection_of("kl_cov"),
              parameters=(KL_COV_RATIO, PPO_KL_COEF)),
    Objective("dro", tok.dro, _VERL + "dro", parameters=(DRO_BETA,), required=(DRO_BETA,)),
    Objective("opsm", seq.opsm, "slime utils/ppo_utils.compute_opsm_mask (--use-opsm)", reads=SEQUENCE,
              parameters=_PPO + (OPSM_DELTA,)),
    Objective("m2po", tok.vanilla, "AReaL trainer/ppo/actor._apply_m2po_masking (m2_threshold)", reads=BATCH,
              selection=sel.m2po_selection, parameters=_PPO + (M2_THRESHOLD,), required=(M2_THRESHOLD,),
              inputs=("rollout_log_probs",)),
)

OBJECTIVES: Dict[str, Objective] = {row.name: row for row in _ROWS}
"""loss type -> its row. ``m2po`` is PPO-clip on the response mask its batch selection shrank."""

LOSS_TYPES = tuple(OBJECTIVES)
"""Valid loss types (``algorithm.rollout_correction.loss_type``)."""

BYPASS_LOSS_TYPES = tuple(name for name, row in OBJECTIVES.items() if row.bypass)
"""Loss types bypass mode runs."""

MODE_PARAMETERS: Dict[str, Tuple[str, ...]] = {
    p.name: tuple(name for name, row in OBJECTIVES.items() if p in row.parameters) for p in PARAMETERS}
"""Which loss types read each objective parameter."""


def objective(loss_type: str) -> Objective:
    """The row of ``loss_type``; ValueError with the nearest name for an unknown one."""
    if loss_type == "bypass_mode":
        raise ValueError("loss_type: 'bypass_mode' is verl's loss mode for algorithm.rollout_correction."
                         "bypass_mode: true; set that and loss_type 'ppo_clip' or 'reinforce'")
    choice("loss_type", loss_type, LOSS_TYPES)
    return OBJECTIVES[loss_type]


def loss_type_for_loss_mode(loss_mode) -> str:
    """This project's loss type for verl's ``actor.policy_loss.loss_mode`` (the same name; ``vanilla`` is kept as
    an alias of ``ppo_clip``). Raises ValueError for unknown names (nearest name) and for ``bypass_mode`` (use
    ``algorithm.rollout_correction.bypass_mode: true``)."""
    if loss_mode == "bypass_mode":
        raise ValueError("actor.policy_loss.loss_mode: 'bypass_mode' is set by verl itself when "
                         "algorithm.rollout_correction.bypass_mode is true; set that (loss_type 'ppo_clip' or "
                         "'reinforce') instead of loss_mode")
    choice("actor.policy_loss.loss_mode", loss_mode, LOSS_TYPES)
    return str(loss_mode)


def mode_parameter_errors(loss_type: str, config: PolicyLossConfig) -> List[str]:
    """``Objective.parameter_errors`` of ``loss_type``'s row."""
    return objective(loss_type).parameter_errors(config)


def objective_summary(loss_type: str, bypass_mode: bool, config: PolicyLossConfig) -> str:
    """``Objective.summary`` of ``loss_type``'s row."""
    return objective(loss_type).summary(bypass_mode, config)


def batch_selection(loss_type: str, config: PolicyLossConfig, old_log_probs: torch.Tensor,
                    rollout_log_probs: Optional[torch.Tensor], advantages: torch.Tensor,
                    response_mask: torch.Tensor, group=None) -> sel.Selected:
    """``Objective.select`` of ``loss_type``'s row."""
    return objective(loss_type).select(config, old_log_probs, rollout_log_probs, advantages, response_mask, group)


def objectives_markdown() -> str:
    """The table of ``OBJECTIVES`` as markdown (docs/objectives.md holds it; a test keeps the two equal)."""
    lines = ["| loss_type | follows | reads | parameters (range) | bypass mode | IS weights in bypass | batch selection "
             "| own aggregation |", "|---|---|---|---|---|---|---|---|"]
    for row in OBJECTIVES.values():
        params = ", ".join(f"`{p.name}` {p.rule}" + (" (required)" if p in row.required else
                                                     f" (or {p.unset})" if p.unset else "")
                           for p in row.parameters) or "none"
        name = f"`{row.name}`" + (f" (= `{row.alias_of}`)" if row.alias_of else "")
        selection = f"`{row.selection.__name__}`" if row.selection else "-"
        lines.append(f"| {name} | {row.reference} | {row.reads}{' + ' + ', '.join(row.inputs) if row.inputs else ''} "
                     f"| {params} | {'yes' if row.bypass else 'no'} | "
                     f"{('yes' if row.bypass_is_weights else 'no') if row.bypass else '-'} | {selection} | "
                     f"{row.aggregation or '-'} |")
    return "\n".join(lines) + "\n"

"""What a term function takes and returns: ``ObjectiveInputs`` -> ``ObjectiveTerms`` (one micro-batch).

Every objective's term function (``objectives.py``, ``sequence.py``) has this signature; its row in
``registry.py`` says everything else about it. Inputs are sanitised: masked positions hold 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from .config import PolicyLossConfig


@dataclass
class ObjectiveInputs:
    """Sanitised inputs of one micro-batch (masked positions hold 0; see ``validation.sanitize``)."""

    log_probs: torch.Tensor
    """[B, T] log pi_theta (requires grad)."""
    old_log_probs: torch.Tensor
    """[B, T] log pi_old (rollout log-probs in bypass mode), detached."""
    advantages: torch.Tensor
    """[B, T] advantages, detached."""
    is_weights: Optional[torch.Tensor]
    """[B, T] IS weights (detached) or None."""
    valid: torch.Tensor
    """[B, T] bool: the response mask after rejection."""
    config: PolicyLossConfig
    """Objective parameters."""
    seq_valid_tokens: Optional[torch.Tensor] = None
    """[B] valid tokens of each whole sequence (context parallel); None = counted from ``valid``."""
    cp_group: object = None
    """Context-parallel group the sequences are split over (None: whole sequences here)."""
    token_select: Optional[torch.Tensor] = None
    """[B, T] tokens chosen by the batch selection (clip_cov / kl_cov); None = select from this batch."""


@dataclass
class ObjectiveTerms:
    """Per-token pieces of one objective (all [B, T]; only valid positions are read)."""

    loss: torch.Tensor
    """Per-token loss, IS weights included."""
    clipfrac: torch.Tensor
    """Indicator whose valid-token mean is ``pg_clipfrac``."""
    clipfrac_lower: torch.Tensor
    """Indicator whose valid-token mean is ``pg_clipfrac_lower``."""
    kl: torch.Tensor
    """Per-token value whose valid-token mean is ``ppo_kl`` (detached)."""
    extra: Dict[str, torch.Tensor] = field(default_factory=dict)
    """Further per-token metric indicators (valid-token means), e.g. ``opsm_clipfrac``."""

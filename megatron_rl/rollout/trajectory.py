"""The data model of a multi-turn rollout: ``Segment`` (one model turn or one environment reply, as exact token
ids) and ``Trajectory`` (a prompt and its segments, with reward, finish, routing and counts).

A trajectory's response is every segment's ids concatenated, never re-tokenized: the ids the model sampled and
the ids the environment's observation was encoded to once. Per response token it exposes what the trainer needs
(``StepBatch`` fields, then ``RolloutBatch.from_sequences``):

    traj = Trajectory(prompt_ids=[1, 2], segments=[
        Segment("model", ids=[5, 6], log_probs=[-0.1, -0.2], versions=[3, 3]),
        Segment("env", ids=[9, 9, 9]),                                   # tool response + next assistant header
        Segment("model", ids=[7], log_probs=[-0.3], versions=[4])])
    traj.response_ids        # [5, 6, 9, 9, 9, 7]
    traj.loss_mask           # [1, 1, 0, 0, 0, 1]      (1 model-sampled, 0 environment)
    traj.rollout_log_probs   # [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    traj.token_versions      # [3, 3, 3, 3, 3, 4]      (env tokens: the version of the model turn before them)

Environment tokens stay in the sequence the actor reads (the forward pass) but are masked out of the loss, the
rollout correction and every metric (``RolloutBatch.loss_mask``). A malformed segment (a model segment whose ids,
log-probs and versions differ in length; an environment segment carrying log-probs) raises ValueError naming
the field. Tests: ``pytest tests/integration/test_multi_turn_masks.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

__all__ = ["Segment", "Trajectory", "SEGMENT_KINDS", "FINISH_REASONS", "COUNT_KEYS"]

#: ``Segment.kind`` values: sampled by the model, or written by the environment.
SEGMENT_KINDS = ("model", "env")
#: ``Trajectory.finish`` values ("" while the trajectory is still open).
FINISH_REASONS = ("", "answer", "max_turns", "max_tokens", "length", "env_error")
#: The per-trajectory counters of ``Trajectory.counts``.
COUNT_KEYS = ("env_exception", "env_timeout", "env_garbage", "malformed_tool_call", "tool_calls",
              "truncated_observation")


@dataclass
class Segment:
    """One contiguous run of response tokens of a trajectory: a model turn or an environment reply."""

    kind: str
    """"model" (sampled by the policy: trained on) or "env" (written by the environment: read, never trained on)."""
    ids: List[int]
    """The exact token ids (model: as sampled; env: the observation encoded once, never re-tokenized)."""
    log_probs: List[float] = field(default_factory=list)
    """Model: the engine's log-prob of each id (same length as ``ids``); env: empty."""
    versions: List[int] = field(default_factory=list)
    """Model: the weight version (training steps done) that sampled each id (same length as ``ids``); env: empty."""
    finish_reason: str = ""
    """Model: the engine's finish reason of the turn ("stop", "length", ...); env: ""."""

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(f"Segment: {problem}")

    def problem(self) -> Optional[str]:
        """What is malformed (naming the field), or None."""
        if self.kind not in SEGMENT_KINDS:
            return f"kind must be one of {SEGMENT_KINDS}, got {self.kind!r}"
        n = len(self.ids)
        if self.kind == "model":
            if len(self.log_probs) != n or len(self.versions) != n:
                return (f"a model segment needs one log_probs and one versions entry per id: {n} ids, "
                        f"{len(self.log_probs)} log_probs, {len(self.versions)} versions")
        elif self.log_probs or self.versions:
            return (f"an env segment has no log_probs / versions (the environment sampled nothing), got "
                    f"{len(self.log_probs)} log_probs, {len(self.versions)} versions")
        return None


@dataclass
class Trajectory:
    """One multi-turn rollout of one prompt: the prompt ids and the response as model / env segments."""

    prompt_ids: List[int]
    """The prompt's token ids (chat template applied), as the first turn was generated from."""
    segments: List[Segment] = field(default_factory=list)
    """The response, in order: model turns and environment replies (``Segment``)."""
    reward: float = 0.0
    """The trajectory's reward (the environment's, on its final answer)."""
    turns: int = 0
    """Model turns taken."""
    finish: str = ""
    """Why it ended: "answer" (the environment said done) | "max_turns" | "max_tokens" (response budget) |
    "length" (the model's turn hit max_tokens_per_turn and ended the trajectory) | "env_error"; "" while open."""
    routing: Optional[torch.Tensor] = None
    """MoE routing ``[prompt + response - 1, moe_layers, topk]`` (every position, each model token with the
    routing it was sampled with), or None when the engine captured none."""
    counts: Dict[str, float] = field(default_factory=dict)
    """Per-trajectory counters (``COUNT_KEYS``: env_exception, env_timeout, env_garbage, malformed_tool_call,
    tool_calls, truncated_observation); absent keys are 0."""

    def __post_init__(self) -> None:
        for i, seg in enumerate(self.segments):
            if not isinstance(seg, Segment):
                raise ValueError(f"Trajectory.segments[{i}] must be a Segment, got {type(seg).__name__}")
            problem = seg.problem()  # a segment mutated after construction is caught here too
            if problem:
                raise ValueError(f"Trajectory.segments[{i}]: {problem}")
        if self.finish not in FINISH_REASONS:
            raise ValueError(f"Trajectory.finish must be one of {FINISH_REASONS}, got {self.finish!r}")

    @property
    def response_ids(self) -> List[int]:
        """Every segment's ids concatenated (the exact ids: never re-tokenized)."""
        return [t for seg in self.segments for t in seg.ids]

    @property
    def loss_mask(self) -> List[int]:
        """Per response token: 1 sampled by the model, 0 written by the environment."""
        return [1 if seg.kind == "model" else 0 for seg in self.segments for _ in seg.ids]

    @property
    def rollout_log_probs(self) -> List[float]:
        """Per response token: the engine's log-prob at model tokens, 0.0 at environment tokens."""
        return [float(x) for seg in self.segments
                for x in (seg.log_probs if seg.kind == "model" else [0.0] * len(seg.ids))]

    @property
    def token_versions(self) -> List[int]:
        """Per response token: the weight version that sampled it; an environment token gets the version of the
        last model token before it (of the first one after it when none precedes; 0 without model tokens)."""
        model = [v for seg in self.segments if seg.kind == "model" for v in seg.versions]
        last = model[0] if model else 0
        out: List[int] = []
        for seg in self.segments:
            if seg.kind == "model":
                out.extend(int(v) for v in seg.versions)
                if seg.versions:
                    last = int(seg.versions[-1])
            else:
                out.extend([last] * len(seg.ids))
        return out

    @property
    def num_model_tokens(self) -> int:
        """Response tokens sampled by the model."""
        return sum(len(seg.ids) for seg in self.segments if seg.kind == "model")

    @property
    def num_env_tokens(self) -> int:
        """Response tokens written by the environment."""
        return sum(len(seg.ids) for seg in self.segments if seg.kind == "env")

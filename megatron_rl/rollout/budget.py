"""How many response-side tokens a row of a job may hold: ``TurnLimits`` (a multi-turn trajectory's limits) and
``ResponseBudget`` (that number for any job, with the config key it comes from).

One owner for the budget that the multi-turn driver enforces, ``check`` plans memory for and the
``seq-mean-token-sum-norm`` loss divides by; a leaf module (no project imports), so the actor and the memory plan
can read it without importing the rollout machinery.
"""
from __future__ import annotations

from dataclasses import dataclass
__all__ = ["TurnLimits", "ResponseBudget"]


@dataclass(frozen=True)
class TurnLimits:
    """How long a trajectory may get (response side)."""

    max_turns: int
    """Model turns at most; the environment's reply to the last one is not appended (finish "max_turns")."""
    max_total_tokens: int
    """Response tokens at most, every segment (model and environment) counted (finish "max_tokens")."""
    max_tokens_per_turn: int
    """Tokens one model turn may sample (a turn cut there without a stop token: finish "length")."""

    def __post_init__(self):
        for name in ("max_turns", "max_total_tokens", "max_tokens_per_turn"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TurnLimits.{name}={v!r} must be an int >= 1")

    @classmethod
    def from_config(cls, multi_turn, max_new_tokens: int) -> "TurnLimits":
        """The limits of a ``multi_turn`` config section; its zeros mean ``max_new_tokens`` per turn and
        ``max_new_tokens * max_turns`` in all (``max_new_tokens``: ``rollout.max_new_tokens``)."""
        turns = int(multi_turn.max_turns)
        return cls(max_turns=turns,
                   max_total_tokens=int(multi_turn.max_total_tokens) or int(max_new_tokens) * turns,
                   max_tokens_per_turn=int(multi_turn.max_tokens_per_turn) or int(max_new_tokens))


@dataclass(frozen=True)
class ResponseBudget:
    """The most response-side tokens a row of a job holds, and the config key it comes from."""

    tokens: int
    """A multi-turn trajectory's ``max_total_tokens`` (model and environment segments), else
    ``rollout.max_new_tokens``."""
    key: str
    """``multi_turn.max_total_tokens`` or ``rollout.max_new_tokens``."""

    @classmethod
    def of(cls, rollout, multi_turn) -> "ResponseBudget":
        """The budget of a job's ``rollout`` and ``multi_turn`` sections (the job plan builds it, once)."""
        if multi_turn.env is None:
            return cls(int(rollout.max_new_tokens), "rollout.max_new_tokens")
        return cls(TurnLimits.from_config(multi_turn, rollout.max_new_tokens).max_total_tokens,
                   "multi_turn.max_total_tokens")


"""The ``reward:`` section's problems in the job plan: its own (``RewardConfig.errors``) and its combinations with
the rest of the job that are not built (each refused naming the key)."""
from __future__ import annotations

from typing import List

__all__ = ["reward_errors_of_job"]


def reward_errors_of_job(cfg) -> List[str]:
    """Every problem of ``cfg.reward`` (dotted keys)."""
    errs = list(cfg.reward.errors())
    j = cfg.reward.judge
    if j.enable and cfg.multi_turn.env is None and j.judge_sees != "final_answer":
        errs.append(f"reward.judge.judge_sees: {j.judge_sees!r} applies to multi-turn trajectories (multi_turn.env); "
                    "a single-turn response is its final answer: leave it at final_answer")
    return errs

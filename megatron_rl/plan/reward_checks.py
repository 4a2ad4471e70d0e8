"""The ``reward:`` section's problems in the job plan: its own (``RewardConfig.errors``) and its combinations with
the rest of the job that are not built (each refused naming the key)."""
from __future__ import annotations

from typing import List

__all__ = ["reward_errors_of_job"]


def reward_errors_of_job(cfg) -> List[str]:
    """Every problem of ``cfg.reward`` (dotted keys): a reward model is refused with multi-turn (the environment
    scores the episode); a judge or a reward model with validation files (scored by the rule reward only)."""
    errs = list(cfg.reward.errors())
    j = cfg.reward.judge
    if j.enable and cfg.multi_turn.env is None and j.judge_sees != "final_answer":
        errs.append(f"reward.judge.judge_sees: {j.judge_sees!r} applies to multi-turn trajectories (multi_turn.env); "
                    "a single-turn response is its final answer: leave it at final_answer")
    if j.enable and cfg.data.val_paths:
        errs.append("data.val_files: validation files are scored by the rule reward only, not by reward.judge; use "
                    "data.val_heldout (scored like training) or leave data.val_files unset")
    m = cfg.reward.model
    if m.enable and cfg.multi_turn.env is not None:
        errs.append("reward.model.enable: a reward model scores single-turn responses; multi-turn rewards come from "
                    "the environment (multi_turn.env)")
    if m.enable and cfg.data.val_paths:
        errs.append("data.val_files: validation files are scored by the rule reward only, not by reward.model; use "
                    "data.val_heldout (scored like training) or leave data.val_files unset")
    return errs

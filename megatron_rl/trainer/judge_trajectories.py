"""The LLM judge (``reward.judge``) over multi-turn trajectories: what it reads, and how its verdict joins the
environment's reward.

The environment's reward is the rule reward (``reward.judge.combine``); a trajectory whose environment failed
(``env_error``) is not judged and stays counted once. ``judge_sees``: ``final_answer`` is the last model turn
(up to its EOS), ``trajectory`` every response token (model turns and environment replies) decoded.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from megatron_rl.tasks.reward_pool import RewardResult

__all__ = ["judge_texts", "judge_trajectories"]


def judge_texts(trajs, tokenizer, decode, judge_sees: str) -> List[str]:
    """Per trajectory the text the judge reads as ``{response}``."""
    if judge_sees == "trajectory":
        return [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajs]
    out = []
    for t in trajs:
        model = [s for s in t.segments if s.kind == "model"]
        out.append(decode(list(model[-1].ids)) if model else "")
    return out


def judge_trajectories(task, prompt_rows: Sequence, trajs, tokenizer, decode,
                       metrics: Dict[str, float]) -> Tuple[List[float], Dict[str, float]]:
    """``(rewards, metrics)`` of a multi-turn step scored by ``task``'s judge (a ``JudgedTask``): the environment
    rewards combined with the judge's scores, and the step's metrics with the failure counts and ``reward/raw_mean``
    recomputed and the ``reward/judge_*`` added."""
    failed_env = [t.finish == "env_error" for t in trajs]
    rule = RewardResult(rewards=[float(t.reward) for t in trajs],
                        extras=[None if f else {} for f in failed_env],
                        failed=int(metrics.get("reward/failed", 0)), timed_out=int(metrics.get("reward/timed_out", 0)))
    texts = judge_texts(trajs, tokenizer, decode, task.cfg.judge_sees)
    res = task.score_texts(prompt_rows, texts, rule)
    out = dict(metrics)
    out.update({"reward/failed": float(res.failed), "reward/timed_out": float(res.timed_out),
                "reward/raw_mean": sum(res.rewards) / len(res.rewards) if res.rewards else 0.0, **res.metrics})
    return res.rewards, out

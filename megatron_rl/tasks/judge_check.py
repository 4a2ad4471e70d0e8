"""What ``megatron-rl check`` says about ``reward.judge``: the template rendered on one data row, and one request
to the endpoint. Rule: an endpoint that cannot be reached from here is a note (the job may run where it can), an
endpoint that answers without a score the parser finds is a problem naming ``reward.judge.parser``."""
from __future__ import annotations

import random
from typing import List, Tuple

from megatron_rl.tasks.judge import Judge, JudgeRow, question_text
from megatron_rl.tasks.judge_config import JudgeConfig

__all__ = ["judge_check"]


def judge_check(cfg: JudgeConfig, task, probe_timeout_s: float = 10.0) -> Tuple[List[str], List[str]]:
    """``(problems, lines)`` for the judge of a job whose task is ``task``: the first prompt (a data file's first
    row, else the task's first seeded sample) rendered with its reference answer as the response, and the
    endpoint's answer to it."""
    prompts = task.finite_prompts() or task.sample(1, random.Random(0))
    if not prompts:
        return ["reward.judge.prompt_template: the task has no prompt to render it on"], []
    p = prompts[0]
    row = JudgeRow(question_text(p), "" if p.answer is None else str(p.answer), p.answer)
    probe = JudgeConfig(**{**cfg.__dict__, "timeout_s": min(cfg.timeout_s, probe_timeout_s), "max_retries": 0})
    try:
        judge = Judge(probe)
    except ValueError as e:   # the key's variable unset here: the job fails at start with the same
        return [str(e)], []
    try:
        prompt = judge.render(row)
        lines = [f"judge: {len(cfg.urls)} endpoint(s), model {cfg.model!r}, parser {cfg.parser!r}, combine "
                 f"{cfg.combine!r}; the prompt on {p.row or 'the first prompt'} (its reference as the response): "
                 f"{prompt[:300]!r}"]
        got = judge.judge([row])
    finally:
        judge.close()
    f = got.failures[0]
    if f is None:
        return [], lines + [f"judge: {cfg.urls[0]} answered {got.answers[0][:120]!r} -> score {got.scores[0]:g} "
                            f"in {got.latencies[0]:.2f} s"]
    if f[0] in ("unreachable", "timeout"):
        return [], lines + [f"judge: note: {f[0]}: {f[1]} (not checked from here; the job fails if it stays so)"]
    if f[0] in ("no_score", "out_of_range"):
        return [f"reward.judge.parser: the judge's answer to the rendered prompt has no usable score ({f[1]}): "
                f"{got.answers[0][:200]!r}"], lines
    return [f"reward.judge.urls: {f[1]}"], lines

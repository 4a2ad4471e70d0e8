"""``RewardModelTask``: a task whose rewards come from a scalar reward model, alone or summed with the task's rule
reward (``reward.model``; the formula: ``megatron_rl.config.reward_section``).

Rule: a sample whose RM score (or, when it is summed in, whose rule reward) failed is scored 0.0 and counted in
``failed`` / ``timed_out``, the counts the reward-failure policy (``data.max_reward_failure_frac``) reads -- never a
silent 0. ``score`` adds the metrics ``reward/rm_latency_s``, ``reward/rm_failures``, ``reward/rm_batches`` and the
raw score distribution ``reward/rm_score_{mean,std,min,max}``; each scored sample's raw score is its extra
``rm_score``.
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence, Set

from megatron_rl.tasks.base import Prompt, Task, WrappedTask, response_text
from megatron_rl.tasks.reward_pool import RewardResult
from megatron_rl.tasks.rm_backends import LocalRM, RMError, SGLangRM
from megatron_rl.tasks.rm_render import render_rm_input, rm_tokenizer, token_batches


def build_rm_backend(rm):
    """The backend of a ``reward.model`` section (``rm``: its ``RewardModelConfig``)."""
    if rm.backend == "local":
        return LocalRM(rm.path)
    if rm.backend == "sglang":
        return SGLangRM(rm.urls, rm.timeout_s, rm.retries)
    raise ValueError(f"reward.model.backend={rm.backend!r} must be 'local' or 'sglang'")


def map_scores(raw: Dict[int, float], rm) -> Dict[int, float]:
    """``scale * norm(score) + offset`` per scored sample; ``normalize: batch`` z-scores over ``raw`` (population
    std; all-equal scores give 0)."""
    vals = dict(raw)
    if rm.normalize == "batch" and vals:
        mean = sum(vals.values()) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals.values()) / len(vals))
        vals = {i: (v - mean) / std if std > 0 else 0.0 for i, v in vals.items()}
    return {i: rm.scale * v + rm.offset for i, v in vals.items()}


def _distribution(raw: Sequence[float]) -> Dict[str, float]:
    if not raw:
        return {}
    mean = sum(raw) / len(raw)
    std = math.sqrt(sum((v - mean) ** 2 for v in raw) / len(raw))
    return {"reward/rm_score_mean": mean, "reward/rm_score_std": std, "reward/rm_score_min": min(raw),
            "reward/rm_score_max": max(raw)}


class RewardModelTask(WrappedTask):
    """``inner``'s prompts, scored by the reward model of ``rm`` (a ``RewardModelConfig``; ``backend``: its
    ``LocalRM`` / ``SGLangRM``, built from ``rm`` when None; ``batch_budget_s``: past it a ``score`` call starts no
    further batch, their samples are timeouts -- ``config.timeouts.judge_batch_budget_s``; None: no budget)."""

    def __init__(self, inner: Task, rm, backend=None, batch_budget_s=None):
        super().__init__(inner)
        self.rm = rm
        self.rm_tokenizer = rm_tokenizer(rm.path, rm.chat_template)
        self.backend = backend if backend is not None else build_rm_backend(rm)
        self.batch_budget_s = batch_budget_s

    # ---- rewards
    def rm_input(self, prompt: Prompt, response_ids: Sequence[int]) -> List[int]:
        """The RM's token ids of one response (decoded up to EOS with the policy's tokenizer, rendered with the
        RM's template)."""
        text, _ = response_text(self.tokenizer, response_ids)
        return render_rm_input(self.rm_tokenizer, prompt.text, prompt.messages, text)

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        """One response's reward (``score`` of one sample); ``ValueError`` with its error when it failed."""
        result = self.score([prompt], [response_ids])
        if result.failed or result.timed_out:
            raise ValueError(result.errors[0] if result.errors else "the reward model failed")
        return result.rewards[0]

    def score(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> RewardResult:
        """The step's rewards (module docstring); never raises for a sample's or a batch's failure."""
        if len(prompts) != len(responses):
            raise ValueError(f"task {self.name!r}: {len(prompts)} prompts but {len(responses)} responses")
        n, rm = len(prompts), self.rm
        rule = self.inner.score(prompts, responses) if rm.rule_weight else None
        t0 = time.monotonic()
        bad: Dict[int, tuple] = {}
        inputs: Dict[int, List[int]] = {}
        for i, (p, r) in enumerate(zip(prompts, responses)):
            try:
                inputs[i] = self.rm_input(p, r)
            except Exception as e:  # noqa: BLE001 - a sample the RM template rejects is counted, not raised
                bad[i] = (f"reward.model: the RM's chat template failed: {type(e).__name__}: {e}"
                          + (f" ({p.row})" if p.row else ""), False)
        order = sorted(inputs)
        raw: Dict[int, float] = {}
        batches = token_batches([len(inputs[i]) for i in order], rm.max_tokens_per_batch, rm.max_rows_per_batch)
        for b in batches:
            idx = [order[j] for j in b]
            if self.batch_budget_s is not None and time.monotonic() - t0 > self.batch_budget_s:
                for i in idx:
                    bad[i] = (f"reward.model: not scored: the step's budget of {self.batch_budget_s:g} s for the RM "
                              "(half of trainer.phase_timeout_s) was spent", True)
                continue
            try:
                scores = self.backend.scores([inputs[i] for i in idx])
                if len(scores) != len(idx) or not all(math.isfinite(s) for s in scores):
                    raise RMError(f"reward.model: the backend returned {scores!r} for {len(idx)} samples")
                raw.update(zip(idx, scores))
            except RMError as e:
                for i in idx:
                    bad[i] = (str(e), e.timed_out)
            except Exception as e:  # noqa: BLE001 - a batch the backend could not score is counted, not raised
                for i in idx:
                    bad[i] = (f"reward.model: {type(e).__name__}: {e}", False)
        latency = time.monotonic() - t0
        mapped = map_scores(raw, rm)
        rule_bad: Optional[Set[int]] = None
        if rule is not None and len(rule.extras) == n:
            rule_bad = {i for i, e in enumerate(rule.extras) if e is None}
        result = RewardResult(rewards=[0.0] * n, extras=[None] * n)
        for i in range(n):
            if i in bad:
                msg, timed_out = bad[i]
                result.timed_out += int(timed_out)
                result.failed += int(not timed_out)
                if len(result.errors) < 5:
                    result.errors.append(f"sample {i}: {msg}")
                continue
            if rule_bad is not None and i in rule_bad:
                continue   # counted by the rule's result below
            rule_part = rm.rule_weight * rule.rewards[i] if rule is not None else 0.0
            result.rewards[i] = rule_part + rm.weight * mapped[i]
            extra = dict(rule.extras[i] or {}) if rule is not None and rule_bad is not None else {}
            extra["rm_score"] = raw[i]
            result.extras[i] = extra
        if rule is not None:
            both = len(rule_bad & set(bad)) if rule_bad is not None else 0
            result.failed += rule.failed
            result.timed_out += rule.timed_out
            result.failed -= min(both, result.failed)   # a sample failing both is counted once
            result.errors += rule.errors[:max(0, 5 - len(result.errors))]
        result.metrics = {"reward/rm_latency_s": latency, "reward/rm_failures": float(len(bad)),
                          "reward/rm_batches": float(len(batches)), **_distribution(list(raw.values()))}
        return result

"""The LLM judge reward: render the prompt, ask the endpoint, parse the score, combine with the rule reward.

``Judge(cfg).judge(rows)`` scores ``JudgeRow(question, response, ground_truth)`` items in one bounded-concurrency
batch (``judge_client.EndpointClient``) and returns a ``JudgeBatch``: per row a score or a named failure
(``timeout``, ``unreachable``, ``http``, ``garbage``, ``no_score``, ``out_of_range``), the latencies and raw
answers. ``JudgedTask`` puts it in front of a task's rule reward. Rule: a failed judge call is a failed reward
(counted in ``reward/failed`` / ``reward/timed_out`` under ``data.max_reward_failure_frac``), never a 0 score.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from megatron_rl.tasks.base import Prompt, Task, WrappedTask, response_text
from megatron_rl.tasks.judge_client import CallResult, EndpointClient
from megatron_rl.tasks.judge_config import JudgeConfig
from megatron_rl.tasks.reward_pool import RewardResult
from megatron_rl.tasks.rewards import extract_answer

__all__ = ["JudgeRow", "JudgeBatch", "Judge", "JudgedTask", "JudgeParseError", "render_prompt", "parse_score",
           "judge_payload", "answer_text", "question_text"]

_PLACEHOLDER = re.compile(r"\{(question|response|ground_truth)\}")


class JudgeParseError(ValueError):
    """The judge's answer has no score where the parser looks, or one the score mapping refuses."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def render_prompt(template: str, question: str, response: str, ground_truth: Any) -> str:
    """``template`` with its placeholders replaced in one pass (a response that contains ``{question}`` stays as it
    is); other braces are text."""
    values = {"question": str(question), "response": str(response),
              "ground_truth": "" if ground_truth is None else str(ground_truth)}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def _content(content: Any) -> str:
    if isinstance(content, list):   # content parts: their text
        return "".join(str(c.get("text", "")) if isinstance(c, dict) else str(c) for c in content)
    return "" if content is None else str(content)


def question_text(prompt: Prompt) -> str:
    """``{question}`` of ``prompt``: a chat row's messages without the policy's template (one user message: its
    content; several: ``role: content`` paragraphs), else the prompt text."""
    if not prompt.messages:
        return prompt.text
    if len(prompt.messages) == 1:
        return _content(prompt.messages[0].get("content"))
    return "\n\n".join(f"{m.get('role', '')}: {_content(m.get('content'))}" for m in prompt.messages)


def _last_json_value(text: str, key: str) -> Any:
    dec = json.JSONDecoder()
    found, i = None, text.find("{")
    while i >= 0:
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict) and key in obj:
            found = (obj[key],)
        i = text.find("{", end)
    if found is None:
        raise JudgeParseError("no_score", f"no JSON object with key {key!r} in the judge's answer")
    return found[0]


def parse_answer(parser: str, text: str) -> str:
    """The raw score text of the judge's answer ``text`` by ``parser`` (``JudgeParseError`` ``no_score`` when
    absent)."""
    if parser == "boxed":
        found = extract_answer(text, ("boxed",))
        if found is None:
            raise JudgeParseError("no_score", "no \\boxed{...} in the judge's answer")
        return found
    kind, _, name = parser.partition(":")
    if kind == "tag":
        hits = re.findall(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>", text, flags=re.S)
        if not hits or not hits[-1].strip():
            raise JudgeParseError("no_score", f"no <{name}>...</{name}> in the judge's answer")
        return hits[-1].strip()
    if kind == "json":
        return str(_last_json_value(text, name)).strip()
    raise ValueError(f"reward.judge.parser: {parser!r} is not 'boxed', 'tag:<name>' or 'json:<key>'")


def parse_score(cfg: JudgeConfig, text: str) -> float:
    """The judge's score in ``text``: parsed (``cfg.parser``), mapped (``score_map`` or a number), range-checked
    and normalized; ``JudgeParseError`` (``no_score`` / ``out_of_range``) otherwise."""
    raw = parse_answer(cfg.parser, text)
    if cfg.score_map:
        table = {str(k).strip().lower(): float(v) for k, v in cfg.score_map.items()}
        if raw.strip().lower() not in table:
            raise JudgeParseError("no_score", f"judge answer {raw[:40]!r} is not a key of reward.judge.score_map "
                                              f"({sorted(table)})")
        score = table[raw.strip().lower()]
    else:
        try:
            score = float(raw)
        except ValueError:
            raise JudgeParseError("no_score", f"judge answer {raw[:40]!r} is not a number") from None
        if not math.isfinite(score):
            raise JudgeParseError("no_score", f"judge answer {raw[:40]!r} is not a finite number")
    if cfg.score_range is not None:
        lo, hi = float(cfg.score_range[0]), float(cfg.score_range[1])
        if not lo <= score <= hi:
            raise JudgeParseError("out_of_range", f"judge score {score:g} is outside reward.judge.score_range "
                                                  f"[{lo:g}, {hi:g}]")
        if cfg.normalize:
            score = (score - lo) / (hi - lo)
    return score


def judge_payload(cfg: JudgeConfig, prompt: str) -> Dict[str, Any]:
    """The request body for the rendered ``prompt`` (OpenAI chat or completions format)."""
    body: Dict[str, Any] = {"model": cfg.model, "temperature": cfg.temperature, "top_p": cfg.top_p,
                            "max_tokens": cfg.max_tokens, **cfg.sampling_kwargs}
    if cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def answer_text(body: Any) -> str:
    """The generated text of an OpenAI-format reply (``choices[0].message.content`` or ``choices[0].text``);
    ``JudgeParseError`` ``garbage`` for any other body."""
    try:
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
    except (KeyError, IndexError, TypeError):
        raise JudgeParseError("garbage", f"the reply is not an OpenAI completion: {str(body)[:200]}") from None
    if not isinstance(text, str):
        raise JudgeParseError("garbage", f"the reply's text is {type(text).__name__}, not a string")
    return text


@dataclass(frozen=True)
class JudgeRow:
    """What the judge reads of one sample."""

    #: The prompt as text (``{question}``).
    question: str
    #: The response as text (``{response}``).
    response: str
    #: The reference answer (``{ground_truth}``).
    ground_truth: Any = None


@dataclass
class JudgeBatch:
    """The judge's verdicts on a batch, in row order."""

    #: Per row the score, or None when the call or the parse failed.
    scores: List[Optional[float]]
    #: Per row None, or ``(kind, message)`` of its failure.
    failures: List[Optional[tuple]]
    #: Per row the judge's raw answer text ("" when there was none).
    answers: List[str]
    #: Per row the wall-clock seconds of its request (retries included).
    latencies: List[float]
    #: The rendered prompts.
    prompts: List[str] = field(default_factory=list)

    def metrics(self) -> Dict[str, float]:
        """``reward/judge_*``: latency mean / max, failures (and by kind), score mean / min / max / std over the
        judged rows."""
        n = len(self.scores)
        ok = [s for s in self.scores if s is not None]
        m = {"reward/judge_latency_s": sum(self.latencies) / n if n else 0.0,
             "reward/judge_latency_max_s": max(self.latencies, default=0.0),
             "reward/judge_failures": float(sum(f is not None for f in self.failures))}
        for f in self.failures:
            if f is not None:
                m[f"reward/judge_failures_{f[0]}"] = m.get(f"reward/judge_failures_{f[0]}", 0.0) + 1.0
        if ok:
            mean = sum(ok) / len(ok)
            m.update({"reward/judge_score_mean": mean, "reward/judge_score_min": min(ok),
                      "reward/judge_score_max": max(ok),
                      "reward/judge_score_std": math.sqrt(sum((s - mean) ** 2 for s in ok) / len(ok))})
        return m


class Judge:
    """A judge endpoint and its prompt / parser (module docstring)."""

    def __init__(self, cfg: JudgeConfig, client: Optional[EndpointClient] = None,
                 batch_budget_s: Optional[float] = None):
        """``batch_budget_s``: the most one ``judge`` call may take (None: the client's own bound)."""
        errs = cfg.errors() if cfg.enable else ["reward.judge.enable: false"]
        if errs:
            raise ValueError("; ".join(errs))
        self.cfg = cfg
        headers = {}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ValueError(f"reward.judge.api_key_env: the environment variable {cfg.api_key_env!r} is not set")
            headers["Authorization"] = f"Bearer {key}"
        self.client = client or EndpointClient(cfg.urls, timeout_s=cfg.timeout_s, max_retries=cfg.max_retries,
                                               max_concurrent=cfg.max_concurrent, where="reward.judge",
                                               headers=headers)
        self.path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
        self.batch_budget_s = batch_budget_s

    def render(self, row: JudgeRow) -> str:
        """The judge's prompt for ``row``."""
        return render_prompt(self.cfg.prompt_template, row.question, row.response, row.ground_truth)

    def judge(self, rows: Sequence[JudgeRow]) -> JudgeBatch:
        """Score ``rows`` (one request each, ``max_concurrent`` in flight); never raises for a row's failure."""
        prompts = [self.render(r) for r in rows]
        payloads = [judge_payload(self.cfg, p) for p in prompts]
        calls: List[CallResult] = (self.client.post_many(self.path, payloads) if self.batch_budget_s is None else
                                   self.client.post_many(self.path, payloads, bound_s=self.batch_budget_s))
        out = JudgeBatch(scores=[None] * len(rows), failures=[None] * len(rows), answers=[""] * len(rows),
                         latencies=[c.latency_s for c in calls], prompts=prompts)
        for i, c in enumerate(calls):
            if not c.ok:
                out.failures[i] = (c.error_kind, c.error)
                continue
            try:
                out.answers[i] = answer_text(c.body)
                out.scores[i] = parse_score(self.cfg, out.answers[i])
            except JudgeParseError as e:
                out.failures[i] = (e.kind, str(e))
        return out

    def close(self) -> None:
        """Close the client's connections."""
        self.client.close()


def combine(cfg: JudgeConfig, rule: float, judge: float) -> float:
    """The reward of one sample from its rule reward and judge score (``reward.judge.combine``)."""
    if cfg.combine == "judge":
        return judge
    if cfg.combine == "rule_and_judge":
        return min(rule, judge)
    return cfg.rule_weight * rule + cfg.judge_weight * judge


class JudgedTask(WrappedTask):
    """A task whose ``score`` asks the judge (combined with the inner task's rule reward by
    ``reward.judge.combine``); prompts and everything else are the inner task's. ``samples_path``: the JSONL file
    the raw answers are sampled into (None: not written); ``batch_budget_s``: the most one ``score`` call waits for
    the judge (``config.timeouts.judge_batch_budget_s``; None: the client's own bound)."""

    def __init__(self, inner: Task, cfg: JudgeConfig, samples_path: Optional[str] = None,
                 judge: Optional[Judge] = None, batch_budget_s: Optional[float] = None):
        super().__init__(inner)
        self.cfg, self.samples_path = cfg, samples_path
        self.judge = judge or Judge(cfg, batch_budget_s=batch_budget_s)
        self.calls = 0
        self.step: Optional[int] = None   # the 0-based training step being scored (begin_step), for the samples

    def begin_step(self, step: int) -> None:
        self.step = step
        super().begin_step(step)

    def reward(self, prompt: Prompt, response_ids: Sequence[int]) -> float:
        """One sample through ``score`` (a failed judge call raises: there is no silent 0)."""
        res = self.score([prompt], [response_ids])
        if res.failed or res.timed_out:
            raise RuntimeError(f"reward.judge: {res.errors[0] if res.errors else 'failed'}")
        return res.rewards[0]

    def score(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> RewardResult:
        """The rule reward (when ``combine`` uses it) and the judge's score of each sample, combined."""
        if len(prompts) != len(responses):
            raise ValueError(f"task {self.name!r}: {len(prompts)} prompts but {len(responses)} responses")
        texts = [response_text(self.tokenizer, r)[0] for r in responses]
        rule = self.inner.score(prompts, responses) if self.cfg.combine != "judge" else None
        return self.score_texts(prompts, texts, rule)

    def score_texts(self, prompts: Sequence[Prompt], texts: Sequence[str],
                    rule: Optional[RewardResult] = None) -> RewardResult:
        """``score`` for responses given as text (multi-turn: what ``judge_sees`` picked), ``rule`` the rule rewards
        (None: ``combine`` is "judge")."""
        batch = self.judge.judge([JudgeRow(question_text(p), t, p.answer) for p, t in zip(prompts, texts)])
        self.calls += 1
        n = len(prompts)
        result = RewardResult(rewards=[0.0] * n, extras=[None] * n)
        if rule is not None:
            result.failed, result.timed_out, result.errors = rule.failed, rule.timed_out, list(rule.errors)
        rule_failed = _rule_failures(rule, n)
        for i in range(n):
            f = batch.failures[i]
            if f is not None:
                if not rule_failed[i]:   # a sample whose rule reward already failed is counted once
                    if f[0] == "timeout":
                        result.timed_out += 1
                    else:
                        result.failed += 1
                    if len(result.errors) < 5:
                        result.errors.append(f"sample {i}: judge {f[0]}: {f[1]}")
                continue
            if rule_failed[i]:
                continue
            result.rewards[i] = combine(self.cfg, rule.rewards[i] if rule is not None else 0.0, batch.scores[i])
            extras = dict(rule.extras[i] or {}) if rule is not None and i < len(rule.extras) else {}
            result.extras[i] = {**extras, "judge_score": batch.scores[i]}
        result.metrics = batch.metrics()
        self._write_samples(prompts, texts, batch)
        return result

    def _write_samples(self, prompts, texts, batch: JudgeBatch) -> None:
        """Append up to ``raw_samples_per_step`` raw answers (failures first) to ``samples_path``."""
        k = self.cfg.raw_samples_per_step
        if not self.samples_path or k <= 0 or not texts:
            return
        order = sorted(range(len(texts)), key=lambda i: batch.failures[i] is None)[:k]
        with open(self.samples_path, "a") as fh:
            for i in order:
                f = batch.failures[i]
                fh.write(json.dumps({"step": None if self.step is None else self.step + 1, "call": self.calls,
                                     "time": time.time(), "row": prompts[i].row,
                                     "judge_prompt": batch.prompts[i], "judge_answer": batch.answers[i],
                                     "score": batch.scores[i], "failure": None if f is None else f[0],
                                     "error": None if f is None else f[1],
                                     "latency_s": round(batch.latencies[i], 4)}) + "\n")

    def close(self) -> None:
        """Close the judge's connections and the inner task's reward workers."""
        self.judge.close()
        super().close()


def _rule_failures(rule: Optional[RewardResult], n: int) -> List[bool]:
    """Per sample: whether its rule reward failed (extras None where the task reports extras; otherwise unknown:
    all False)."""
    if rule is None or not (rule.failed or rule.timed_out):
        return [False] * n
    if len(rule.extras) == n:
        return [e is None for e in rule.extras]
    return [False] * n

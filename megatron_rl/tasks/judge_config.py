"""``reward.judge``: an LLM judge behind an OpenAI-compatible endpoint (SGLang or any other) as the reward.

The section validates itself (``errors()``, each line naming its dotted key); ``megatron_rl/tasks/judge.py`` builds
the judge from it. Rule: ``{question}``, ``{response}`` and ``{ground_truth}`` are the only placeholders of the
template; every other brace (``\\boxed{}`` in an instruction) is text. The whole story: docs/reward_models.md.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["JudgeConfig", "PLACEHOLDERS", "COMBINES", "JUDGE_SEES", "APIS", "DEFAULT_TEMPLATE", "parser_errors"]

#: The placeholders of ``reward.judge.prompt_template``.
PLACEHOLDERS = ("question", "response", "ground_truth")
#: How the judge's score makes the reward: the judge alone; min(rule, judge) (AND for 0 / 1 scores);
#: rule_weight * rule + judge_weight * judge.
COMBINES = ("judge", "rule_and_judge", "weighted_sum")
#: What the judge reads of a multi-turn trajectory: the last model turn, or every turn (environment text too).
JUDGE_SEES = ("final_answer", "trajectory")
#: The endpoint's API: ``/v1/chat/completions`` (the prompt as one user message) or ``/v1/completions`` (raw text).
APIS = ("chat", "completions")

DEFAULT_TEMPLATE = ("You are grading an answer.\nQuestion: {question}\nReference answer: {ground_truth}\n"
                    "Answer to grade: {response}\nIs the answer correct? Reply with \\boxed{1} if it is, "
                    "\\boxed{0} if it is not.")


def parser_errors(parser: str, key: str = "reward.judge.parser") -> List[str]:
    """Why ``parser`` is not ``boxed`` / ``tag:<name>`` / ``json:<key>`` (empty when it is)."""
    if parser == "boxed" or re.fullmatch(r"tag:[A-Za-z_][\w.-]*", parser or "") or \
            re.fullmatch(r"json:\S+", parser or ""):
        return []
    return [f"{key}: {parser!r} is not 'boxed', 'tag:<name>' or 'json:<key>'"]


@dataclass
class JudgeConfig:
    """``reward.judge``: the judge model, its endpoint, prompt, answer parser and score mapping."""

    enable: bool = False
    """Score responses with the judge (off: the rule reward alone, ``data.reward_fn``)."""
    urls: List[str] = field(default_factory=list)
    """The judge servers' base URLs (``http://host:port``), taken round-robin; a retry goes to the next one."""
    model: str = "default"
    """The ``model`` field of each request (the served model's name; SGLang serves any name it was given)."""
    api: str = "chat"
    """"chat" (``/v1/chat/completions``, the rendered prompt as one user message, the server's chat template) or
    "completions" (``/v1/completions``, the rendered prompt as raw text)."""
    api_key_env: Optional[str] = None
    """Name of the environment variable holding the endpoint's API key (sent as ``Authorization: Bearer``)."""
    prompt_template: str = DEFAULT_TEMPLATE
    """The judge's prompt; ``{question}`` (the prompt; a chat row's messages as text), ``{response}``,
    ``{ground_truth}`` are replaced."""
    parser: str = "boxed"
    """Where the score is in the judge's answer: "boxed" (the last ``\\boxed{...}``), "tag:<name>" (the last
    ``<name>...</name>``) or "json:<key>" (the key of the last JSON object); an answer without it is a failed
    reward (kind ``no_score``), never a 0."""
    score_map: Dict[str, float] = field(default_factory=dict)
    """Parsed answer (lower-cased, stripped) -> score, e.g. {yes: 1, no: 0}; empty: the answer must be a number.
    An answer outside the map is a failed reward."""
    score_range: Optional[List[float]] = None
    """[lo, hi]: a score outside is a failed reward (kind ``out_of_range``); null: any finite number."""
    normalize: bool = False
    """Map the score from ``score_range`` onto [0, 1]: (score - lo) / (hi - lo)."""
    temperature: float = 0.0
    """Sampling temperature of the judge (0: greedy, reproducible)."""
    top_p: float = 1.0
    """Top-p of the judge's sampling."""
    max_tokens: int = 256
    """Tokens the judge may write per answer."""
    sampling_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Other fields of each request (e.g. {seed: 0, stop: ["\\n\\n"]})."""
    max_concurrent: int = 8
    """Requests in flight at most (over all URLs)."""
    timeout_s: float = 60.0
    """Limit of one request attempt's connect and of each read (past it the attempt is a timeout); a server that
    trickles bytes is cut by the round's bound (half of ``trainer.phase_timeout_s``)."""
    max_retries: int = 2
    """Retries of a failed request (each on the next URL)."""
    combine: str = "judge"
    """"judge" (the judge's score is the reward), "rule_and_judge" (min of the rule reward, ``data.reward_fn`` or
    the task's, and the judge's: AND for 0 / 1 scores) or "weighted_sum" (rule_weight * rule + judge_weight *
    judge)."""
    rule_weight: float = 1.0
    """The rule reward's weight under combine: weighted_sum."""
    judge_weight: float = 1.0
    """The judge score's weight under combine: weighted_sum."""
    judge_sees: str = "final_answer"
    """Multi-turn: what ``{response}`` holds: "final_answer" (the last model turn) or "trajectory" (all turns,
    environment replies included)."""
    raw_samples_per_step: int = 4
    """The judge's raw answers written per step to ``run_dir/judge_samples.jsonl`` (failures first; 0: none)."""

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "JudgeConfig":
        """The section from its YAML mapping (keys already checked by the loader)."""
        return cls(**dict(d or {}))

    def errors(self) -> List[str]:
        """Violations, each naming its ``reward.judge.*`` key."""
        k, errs = "reward.judge", []
        if not self.enable:
            return errs
        if not self.urls:
            errs.append(f"{k}.urls: reward.judge.enable is true but no judge URL is given")
        for u in self.urls:
            if not re.match(r"https?://[^/\s]+", str(u)):
                errs.append(f"{k}.urls: {u!r} is not an http(s)://host:port URL")
        if self.api not in APIS:
            errs.append(f"{k}.api: {self.api!r} is not one of {', '.join(APIS)}")
        names = set(re.findall(r"\{(\w+)\}", self.prompt_template))
        if not names & {"response"}:
            errs.append(f"{k}.prompt_template: has no {{response}} placeholder (the judge would not see the answer)")
        errs += parser_errors(self.parser, f"{k}.parser")
        if self.score_range is not None:
            if len(self.score_range) != 2 or not self.score_range[0] < self.score_range[1]:
                errs.append(f"{k}.score_range: {self.score_range!r} must be [lo, hi] with lo < hi")
        if self.normalize and self.score_range is None:
            errs.append(f"{k}.normalize: needs reward.judge.score_range (the range mapped onto [0, 1])")
        if self.temperature < 0:
            errs.append(f"{k}.temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            errs.append(f"{k}.top_p: must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            errs.append(f"{k}.max_tokens: must be >= 1, got {self.max_tokens}")
        if self.max_concurrent < 1:
            errs.append(f"{k}.max_concurrent: must be >= 1, got {self.max_concurrent}")
        if not self.timeout_s > 0:
            errs.append(f"{k}.timeout_s: must be > 0, got {self.timeout_s}")
        if self.max_retries < 0:
            errs.append(f"{k}.max_retries: must be >= 0, got {self.max_retries}")
        if self.combine not in COMBINES:
            errs.append(f"{k}.combine: {self.combine!r} is not one of {', '.join(COMBINES)}")
        if self.judge_sees not in JUDGE_SEES:
            errs.append(f"{k}.judge_sees: {self.judge_sees!r} is not one of {', '.join(JUDGE_SEES)}")
        if self.raw_samples_per_step < 0:
            errs.append(f"{k}.raw_samples_per_step: must be >= 0, got {self.raw_samples_per_step}")
        clash = sorted(set(self.sampling_kwargs) & {"model", "messages", "prompt", "temperature", "top_p",
                                                     "max_tokens"})
        if clash:
            errs.append(f"{k}.sampling_kwargs: {clash} have their own keys (reward.judge.<key>)")
        return errs

"""The ``reward:`` config section and its ``reward.model`` part: a scalar reward model (an HF
``*ForSequenceClassification`` checkpoint) scoring each response, alone or summed with the rule reward.

Rule: the reward a sample trains on is ``rule_weight * rule reward + weight * (scale * norm(rm score) + offset)``
(``norm``: identity, or the z-score over the step's scored samples with ``normalize: batch``); every setting of
that sum is said in ``describe()``. Details: docs/reward_models.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional

from megatron_rl.config.paths import HUB, path_field
from megatron_rl.tasks.judge_config import JudgeConfig

#: Where the reward model runs: "local" (HF forward on CPU in rank 0's process) or "sglang" (SGLang servers
#: started with ``--is-embedding``, their ``/classify`` endpoint).
RM_BACKENDS = ("local", "sglang")
#: Score normalisations: "none" (the RM's score as it is) or "batch" (z-score over the step's scored samples).
RM_NORMALIZE = ("none", "batch")


@dataclass
class RewardModelConfig:
    """A scalar reward model (verl's ``reward_model`` block; docs/reward_models.md)."""

    enable: bool = False
    """Score responses with the reward model (verl's ``reward_model.enable``)."""
    path: Optional[str] = path_field(None, kind=HUB)
    """The RM's HF directory: a ``*ForSequenceClassification`` with ``num_labels: 1`` and its tokenizer, whose chat
    template renders (prompt, response) for the RM (verl's ``reward_model.model.path``)."""
    backend: str = "local"
    """"local": the RM runs on CPU in rank 0's process (tiny models, tests); "sglang": SGLang servers started with
    ``--is-embedding`` serve it (``reward.model.urls``)."""
    urls: List[str] = field(default_factory=list)
    """Base URLs of the SGLang RM servers (``http://host:port``), used round-robin, one batch per request."""
    chat_template: Optional[str] = None
    """A Jinja chat template replacing the RM tokenizer's own (null: the RM tokenizer's ``chat_template``)."""
    max_tokens_per_batch: int = 8192
    """Batching by tokens: a batch (one forward / one request) holds at most this many tokens (a longer single
    sample goes alone)."""
    max_rows_per_batch: int = 64
    """And at most this many samples (verl's ``reward_model.micro_batch_size_per_gpu``)."""
    timeout_s: float = 60.0
    """Wall-clock limit of one request to a server (backend sglang)."""
    retries: int = 2
    """Further tries of a failed request (the next server in ``urls``); then the batch's samples fail (counted)."""
    weight: float = 1.0
    """Weight of the mapped RM score in the reward."""
    rule_weight: float = 0.0
    """Weight of the rule reward (data.reward_fn / the task's own) in the reward; 0: the RM alone (the rule is not
    computed)."""
    scale: float = 1.0
    """The mapped score is ``scale * norm(score) + offset``."""
    offset: float = 0.0
    """See ``scale``."""
    normalize: str = "none"
    """"none" or "batch": the z-score of the RM scores over the step's successfully scored samples."""

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "RewardModelConfig":
        """The section from its checked keys (the loader has checked names and types)."""
        return cls(**dict(d or {}))

    def errors(self) -> List[str]:
        """Violations, each naming its ``reward.model.*`` key."""
        errs: List[str] = []
        if not self.enable:
            return errs
        if not self.path:
            errs.append("reward.model.path: the reward model's HF directory is required with reward.model.enable")
        if self.backend not in RM_BACKENDS:
            errs.append(f"reward.model.backend: must be one of {list(RM_BACKENDS)}, got {self.backend!r}")
        if self.backend == "sglang":
            if not self.urls:
                errs.append("reward.model.urls: backend 'sglang' needs at least one server URL (an SGLang server "
                            "started with --is-embedding on the RM; docs/reward_models.md)")
            bad = [u for u in self.urls if not str(u).startswith(("http://", "https://"))]
            if bad:
                errs.append(f"reward.model.urls: {bad[0]!r} is not an http(s):// URL")
        elif self.urls:
            errs.append(f"reward.model.urls: set, but reward.model.backend is {self.backend!r} (the URLs are "
                        "used by backend 'sglang' only)")
        for key in ("max_tokens_per_batch", "max_rows_per_batch"):
            if getattr(self, key) < 1:
                errs.append(f"reward.model.{key}: must be >= 1, got {getattr(self, key)}")
        if not self.timeout_s > 0:
            errs.append(f"reward.model.timeout_s: must be > 0, got {self.timeout_s}")
        if self.retries < 0:
            errs.append(f"reward.model.retries: must be >= 0, got {self.retries}")
        if self.normalize not in RM_NORMALIZE:
            errs.append(f"reward.model.normalize: must be one of {list(RM_NORMALIZE)}, got {self.normalize!r}")
        if self.weight == 0:
            errs.append("reward.model.weight: 0 would ignore the enabled reward model; disable it "
                        "(reward.model.enable: false) instead")
        if self.rule_weight < 0 or self.weight < 0:
            errs.append("reward.model.weight / rule_weight: must be >= 0 (flip the RM's sign with "
                        "reward.model.scale)")
        return errs

    def describe(self) -> str:
        """The reward formula this section makes, for the job's start-up report and ``check``."""
        norm = "zscore_batch(rm)" if self.normalize == "batch" else "rm"
        rm = f"{self.weight:g} * ({self.scale:g} * {norm} + {self.offset:g})"
        rule = f"{self.rule_weight:g} * rule + " if self.rule_weight else ""
        where = "on CPU in rank 0's process" if self.backend == "local" else f"by {len(self.urls)} SGLang server(s)"
        return f"reward = {rule}{rm}, rm: {self.path} served {where}"


@dataclass
class RewardConfig:
    """``reward:``: rewards computed by models (the rule rewards are ``data.reward_fn``)."""

    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """An LLM judge behind an OpenAI-compatible endpoint (``reward.judge.*``)."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A scalar reward model (``reward.model.*``)."""

    def errors(self) -> List[str]:
        """The subsections' violations, and the pair not built together."""
        errs = self.judge.errors() + self.model.errors()
        if self.judge.enable and self.model.enable:
            errs.append("reward.model.enable: a reward model and a judge (reward.judge.enable) in one job are not "
                        "built; enable one of them")
        return errs

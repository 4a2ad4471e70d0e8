"""The rollout-engine interface shared by every engine (SGLang over HTTP, the embedded in-process engine).

An engine turns prompts (token ids) into sampled responses with the log-probability of each sampled token under
the engine's weights, with SGLang's semantics: ``log_softmax(logits / T)`` over the FULL vocabulary at the sampled
token (temperature applied; top-k / top-p truncation NOT renormalised); the trainer recomputes and compares.

Contract of ``RolloutEngine.generate(prompt_ids, sampling, n=1, seed=None)``: all-or-nothing -- it returns
``len(prompt_ids) * n`` rollouts, prompt-major, all from the same weight version, or raises a ``RolloutError``
(the caller must then not apply the step). The weight side of an engine is ``weight_sync.endpoint.WeightEndpoint``
(receive a version, commit it, report checksums); capabilities are class attributes readable before an engine
is built (``rollout.factory.engine_class``).
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from megatron_rl.errors import RolloutError
from megatron_rl.weight_sync.endpoint import WEIGHT_SYNC_MODES, WeightEndpoint, WeightSyncError
from megatron_rl.weight_sync.versions import parse_version

__all__ = ["FINISH_REASONS", "RolloutError", "MalformedResponseError", "StaleRolloutError", "EngineUnavailableError",
           "WeightSyncError", "WEIGHT_SYNC_MODES", "SamplingParams", "Rollout", "validate_prompts", "validate_n",
           "RolloutEngine"]

#: Finish reasons a ``Rollout`` can carry.
FINISH_REASONS = ("stop", "length")


class MalformedResponseError(RolloutError):
    """An engine's reply is missing a field or has a wrong one (the message names the field and server)."""


class StaleRolloutError(RolloutError):
    """A rollout was produced by a weight version other than the one the trainer expects."""


class EngineUnavailableError(RolloutError):
    """The engine could not be reached / did not answer after retries (the message names the URL and the
    last failure)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses (mirrors SGLang's ``sampling_params``)."""

    #: Softmax temperature; ``0`` means greedy. Rollout log-probs are ``log_softmax(logits / T)``
    #: (for greedy, SGLang treats T as 1: ``log_softmax(logits)``).
    temperature: float = 1.0
    #: Nucleus-sampling mass in (0, 1]; 1 disables it.
    top_p: float = 1.0
    #: Keep only the k most likely tokens; -1 disables it.
    top_k: int = -1
    #: Maximum number of generated tokens per response (>= 1).
    max_new_tokens: int = 64
    #: Extra token ids that end a response (the model's EOS always does unless ``ignore_eos``).
    stop_token_ids: tuple[int, ...] = ()
    #: Keep generating past EOS / stop ids until ``max_new_tokens`` (benchmarks).
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r} must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"SamplingParams.top_k={self.top_k!r} must be -1 (disabled) or an int >= 1")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        stops = tuple(self.stop_token_ids)
        for i, t in enumerate(stops):
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"SamplingParams.stop_token_ids[{i}]={t!r} must be an int >= 0")
        object.__setattr__(self, "stop_token_ids", stops)

    def to_sglang(self, n: int = 1) -> dict[str, Any]:
        """The ``sampling_params`` JSON object of SGLang's ``/generate`` for ``n`` samples per prompt."""
        d: dict[str, Any] = {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "max_new_tokens": int(self.max_new_tokens),
            "n": int(n),
        }
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            d["ignore_eos"] = True
        return d


@dataclass
class Rollout:
    """One sampled response to one prompt."""

    #: Index of the prompt in the ``prompt_ids`` list passed to ``generate``.
    prompt_index: int
    #: The prompt's token ids (as sent).
    prompt_ids: list[int]
    #: The generated token ids (includes a final EOS / stop token when ``finish_reason == "stop"``).
    response_ids: list[int]
    #: Per response token: ``log_softmax(logits / T)[token]`` over the full vocabulary, as the engine computed it.
    rollout_log_probs: list[float]
    #: ``"stop"`` (EOS or a stop id) or ``"length"`` (hit ``max_new_tokens``).
    finish_reason: str
    #: The engine weight version that produced this response (its first token; every token unless
    #: ``token_versions`` says otherwise).
    weight_version: str
    #: Which engine produced it (e.g. the server URL), for diagnostics.
    source: str = ""
    #: Extra engine-specific information (e.g. the matched stop token; ``"token_versions"``: the per-token versions
    #: of an engine view that generates in segments, read through ``token_versions``).
    info: dict[str, Any] = field(default_factory=dict)
    #: MoE routing the engine used (``[len(prompt) + len(response) - 1, moe_layers, topk]`` expert ids, uint8 /
    #: int16: every token it fed through the model), or None when not captured. ``RolloutBatch.routing``
    #: replays it (``actor.routing_replay: r3``); not part of ``to_dict``.
    routed_experts: Any = None

    def __post_init__(self):
        if len(self.response_ids) != len(self.rollout_log_probs):
            raise ValueError(f"Rollout(prompt_index={self.prompt_index}): {len(self.response_ids)} response_ids "
                             f"but {len(self.rollout_log_probs)} rollout_log_probs")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Rollout.finish_reason={self.finish_reason!r} must be one of {FINISH_REASONS}")

    @property
    def token_versions(self) -> list[int]:
        """The weight version (``parse_version``) of every response token: the tags of the engine view that
        generated it in segments (``trainer.async_rollout.SegmentedEngine``: a response may span versions), else
        ``weight_version`` for every token. ValueError when ``weight_version`` is not ``step-<int>``."""
        tagged = self.info.get("token_versions")
        if tagged is not None:
            return [int(v) for v in tagged]
        return [parse_version(self.weight_version)] * len(self.response_ids)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (one line of a recorded-rollouts JSONL file)."""
        return {"prompt_index": self.prompt_index, "prompt_ids": list(self.prompt_ids),
                "response_ids": list(self.response_ids), "rollout_log_probs": list(self.rollout_log_probs),
                "finish_reason": self.finish_reason, "weight_version": self.weight_version,
                "source": self.source, "info": dict(self.info)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "rollout") -> "Rollout":
        """Inverse of ``to_dict``; a missing or wrong field raises ``ValueError`` naming it and ``where``
        (e.g. ``"rollouts.jsonl line 7"``)."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
        for key in ("prompt_ids", "response_ids", "rollout_log_probs", "finish_reason", "weight_version"):
            if key not in d:
                raise ValueError(f"{where}: missing field {key!r}")
        for key in ("prompt_ids", "response_ids", "rollout_log_probs"):
            if not isinstance(d[key], list):
                raise ValueError(f"{where}: field {key!r} must be a list, got {type(d[key]).__name__}")
        for key in ("prompt_ids", "response_ids"):
            for j, t in enumerate(d[key]):
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise ValueError(f"{where}: {key}[{j}]={t!r} is not a token id")
        for j, x in enumerate(d["rollout_log_probs"]):
            if not isinstance(x, (int, float)) or isinstance(x, bool) or math.isnan(x) or x > 1e-4:
                raise ValueError(f"{where}: rollout_log_probs[{j}]={x!r} is not a log-probability")
        try:
            return cls(prompt_index=int(d.get("prompt_index", 0)), prompt_ids=list(d["prompt_ids"]),
                       response_ids=list(d["response_ids"]),
                       rollout_log_probs=[float(x) for x in d["rollout_log_probs"]],
                       finish_reason=d["finish_reason"], weight_version=str(d["weight_version"]),
                       source=str(d.get("source", "")), info=dict(d.get("info") or {}))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def validate_prompts(prompt_ids: Sequence[Sequence[int]], vocab_size: int | None = None) -> list[list[int]]:
    """Check ``prompt_ids`` is a non-empty list of non-empty lists of token ids (``0 <= id < vocab_size``
    when given) and return it as plain ``list[list[int]]``; raise ``ValueError`` naming the bad entry."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence) or len(prompt_ids) == 0:
        raise ValueError("prompt_ids must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompt_ids):
        if hasattr(p, "tolist"):
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) == 0:
            raise ValueError(f"prompt_ids[{i}] must be a non-empty list of token ids, got {type(p).__name__}"
                             f"{' of length 0' if isinstance(p, Sequence) else ''}")
        row = []
        for j, t in enumerate(p):
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bound = f" < vocab_size={vocab_size}" if vocab_size is not None else ""
                raise ValueError(f"prompt_ids[{i}][{j}]={t!r} is not a token id (int >= 0{bound})")
            row.append(int(t))
        out.append(row)
    return out


def validate_n(n: int) -> int:
    """Check the samples-per-prompt count ``n`` is an int >= 1."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n={n!r} (samples per prompt) must be an int >= 1")
    return n


class RolloutEngine(WeightEndpoint):
    """Generates rollouts; receives weights as a ``WeightEndpoint``. Implementations: ``SGLangEngine`` (HTTP),
    the embedded engine."""

    #: True: ``generate(..., seed=s)`` reproduces a sample (the same seed, weights and call give the same
    #: rollouts; a different seed draws others). False: the engine samples on its own (SGLang samples
    #: server-side) and ignores ``seed``.
    seeded_sampling: bool = False

    @classmethod
    def config_errors(cls, rollout) -> list[str]:
        """What this engine needs of the ``rollout`` config section that is missing (one message per
        problem, naming its dotted key); checked by ``plan.validate_job`` before anything is built."""
        return []

    @classmethod
    def describe(cls, rollout) -> str:
        """The engine of the ``rollout`` config section in a few words (the trainer's start-up line)."""
        return cls.__name__

    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, n: int = 1,
                 seed: int | None = None) -> list[Rollout]:
        """Sample ``n`` responses per prompt; return ``len(prompt_ids) * n`` rollouts, prompt-major, all from
        the current weight version, or raise ``RolloutError`` (nothing partial is returned). ``seed`` fixes
        this call's randomness where ``seeded_sampling``; other engines accept and ignore it."""

    @abc.abstractmethod
    def health(self) -> dict[str, bool]:
        """Cheap liveness check: a map from engine/server name to whether it is healthy."""

    def close(self) -> None:
        """Release resources (connections, models). Default: nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

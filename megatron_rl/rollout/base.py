"""The rollout-engine interface shared by every engine (SGLang over HTTP, the embedded in-process engine).

An engine turns prompts (token ids) into sampled responses with the log-probability of each sampled
token under the engine's weights, with SGLang's semantics: ``log_softmax(logits / T)`` over the FULL
vocabulary at the sampled token (temperature applied; top-k / top-p truncation NOT renormalised). The
trainer recomputes log-probs with the same temperature and compares (rollout correction).

Contract of ``RolloutEngine.generate``: all-or-nothing. It either returns ``len(prompt_ids) * n``
rollouts, prompt-major (``[p0 s0, p0 s1, ..., p1 s0, ...]``), all produced by the same weight version,
or it raises a ``RolloutError`` subclass — the caller must then not apply the training step. Every engine
has the same signature ``generate(prompt_ids, sampling, n=1, seed=None)``.

Capabilities are class attributes, readable before an engine is built (``rollout.factory.engine_class``
maps ``rollout.engine`` to the class): ``weight_sync_modes`` (what it can receive),
``deferred_weight_sync_modes`` (what rank 0 can apply later, alone: async rollouts),
``default_weight_sync_mode(async_rollouts)`` (what ``rollout.weight_sync: auto`` means) and
``seeded_sampling`` (whether ``seed`` reproduces a sample).

Usage::

    engine = SGLangEngine(["http://127.0.0.1:30000"])          # or EmbeddedEngine(...)
    rollouts = engine.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=16), n=4)
    engine.update_weights("/ckpt/hf_step_10", version="step-10")
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from megatron_rl.rollout.versions import parse_version
from megatron_rl.weight_sync.buckets import tensor_checksum

#: Finish reasons a ``Rollout`` can carry.
FINISH_REASONS = ("stop", "length")


class RolloutError(RuntimeError):
    """A rollout step failed; the caller must not apply the step."""


class MalformedResponseError(RolloutError):
    """An engine's reply is missing a field or has a wrong one (the message names the field and server)."""


class StaleRolloutError(RolloutError):
    """A rollout was produced by a weight version other than the one the trainer expects."""


class EngineUnavailableError(RolloutError):
    """The engine could not be reached / did not answer after retries (the message names the URL and the
    last failure)."""


class WeightSyncError(RolloutError):
    """Loading new weights into the engine failed."""


#: How weights reach an engine (``rollout.weight_sync``): an HF export directory, in-memory buckets handed
#: over in the same host / process, or buckets broadcast over a process group to the engine's ranks.
WEIGHT_SYNC_MODES = ("disk", "tensor", "distributed")


class WeightReceiver(abc.ABC):
    """One in-memory weight update of an engine, bucket by bucket (``RolloutEngine.begin_weight_sync``).

    Until ``commit`` the engine serves no version the trainer expects (a request answered in between is
    rejected as stale); ``abort`` — allowed before or after ``commit`` — leaves the engine refusing to
    generate until a later sync succeeds, so partially updated weights are never served."""

    @abc.abstractmethod
    def load(self, bucket) -> None:
        """Load one ``weight_sync.buckets.Bucket`` (HF names) into the engine."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Every bucket was loaded: tag the engine with the update's version (checked on every server)."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """The update failed (``reason``): make sure no server serves the partial weights."""

    @abc.abstractmethod
    def channel(self):
        """How every sender reaches this update (a picklable ``weight_sync.transport.ChannelSpec``): each
        model-parallel shard owner sends its own buckets through it; rank 0 then commits or aborts."""


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


class RolloutEngine(abc.ABC):
    """Generates rollouts and loads new weights. Implementations: ``SGLangEngine`` (HTTP), the embedded engine."""

    # ------------------------------------------------------------ capabilities (read before building one)
    #: The ``rollout.weight_sync`` modes this engine can receive (see ``WEIGHT_SYNC_MODES``).
    weight_sync_modes: tuple = ("disk",)

    #: The modes of ``weight_sync_modes`` whose payload rank 0 alone can apply later, after every trainer rank
    #: prepared it (``rollout.mode: async``: the producer thread loads it between segments; in memory: the
    #: version's buckets collected on rank 0, sent by the producer as the one sender).
    deferred_weight_sync_modes: tuple = ("disk",)

    #: True: ``generate(..., seed=s)`` reproduces a sample (the same seed, weights and call give the same
    #: rollouts; a different seed draws others). False: the engine samples on its own (SGLang samples
    #: server-side) and ignores ``seed``.
    seeded_sampling: bool = False

    @classmethod
    def default_weight_sync_mode(cls, async_rollouts: bool) -> str:
        """The mode ``rollout.weight_sync: auto`` means for this engine: one of ``weight_sync_modes``, and of
        ``deferred_weight_sync_modes`` when ``async_rollouts`` (``rollout.mode: async``)."""
        return "disk"

    @classmethod
    def config_errors(cls, rollout) -> list[str]:
        """What this engine needs of the ``rollout`` config section that is missing (one message per
        problem, naming its dotted key); checked by ``config.validate`` before anything is built."""
        return []

    @classmethod
    def describe(cls, rollout) -> str:
        """The engine of the ``rollout`` config section in a few words (the trainer's start-up line)."""
        return cls.__name__

    # ------------------------------------------------------------------------------------------ interface
    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, n: int = 1,
                 seed: int | None = None) -> list[Rollout]:
        """Sample ``n`` responses per prompt; return ``len(prompt_ids) * n`` rollouts, prompt-major, all from
        the current weight version, or raise ``RolloutError`` (nothing partial is returned). ``seed`` fixes
        this call's randomness where ``seeded_sampling``; other engines accept and ignore it."""

    @abc.abstractmethod
    def update_weights(self, hf_dir: str, version: str) -> None:
        """Load the HF-format weights in ``hf_dir`` and tag them ``version``; later rollouts must carry it."""

    def begin_weight_sync(self, version: str, timeout_s: float, groups=None) -> WeightReceiver:
        """Start an in-memory update to ``version`` (the one receiver interface; the job's
        ``weight_sync.modes`` object calls it). ``groups``: None -- the buckets reach this engine on the trainer's
        host; a ``weight_sync.transport.UpdateGroups`` -- each sender broadcasts in its own update group with
        the engine's ranks. ``timeout_s`` bounds every wait of the update."""
        raise WeightSyncError(f"{type(self).__name__} cannot receive in-memory weight updates "
                              f"(it supports {', '.join(self.weight_sync_modes)})")

    def holds_weight_version(self, version: str) -> bool:
        """Whether the engine serves ``version``, valid, right now -- what a delta sync may start from. Engines
        whose servers can lose it on their own (a restarted SGLang server) ask them."""
        return self.weight_version == version and getattr(self, "_invalid", None) is None

    @property
    def weight_dtype(self):
        """The torch dtype the engine keeps its weights in (buckets are cast to it), None if unknown."""
        return None

    def full_precision_weight_names(self, hf_names=()) -> set:
        """HF names (of ``hf_names``, the tensors of the sync) the engine keeps in a higher precision than
        ``weight_dtype`` (sent uncast)."""
        return set()

    def weight_checksum_fn(self):
        """The function that hashes a tensor exactly as ``weight_checksums`` does (default: sha256 of its CPU
        bytes, ``weight_sync.buckets.tensor_checksum``), or None when this process cannot reproduce the engine's
        hash (verification is then skipped and reported as 0 verified)."""
        return tensor_checksum

    def weight_layout(self, hf_names, geometry) -> list:
        """The engine tensors ``weight_checksums`` can report, as ``weight_sync.layout.EngineTensor`` objects built
        from the HF tensors ``hf_names`` (model of ``geometry``: ``convert.geometry.HFGeometry``); empty: no
        verification."""
        return []

    def weight_tp_sizes(self) -> tuple:
        """The TP sizes of the engine's servers (one checksum per TP rank and tensor)."""
        return (1,)

    def weight_checksums(self, names) -> dict:
        """``{server: {engine tensor name: (tensor_checksum of TP rank 0's copy, rank 1's, ...)}}`` for ``names``."""
        raise WeightSyncError(f"{type(self).__name__} cannot report weight checksums")

    @abc.abstractmethod
    def health(self) -> dict[str, bool]:
        """Cheap liveness check: a map from engine/server name to whether it is healthy."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> str | None:
        """The weight version the engine is expected to serve (None until known)."""

    def close(self) -> None:
        """Release resources (connections, models). Default: nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

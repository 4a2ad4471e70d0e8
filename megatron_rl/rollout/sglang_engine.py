"""``SGLangEngine``: rollouts from one or more SGLang servers (or an SGLang router) over HTTP.

Rule: ``generate`` is all-or-nothing (on any failure it raises and returns nothing), and every reply is validated
field by field (``parse_generate_response``) before a rollout is built from it. Requests, retries, MoE routing,
weights and log-prob semantics: docs/engines.md.

Usage::

    engine = SGLangEngine(["http://127.0.0.1:30000", "http://127.0.0.1:30001"])
    engine.wait_until_ready(timeout=120)
    rollouts = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=32), n=8)
    engine.update_weights("/run/hf_export/step_3", version="3")
"""
from __future__ import annotations

import itertools
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import requests

from megatron_rl.rollout.base import (
    EngineUnavailableError,
    MalformedResponseError,
    Rollout,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    StaleRolloutError,
    WeightSyncError,
    validate_n,
    validate_prompts,
)
from megatron_rl.rollout.finish import normalised_finish, stop_ids
from megatron_rl.rollout.sglang_routing import ROUTED_EXPERTS_FLAG, SGLangRoutingLayout, decode_routed_experts
from megatron_rl.weight_sync.receivers.sglang import (FP32_KEPT_SUFFIXES, SGLangReceiver, ServerSet, checksums_by_name,
                                                     drop_update_group)
from megatron_rl.weight_sync.endpoint import SyncCapabilities, WeightHolding, tensor_checksum
from megatron_rl.weight_sync.receivers.sglang_lora import SGLangAdapters
from megatron_rl.weight_sync.layout import sglang_layout


@dataclass(frozen=True)
class RetryPolicy:
    """How HTTP calls are retried (connection errors, timeouts and 5xx only)."""

    #: Total attempts per request (>= 1).
    max_attempts: int = 4
    #: Sleep before the 2nd attempt, in seconds; doubles each retry.
    backoff_initial: float = 0.5
    #: Upper bound on a single backoff sleep, in seconds.
    backoff_max: float = 8.0

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts={self.max_attempts} must be >= 1")
        if self.backoff_initial < 0 or self.backoff_max < 0:
            raise ValueError("RetryPolicy backoff times must be >= 0")

    def sleep_before(self, attempt: int) -> float:
        """Seconds to sleep before attempt number ``attempt`` (1-based; the first attempt does not sleep)."""
        if attempt <= 1:
            return 0.0
        return min(self.backoff_max, self.backoff_initial * (2 ** (attempt - 2)))


class _Retryable(Exception):
    """Internal: a failure worth retrying (connection error, timeout, 5xx)."""


def gpu_checksum(t) -> str:
    """SGLang's checksum of a tensor held on a GPU (its Triton ``gpu_tensor_hash``; a module-level function, so
    a verifier holding it can be handed to every weight-sync sender)."""
    from sglang.srt.managers.mm_utils import gpu_tensor_hash

    return f"{gpu_tensor_hash(t.detach().contiguous().cuda()):016x}"


def _field(obj: Any, path: str, key: str, where: str, types: tuple, allow_none: bool = False):
    """Return ``obj[key]`` after checking it exists and has one of ``types``; raise MalformedResponseError."""
    if not isinstance(obj, dict):
        raise MalformedResponseError(f"{where}: {path} is {type(obj).__name__}, expected a JSON object")
    if key not in obj:
        raise MalformedResponseError(f"{where}: missing field {path}.{key}")
    val = obj[key]
    if val is None and allow_none:
        return None
    if not isinstance(val, types) or isinstance(val, bool) and bool not in types:
        raise MalformedResponseError(f"{where}: field {path}.{key} is {type(val).__name__} ({_short(val)}), "
                                     f"expected {'/'.join(t.__name__ for t in types)}")
    return val


def _short(val: Any, limit: int = 80) -> str:
    s = repr(val)
    return s if len(s) <= limit else s[:limit] + "..."


def parse_generate_response(payload: Any, prompts: list[list[int]], n: int, source: str,
                            expected_version: str | None, prompt_offset: int = 0,
                            routing: SGLangRoutingLayout | None = None,
                            stops: frozenset = frozenset()) -> list[Rollout]:
    """Validate one ``/generate`` reply for ``prompts`` x ``n`` samples and turn it into ``Rollout`` objects.

    Args:
        payload: the decoded JSON (a list for batches / ``n > 1``; a single object for one prompt, n=1).
        prompts: the prompts that were sent, in order.
        n: samples per prompt that were requested.
        source: the server URL (named in every error).
        expected_version: the weight version every response must carry (None: any, but all equal).
        prompt_offset: index of ``prompts[0]`` in the caller's full prompt list (``Rollout.prompt_index``).
        routing: the model's routing layout when ``return_routed_experts`` was requested: every response
            must then carry ``meta_info.routed_experts`` (-> ``Rollout.routed_experts``).
        stops: the ids that end a response (``finish.stop_ids``): a "length" reply whose last token is one of
            them finished with "stop" (a scheduler that checks the length limit before EOS says "length").

    Raises:
        MalformedResponseError: a field is missing or wrong (message names the field path and the server).
        StaleRolloutError: a response's ``meta_info.weight_version`` differs from ``expected_version``.
        RolloutError: a request was aborted by the server.
    """
    where = f"SGLang /generate reply from {source}"
    want = len(prompts) * n
    if isinstance(payload, dict) and want == 1:
        payload = [payload]
    if not isinstance(payload, list):
        raise MalformedResponseError(f"{where}: expected a JSON list of {want} responses, got "
                                     f"{type(payload).__name__} ({_short(payload)})")
    if len(payload) != want:
        raise MalformedResponseError(f"{where}: expected {want} responses ({len(prompts)} prompts x n={n}), "
                                     f"got {len(payload)}")
    rollouts = []
    seen_version = expected_version
    for k, item in enumerate(payload):
        p = k // n
        path = f"response[{k}]"
        output_ids = _field(item, path, "output_ids", where, (list,))
        meta = _field(item, path, "meta_info", where, (dict,))
        mpath = f"{path}.meta_info"
        for j, t in enumerate(output_ids):
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise MalformedResponseError(f"{where}: {path}.output_ids[{j}]={_short(t)} is not a token id")
        lps = _field(meta, mpath, "output_token_logprobs", where, (list,))
        if len(lps) != len(output_ids):
            raise MalformedResponseError(
                f"{where}: {mpath}.output_token_logprobs has {len(lps)} entries but {path}.output_ids has "
                f"{len(output_ids)}")
        log_probs = []
        for j, entry in enumerate(lps):
            epath = f"{mpath}.output_token_logprobs[{j}]"
            if not isinstance(entry, (list, tuple)) or len(entry) < 2:
                raise MalformedResponseError(f"{where}: {epath}={_short(entry)} is not [logprob, token_id, text]")
            lp, tid = entry[0], entry[1]
            if not isinstance(lp, (int, float)) or isinstance(lp, bool) or math.isnan(lp) or lp > 1e-4:
                raise MalformedResponseError(f"{where}: {epath}[0] (logprob)={_short(lp)} is not a log-probability")
            if tid != output_ids[j]:
                raise MalformedResponseError(f"{where}: {epath}[1] (token id)={_short(tid)} != "
                                             f"{path}.output_ids[{j}]={output_ids[j]}")
            log_probs.append(float(lp))
        fr = _field(meta, mpath, "finish_reason", where, (dict, str))
        fr_type = fr if isinstance(fr, str) else _field(fr, f"{mpath}.finish_reason", "type", where, (str,))
        if fr_type == "abort":
            msg = fr.get("message", "") if isinstance(fr, dict) else ""
            raise RolloutError(f"{where}: {path} was aborted by the server ({msg or 'no message'})")
        if fr_type not in ("stop", "length"):
            raise MalformedResponseError(f"{where}: {mpath}.finish_reason.type={fr_type!r} is not stop/length/abort")
        if "prompt_tokens" in meta and meta["prompt_tokens"] != len(prompts[p]):
            raise MalformedResponseError(
                f"{where}: {mpath}.prompt_tokens={_short(meta['prompt_tokens'])} != length {len(prompts[p])} of "
                f"prompt {prompt_offset + p} (responses out of order?)")
        version = _field(meta, mpath, "weight_version", where, (str, int))
        version = str(version)
        if seen_version is None:
            seen_version = version
        if version != seen_version:
            kind = "expected" if expected_version is not None else "the batch's first response had"
            raise StaleRolloutError(f"{where}: {mpath}.weight_version={version!r} but {kind} {seen_version!r}; "
                                    "the rollout is stale")
        for seg in meta.get("weight_versions") or []:
            seg_v = str(seg.get("version")) if isinstance(seg, dict) else None
            if seg_v != seen_version:
                raise StaleRolloutError(f"{where}: {mpath}.weight_versions has segment {_short(seg)} generated "
                                        f"with a weight version other than {seen_version!r}")
        info = {}
        if isinstance(fr, dict) and "matched" in fr:
            info["matched_stop"] = fr["matched"]
        if fr_type == "length" and normalised_finish(fr_type, output_ids, stops) == "stop":
            fr_type, info["matched_stop"] = "stop", output_ids[-1]
        routed = None
        if routing is not None:
            routed = decode_routed_experts(meta.get("routed_experts"), len(prompts[p]) + len(output_ids) - 1,
                                           routing, where, mpath)
        rollouts.append(Rollout(prompt_index=prompt_offset + p, prompt_ids=list(prompts[p]),
                                response_ids=list(output_ids), rollout_log_probs=log_probs,
                                finish_reason=fr_type, weight_version=version, source=source, info=info,
                                routed_experts=routed))
    return rollouts


class SGLangEngine(RolloutEngine):
    """Rollout engine backed by SGLang HTTP servers (see the module docstring)."""

    #: Every mode: a disk export, local in-memory buckets or a broadcast group (``weight_sync.receivers.sglang``).
    #: Every mode deferred: async rollouts collect the version's buckets on rank 0, and the producer, as their one
    #: sender, loads them between generation segments (shared memory, or its own update group) -- or the disk export.
    #: auto: "distributed" (the trainer broadcasts to the servers' ranks); "disk" with async rollouts (the in-memory
    #: modes are accepted there too, but hold the whole model on rank 0 for the producer).
    sync_capabilities = SyncCapabilities(modes=("disk", "tensor", "distributed"),
                                         deferred=("disk", "tensor", "distributed"),
                                         default_sync="distributed", default_async="disk")
    #: The servers sample on their own; ``generate`` ignores ``seed``.
    seeded_sampling = False
    #: ``rollout.lora_sync: adapter``: servers started with ``--enable-lora`` load each version's adapter by path
    #: (``weight_sync.receivers.sglang_lora``) and generate requests name it.
    lora_adapter_sync = True

    @classmethod
    def config_errors(cls, rollout) -> list[str]:
        """``rollout.sglang_urls`` or ``rollout.sglang_launch``: at least one server."""
        if not rollout.sglang_urls and not rollout.sglang_launch:
            return ["rollout.sglang_urls: empty while rollout.engine is 'sglang' and rollout.sglang_launch is false"]
        return []

    @classmethod
    def describe(cls, rollout) -> str:
        """"sglang (N server(s))": the listed URLs plus the one it launches."""
        return f"sglang ({len(rollout.sglang_urls) + int(rollout.sglang_launch)} server(s))"

    def __init__(self, urls: str | Sequence[str], *, request_timeout: float = 300.0, connect_timeout: float = 5.0,
                 weight_sync_timeout: float = 600.0, retry: RetryPolicy | None = None,
                 vocab_size: int | None = None, weight_version: str | None = None,
                 check_local_paths: bool = True, capture_routing: bool | None = None,
                 routing_layout: SGLangRoutingLayout | None = None, lora_adapter_dir: str | None = None):
        """
        Args:
            urls: one base URL (``http://127.0.0.1:30000``) or several (servers used round-robin; a router
                URL counts as one server).
            request_timeout: seconds to wait for a ``/generate`` reply (per attempt).
            connect_timeout: seconds to wait for a TCP connection (per attempt).
            weight_sync_timeout: bound of every weight-sync request (``/update_weights_from_disk`` with its
                busy retries, ``/weights_checker``, each in-memory update call); ``rollout.weight_sync_timeout_s``.
            retry: retry policy for connection errors, timeouts and 5xx.
            vocab_size: when given, prompt token ids are checked against it before sending.
            weight_version: the version the servers currently serve, if known (else learned from replies).
            check_local_paths: check that ``update_weights``' directory exists locally (servers on this host).
            capture_routing: MoE routing capture (R3). None (auto): on for a server whose ``/server_info`` says
                ``enable_return_routed_experts`` and whose model is MoE; True: required, checked here for every
                server (a server without the flag or a dense model raises ``RolloutError`` before any rollout);
                False: never asked for.
            routing_layout: the served model's routing layout; default: read from the ``config.json`` of the
                ``model_path`` the server reports (a directory on this host).
            lora_adapter_dir: where adapter-only LoRA sync writes each version's PEFT directory (read by the
                servers at the same path); None: adapter-only sync is refused.
        """
        if isinstance(urls, str):
            urls = [urls]
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"SGLangEngine server URL {u!r} must start with http:// or https://")
        for name, v in (("request_timeout", request_timeout), ("connect_timeout", connect_timeout),
                        ("weight_sync_timeout", weight_sync_timeout)):
            if not v > 0:
                raise ValueError(f"SGLangEngine {name}={v!r} must be > 0")
        self.urls = urls
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.weight_sync_timeout = weight_sync_timeout
        self.retry = retry or RetryPolicy()
        self.vocab_size = vocab_size
        self.check_local_paths = check_local_paths
        self._weight_version = None if weight_version is None else str(weight_version)
        self.capture_routing = capture_routing
        self._routing_layout = routing_layout
        self._routing: dict[str, SGLangRoutingLayout | None] = {}  # per server, once known
        self._rr = itertools.count()
        self._sessions: dict[str, requests.Session] = {}
        self._lock = threading.Lock()
        self._invalid: str | None = None  # why no server may be used (a failed in-memory weight sync)
        self._server_info: dict[str, dict] = {}
        self._reported: set | None = None  # tensor names /weights_checker reports (fixed for a server)
        self._adapters = None if lora_adapter_dir is None else SGLangAdapters(lora_adapter_dir)
        if capture_routing is True:  # required: refuse a server that cannot capture now, not at the first rollout
            for url in self.urls:
                self._routing_for(url)

    # ------------------------------------------------------------------ HTTP
    def _session(self, url: str) -> requests.Session:
        """One keep-alive session per server (a generate call talks to each server from one thread)."""
        base = url.split("/", 3)
        key = "/".join(base[:3])
        with self._lock:
            s = self._sessions.get(key)
            if s is None:
                s = self._sessions[key] = requests.Session()
            return s

    def _request(self, method: str, url: str, payload: Any = None, timeout: float | None = None,
                 retry: RetryPolicy | None = None, json_4xx: bool = False, budget: float | None = None) -> Any:
        """One HTTP call with retries on connection errors, timeouts and 5xx; returns the decoded JSON.
        A 4xx reply raises ``RolloutError`` unless ``json_4xx`` (then its JSON body is returned). ``budget``:
        seconds for every attempt and backoff together (each attempt's timeouts are cut to what is left)."""
        retry = retry or self.retry
        read = timeout or self.request_timeout
        last = "no attempt made"
        t0 = time.monotonic()
        deadline = None if budget is None else t0 + budget
        for attempt in range(1, retry.max_attempts + 1):
            pause = retry.sleep_before(attempt)
            left = None if deadline is None else deadline - time.monotonic() - pause
            if left is not None and left <= 0:
                raise EngineUnavailableError(f"{method} {url} did not succeed within its bound of {budget:.1f} s "
                                             f"({attempt - 1} attempt(s)); last failure: {last}")
            time.sleep(pause)
            timeouts = (self.connect_timeout, read) if left is None else (min(self.connect_timeout, left),
                                                                           min(read, left))
            try:
                resp = self._session(url).request(method, url, json=payload, timeout=timeouts)
                if resp.status_code >= 500:
                    raise _Retryable(f"HTTP {resp.status_code}: {resp.text[:300]!r}")
            except (requests.ConnectionError, requests.Timeout, _Retryable) as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code >= 400 and not (json_4xx and resp.headers.get("content-type", "").startswith(
                    "application/json")):
                raise RolloutError(f"{method} {url} returned HTTP {resp.status_code}: {resp.text[:500]!r}")
            try:
                return resp.json()
            except ValueError as e:
                raise MalformedResponseError(f"{method} {url}: reply is not JSON ({e}): {resp.text[:200]!r}") from None
        raise EngineUnavailableError(f"{method} {url} failed after {retry.max_attempts} attempts in "
                                     f"{time.monotonic() - t0:.1f} s; last failure: {last}")

    # ------------------------------------------------------------- interface
    @property
    def weight_version(self) -> str | None:
        """The weight version every response must carry (None until the first update or reply)."""
        return self._weight_version

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, n: int = 1,
                 seed: int | None = None) -> list[Rollout]:
        """Sample ``n`` responses per prompt from the servers; all-or-nothing (see module docstring).
        ``seed`` is accepted and ignored: the servers sample on their own (``seeded_sampling`` is False)."""
        prompts = validate_prompts(prompt_ids, self.vocab_size)
        n = validate_n(n)
        if self._invalid is not None:
            raise WeightSyncError(f"SGLangEngine will not generate until a weight sync succeeds: {self._invalid}")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        k = min(len(self.urls), len(prompts))
        start = next(self._rr)
        bounds = [round(i * len(prompts) / k) for i in range(k + 1)]
        jobs = [(self.urls[(start + i) % len(self.urls)], bounds[i], prompts[bounds[i]:bounds[i + 1]])
                for i in range(k)]
        expected = self._weight_version

        def run(job):
            url, offset, chunk = job
            payload = {"input_ids": chunk if len(chunk) > 1 or n > 1 else chunk[0],
                       "sampling_params": sampling.to_sglang(n), "return_logprob": True, **self._lora_field()}
            layout = self._routing_for(url)
            if layout is not None:
                payload["return_routed_experts"] = True
            reply = self._request("POST", url + "/generate", payload)
            return parse_generate_response(reply, chunk, n, url, expected, prompt_offset=offset, routing=layout,
                                           stops=stop_ids(sampling))

        if k == 1:
            results = [run(jobs[0])]
        else:
            with ThreadPoolExecutor(max_workers=k) as pool:
                futures = [pool.submit(run, j) for j in jobs]
                results = [f.result() for f in futures]  # re-raises the first failure
        rollouts = [r for chunk in results for r in chunk]
        versions = {r.weight_version for r in rollouts}
        if len(versions) > 1:
            raise StaleRolloutError(f"rollouts of one step came from different weight versions {sorted(versions)} "
                                    f"(servers {self.urls})")
        if expected is None:
            self._weight_version = versions.pop()
        return rollouts

    def _routing_for(self, url: str) -> SGLangRoutingLayout | None:
        """The routing layout to request from ``url``, or None (see ``capture_routing``). Auto mode asks
        ``/server_info`` once (one attempt; a server that cannot answer it is asked again next time)."""
        if self.capture_routing is False:
            return None
        if url in self._routing:
            return self._routing[url]
        want = self.capture_routing is True
        try:
            info = self._request("GET", url + "/server_info", timeout=30.0, json_4xx=True,
                                 retry=None if want else RetryPolicy(max_attempts=1))
        except RolloutError:
            if want:
                raise
            return None
        info = info if isinstance(info, dict) else {}
        enabled = info.get("enable_return_routed_experts") is True
        layout = self._routing_layout
        if enabled and layout is None:
            model_path = info.get("model_path")
            if isinstance(model_path, str) and os.path.isfile(os.path.join(model_path, "config.json")):
                layout = SGLangRoutingLayout.from_hf_dir(model_path)
        if want and not enabled:
            raise RolloutError(f"{url}: routing capture is required (actor.routing_replay: r3) but the server was not "
                               f"started with {ROUTED_EXPERTS_FLAG} (/server_info enable_return_routed_experts="
                               f"{_short(info.get('enable_return_routed_experts'))}); launch/sglang_server.sh "
                               f"--routed-experts and launch/slurm.sbatch (r3 jobs) add it")
        if want and layout is None:
            raise RolloutError(f"{url}: capture_routing=True but the routing layout is unknown: the served model "
                               f"{_short(info.get('model_path'))} is dense or its config.json is not on this host "
                               "(pass routing_layout=)")
        self._routing[url] = layout if enabled else None
        return self._routing[url]

    def update_weights(self, hf_dir: str, version: str) -> None:
        """Make every server load the HF checkpoint in ``hf_dir`` as weight version ``version``. A failure
        leaves the engine refusing to generate until a later sync succeeds (as the in-memory modes do)."""
        version = str(version)
        if not version:
            raise ValueError("update_weights: version must be a non-empty string")
        path = os.path.abspath(hf_dir) if self.check_local_paths else str(hf_dir)
        if self.check_local_paths and not os.path.isfile(os.path.join(path, "config.json")):
            raise WeightSyncError(f"update_weights: {path} is not an HF checkpoint directory (no config.json)")
        try:
            for url in self.urls:
                self._update_one(url, path, version)
                got = self._server_version(url)
                if got != version:
                    raise WeightSyncError(f"{url}: after /update_weights_from_disk the server reports "
                                          f"weight_version={got!r}, expected {version!r}")
        except BaseException as exc:
            self.invalidate_weights(f"weight sync to {version!r} from disk failed: {type(exc).__name__}: {exc}")
            if isinstance(exc, RolloutError) and not isinstance(exc, WeightSyncError):
                raise WeightSyncError(f"weight sync to {version!r} from disk: {exc}") from exc
            raise
        self._weight_version = version
        self._invalid = None

    # ------------------------------------------------- in-memory weight sync (rollout.weight_sync; weight_sync/)
    def begin_weight_sync(self, version: str, timeout_s: float | None = None, groups=None):
        """An update session on every server, which every sender reaches through shared memory (``groups``
        None: servers on the senders' hosts) or in its own update group (``groups``: gloo on CPU, NCCL on GPU;
        kept between syncs)."""
        timeout_s = timeout_s or self.weight_sync_timeout
        if groups is None:
            return SGLangReceiver(self, str(version), timeout_s)
        return SGLangReceiver(self, str(version), timeout_s, groups.backend, groups.master_address)

    def server_set(self) -> ServerSet:
        """The servers as any trainer rank reaches them (URLs, TP sizes)."""
        return ServerSet(tuple(self.urls), tuple(self.server_tp_size(u) for u in self.urls))

    def _weight_dtype(self):
        """The dtype the servers run in (``/get_server_info`` ``dtype``; None for "auto")."""
        import torch

        dt = self._info(self.urls[0]).get("dtype")
        return getattr(torch, dt) if isinstance(dt, str) and isinstance(getattr(torch, dt, None), torch.dtype) else None

    def server_tp_size(self, url: str) -> int:
        """Tensor-parallel size of the server at ``url`` (``/get_server_info``)."""
        return int(self._info(url).get("tp_size") or 1)

    def _checker(self, url: str) -> dict:
        """``{name: (checksum per TP rank)}`` from ``url``'s ``/weights_checker`` (bounded by the sync timeout)."""
        reply = self._request("POST", url + "/weights_checker", {"action": "checksum"},
                              timeout=self.weight_sync_timeout, json_4xx=True, budget=self.weight_sync_timeout)
        return checksums_by_name(reply, url)

    def _checker_names(self) -> set:
        if self._reported is None:
            self._reported = set(self._checker(self.urls[0]))
        return self._reported

    def weight_holding(self, hf_names, geometry=None, verify: bool = False) -> WeightHolding:
        """The servers' dtype; full precision: what SGLang keeps in fp32 in a bf16 model (DeepSeek-V3's
        ``e_score_correction_bias``: ``noaux_tc`` routing, SGLang's ``MoEGate`` allocates it fp32), decided from the
        HF names, so a sync that does not verify never needs ``/weights_checker``. Verified: SGLang's tensors
        (fused qkv / gate_up / experts, padded vocabulary; ``weight_sync.layout.sglang_layout``) that the servers'
        ``/weights_checker`` reports -- fused experts only without expert parallelism -- asked only when this
        process can reproduce their hash (``_checksum_fn``) and there are names to verify."""
        dtype = self._weight_dtype()
        keep = frozenset(n for n in hf_names if n.endswith(FP32_KEPT_SUFFIXES))
        checksum = self._checksum_fn() if verify else None
        if checksum is None or not hf_names:
            return WeightHolding(dtype=dtype, full_precision=keep, checksum=checksum)
        reported = self._checker_names()
        ep = max(int(self._info(u).get("ep_size") or 1) for u in self.urls)
        layout = tuple(t for t in sglang_layout(hf_names, geometry.num_query_groups)
                       if t.name in reported and not (ep > 1 and t.experts))
        return WeightHolding(dtype=dtype, full_precision=keep, checksum=checksum, layout=layout,
                             tp_sizes=tuple(sorted({self.server_tp_size(u) for u in self.urls})))

    def _checksum_fn(self):
        """SGLang's ``/weights_checker`` hashes CPU tensors with sha256 (``tensor_checksum``) but CUDA tensors
        with its Triton ``gpu_tensor_hash`` (``sglang.srt.managers.mm_utils.tensor_hash``): for servers on a
        GPU the trainer needs that kernel (SGLang importable here and a CUDA device), else None."""
        devices = {str((self._info(u).get("device") or "cuda")).lower() for u in self.urls}
        if devices == {"cpu"}:
            return tensor_checksum
        try:
            import torch
            from sglang.srt.managers.mm_utils import gpu_tensor_hash  # noqa: F401 - importable: gpu_checksum works
        except Exception:  # noqa: BLE001 - SGLang not importable in the trainer's environment
            return None
        if not torch.cuda.is_available():
            return None
        return gpu_checksum

    def weight_checksums(self, names) -> dict:
        """``{url: {name: (checksum of TP rank 0's shard, ...)}}`` of every server."""
        return {url: {n: got[n] for n in names if n in got}
                for url, got in ((u, self._checker(u)) for u in self.urls)}

    def _info(self, url: str) -> dict:
        if url not in self._server_info:
            info = self._request("GET", url + "/get_server_info", timeout=self.weight_sync_timeout,
                                 budget=self.weight_sync_timeout)
            self._server_info[url] = info if isinstance(info, dict) else {}
        return self._server_info[url]

    def _post_ok(self, url: str, path: str, payload: dict, timeout: float) -> dict:
        """POST once (no retry: an update must not be applied twice); raise WeightSyncError unless success."""
        try:
            reply = self._request("POST", url + path, payload, timeout=timeout, retry=RetryPolicy(max_attempts=1),
                                  json_4xx=True, budget=timeout)
        except RolloutError as exc:
            raise WeightSyncError(f"{url}{path}: {exc}") from exc
        if isinstance(reply, dict) and reply.get("success") is False:
            raise WeightSyncError(f"{url}{path} refused: {_short(reply.get('message'), 400)}")
        return reply

    def _server_version(self, url: str) -> str | None:
        """The weight version ``url`` reports now (``/get_model_info``; bounded by the sync timeout)."""
        info = self._request("GET", url + "/get_model_info", timeout=self.weight_sync_timeout,
                             budget=self.weight_sync_timeout)  # part of a sync: its bound
        return str(info.get("weight_version")) if isinstance(info, dict) else None

    def _check_versions(self, version: str) -> None:
        """Every server reports ``version`` (``/get_model_info``); then the engine serves it."""
        for url in self.urls:
            got = self._server_version(url)
            if got != version:
                raise WeightSyncError(f"{url}: after the weight sync the server reports weight_version={got!r}, "
                                      f"expected {version!r}")
        self._weight_version = version
        self._invalid = None

    def holds_weight_version(self, version: str) -> bool:
        """``version`` is the engine's, valid, and every server reports it now: a server restarted since (it
        reports its launch version, its weights and delta store are gone) or tagged by someone else does not."""
        return super().holds_weight_version(version) and all(self._server_version(u) == version for u in self.urls)

    # ------------------------------------------------ adapter-only LoRA sync (rollout.lora_sync: adapter)
    def _lora_field(self) -> dict:
        """``{"lora_path": <adapter name>}`` while an adapter is served, else nothing."""
        name = None if self._adapters is None else self._adapters.name
        return {} if name is None else {"lora_path": name}

    def _check_lora_servers(self, rank: int) -> None:
        """Every server was started with ``--enable-lora`` and a ``--max-lora-rank`` >= ``rank``."""
        for url in self.urls:
            info = self._info(url)
            if info.get("enable_lora") is not True:
                raise WeightSyncError(f"{url}: rollout.lora_sync: adapter needs servers started with --enable-lora "
                                      f"(/get_server_info enable_lora={_short(info.get('enable_lora'))}); "
                                      f"megatron_rl.cli.server_flags prints the job's LoRA server options")
            cap = info.get("max_lora_rank")
            if isinstance(cap, int) and cap < rank:
                raise WeightSyncError(f"{url}: the server's --max-lora-rank {cap} < actor.lora.rank {rank}")

    def load_lora_adapter(self, tensors, scale: float, version: str) -> None:
        """Serve the LoRA adapter ``tensors`` (PEFT names; ``scale`` = alpha / rank) on every server as
        ``version`` (``weight_sync.receivers.sglang_lora``: loaded everywhere before the previous one goes), and
        tag the servers' weight version with it. A failure leaves the engine refusing to generate."""
        version = str(version)
        if self._adapters is None:
            raise WeightSyncError("SGLangEngine was built without lora_adapter_dir: adapter-only sync has nowhere to "
                                  "write the adapter")
        timeout = self.weight_sync_timeout
        try:
            ranks = {int(t.shape[0]) for k, t in tensors.items() if k.endswith(".lora_A.weight")}
            self._check_lora_servers(max(ranks, default=0))
            self._adapters.load(self.urls, lambda url, path, body: self._post_ok(url, path, body, timeout),
                                tensors, scale, version)
            for url in self.urls:
                self._post_ok(url, "/update_weight_version", {"new_version": version, "abort_all_requests": False},
                              timeout)
            self._check_versions(version)
        except BaseException as exc:
            self.invalidate_weights(f"adapter-only sync to {version!r} failed: {type(exc).__name__}: {exc}")
            raise

    def token_log_probs_by_server(self, sequences: list[list[int]]) -> dict[str, list[list[float]]]:
        """``{url: log p(token t | tokens < t) for t >= 1 of each sequence}`` at temperature 1, with the served
        adapter: the probe of adapter-only sync verification, from every server."""
        out = {}
        for url in self.urls:
            payload = {"input_ids": [list(map(int, s)) for s in sequences], "return_logprob": True,
                       "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                       **self._lora_field()}
            reply = self._request("POST", url + "/generate", payload, timeout=self.weight_sync_timeout,
                                  budget=self.weight_sync_timeout)
            if not isinstance(reply, list) or len(reply) != len(sequences):
                raise MalformedResponseError(f"{url}/generate (probe): expected {len(sequences)} replies, got "
                                             f"{_short(reply)}")
            rows = []
            for seq, item in zip(sequences, reply):
                got = (item.get("meta_info") or {}).get("input_token_logprobs") if isinstance(item, dict) else None
                if not isinstance(got, list) or len(got) != len(seq):
                    raise MalformedResponseError(f"{url}/generate (probe): input_token_logprobs of a {len(seq)}-token "
                                                 f"row: {_short(got)}")
                rows.append([float(x[0]) for x in got[1:]])
            out[url] = rows
        return out

    def token_log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The first server's ``token_log_probs_by_server``."""
        return next(iter(self.token_log_probs_by_server(sequences).values()))

    def _drop_group(self) -> None:
        drop_update_group(self.urls)

    def _update_one(self, url: str, path: str, version: str) -> None:
        """``/update_weights_from_disk`` on one server. SGLang refuses to flush its prefix cache while a request
        is still finishing (it then loads the weights but reports failure and keeps the old version tag, and
        cached KV from the old weights could be reused); that case is retried with backoff until the server
        is idle, up to ``weight_sync_timeout``."""
        deadline = time.monotonic() + self.weight_sync_timeout
        attempt = 0
        while True:
            attempt += 1
            left = deadline - time.monotonic()
            if left <= 0:  # only after a busy reply (the first attempt always has time left)
                raise WeightSyncError(f"{url}/update_weights_from_disk did not load {path} as version {version!r}: "
                                      f"server still busy (cache not flushed) after {attempt - 1} attempt(s) within "
                                      f"rollout.weight_sync_timeout_s={self.weight_sync_timeout:g} s")
            try:
                reply = self._request("POST", url + "/update_weights_from_disk",
                                      {"model_path": path, "weight_version": version}, timeout=left,
                                      json_4xx=True, budget=left, retry=RetryPolicy(max_attempts=1))
            except EngineUnavailableError as exc:
                raise WeightSyncError(f"{url}/update_weights_from_disk did not load {path} as version {version!r} "
                                      f"within rollout.weight_sync_timeout_s={self.weight_sync_timeout:g} s: "
                                      f"{exc}") from exc
            if isinstance(reply, dict) and reply.get("success") is True:
                return
            busy = isinstance(reply, dict) and "not flushed" in str(reply.get("message", ""))
            if not busy or time.monotonic() >= deadline:
                why = "server still busy (cache not flushed) " if busy else ""
                raise WeightSyncError(f"{url}/update_weights_from_disk did not load {path} as version {version!r} "
                                      f"{why}after {attempt} attempt(s): {_short(reply, 400)}")
            time.sleep(max(0.0, min(2.0, 0.05 * 2 ** attempt, deadline - time.monotonic())))

    def health(self, generate: bool = False) -> dict[str, bool]:
        """``{url: healthy}`` via ``GET /health`` (or ``/health_generate``, which runs a tiny generation)."""
        endpoint = "/health_generate" if generate else "/health"
        out = {}
        for url in self.urls:
            try:
                r = self._session(url).get(url + endpoint, timeout=(self.connect_timeout, 30.0 if generate else 5.0))
                out[url] = r.status_code == 200
            except (requests.ConnectionError, requests.Timeout):
                out[url] = False
        return out

    def wait_until_ready(self, timeout: float = 300.0, poll: float = 1.0) -> None:
        """Poll ``/health`` until every server answers 200, or raise ``EngineUnavailableError`` after ``timeout`` s
        naming the servers that are not ready."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.health()
            if all(status.values()):
                return
            if time.monotonic() >= deadline:
                bad = [u for u, ok in status.items() if not ok]
                raise EngineUnavailableError(f"SGLang servers not ready after {timeout:.0f} s: {bad}")
            time.sleep(poll)

    def close(self) -> None:
        """Close the weight-update group and the HTTP sessions."""
        self._drop_group()
        with self._lock:
            for s in self._sessions.values():
                s.close()
            self._sessions.clear()

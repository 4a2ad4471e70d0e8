"""An HTTP client for model endpoints (an LLM judge, a reward model): JSON POSTs to one or several servers.

``EndpointClient(urls, timeout_s, max_retries, max_concurrent).post_many(path, payloads)`` sends every payload
with at most ``max_concurrent`` requests in flight, the servers taken round-robin (a retry goes to the next
one), and returns one ``CallResult`` per payload in order. Rule: a call never raises for a server's fault; it
ends ``ok`` or with a named ``kind`` (``timeout``, ``unreachable``, ``http``, ``garbage``) and its message, and
each attempt's connect and reads by ``timeout_s``; ``post_many`` returns by its wall-clock bound (``batch_bound_s``)
even if a server trickles bytes (a call still running then is a ``timeout``; its thread is left to end).
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import requests
from requests.adapters import HTTPAdapter

__all__ = ["CallResult", "EndpointClient", "FAILURE_KINDS"]

#: The ways a call fails: no answer in time; no connection; an HTTP error status; a body that is not JSON.
FAILURE_KINDS = ("timeout", "unreachable", "http", "garbage")


@dataclass
class CallResult:
    """One payload's outcome."""

    #: The decoded JSON body (None when the call failed).
    body: Any = None
    #: None on success, else one of ``FAILURE_KINDS`` (the last attempt's).
    error_kind: Optional[str] = None
    #: The last attempt's error, naming the URL.
    error: str = ""
    #: Wall-clock seconds of the whole call, retries included.
    latency_s: float = 0.0
    #: Attempts made (1 + retries).
    attempts: int = 0

    @property
    def ok(self) -> bool:
        """Whether the call returned a JSON body."""
        return self.error_kind is None


class EndpointClient:
    """JSON POSTs to ``urls`` round-robin, bounded concurrency, per-attempt timeout, retries (module docstring)."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 60.0, max_retries: int = 2,
                 max_concurrent: int = 8, backoff_s: float = 0.5, where: str = "endpoint",
                 headers: Optional[Dict[str, str]] = None):
        """``where``: the config key the settings come from (error messages name it); ``headers``: sent with every
        request (``Authorization``)."""
        urls = [str(u).rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not urls:
            raise ValueError(f"{where}: no URL given")
        if not timeout_s > 0 or max_retries < 0 or max_concurrent < 1 or backoff_s < 0:
            raise ValueError(f"{where}: timeout_s={timeout_s} must be > 0, max_retries={max_retries} >= 0, "
                             f"max_concurrent={max_concurrent} >= 1, backoff_s={backoff_s} >= 0")
        self.urls, self.timeout_s, self.max_retries = urls, float(timeout_s), int(max_retries)
        self.max_concurrent, self.backoff_s, self.where = int(max_concurrent), float(backoff_s), where
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_connections=len(urls), pool_maxsize=self.max_concurrent)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._session.headers.update(headers or {})

    def _url(self) -> str:
        with self._lock:
            return self.urls[next(self._next) % len(self.urls)]

    def post(self, path: str, payload: Any) -> CallResult:
        """One POST of ``payload`` (JSON) to ``<url><path>``, retried on the next URL after a failure (an HTTP
        4xx other than 408 / 429 is not retried: the request itself is wrong)."""
        t0 = time.monotonic()
        res = CallResult()
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * attempt)
            url = self._url() + path
            res.attempts = attempt + 1
            try:
                r = self._session.post(url, json=payload, timeout=self.timeout_s)
            except requests.Timeout:
                res.error_kind, res.error = "timeout", f"{url}: no answer within {self.timeout_s:g} s"
                continue
            except requests.RequestException as e:
                res.error_kind, res.error = "unreachable", f"{url}: {type(e).__name__}: {e}"
                continue
            if r.status_code != 200:
                res.error_kind, res.error = "http", f"{url}: HTTP {r.status_code}: {r.text[:200]}"
                if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
                    break
                continue
            try:
                res.body, res.error_kind, res.error = r.json(), None, ""
            except ValueError:
                res.error_kind, res.error = "garbage", f"{url}: the body is not JSON: {r.text[:200]!r}"
                continue
            break
        res.latency_s = time.monotonic() - t0
        return res

    def call_bound_s(self) -> float:
        """The longest one ``post`` may take when each read answers within ``timeout_s``, plus 1 s of slack."""
        attempts = self.max_retries + 1
        return attempts * self.timeout_s + self.backoff_s * attempts * (attempts - 1) / 2 + 1.0

    def batch_bound_s(self, n: int) -> float:
        """The wall-clock bound of ``post_many`` of ``n`` payloads: one call bound per round of ``max_concurrent``."""
        return -(-n // self.max_concurrent) * self.call_bound_s()

    def post_many(self, path: str, payloads: Sequence[Any], bound_s: Optional[float] = None) -> List[CallResult]:
        """``post`` of each payload, ``max_concurrent`` at a time; results in payload order; returns within
        ``batch_bound_s`` or ``bound_s`` when shorter (a call not done by then is a ``timeout``). The calls run on
        daemon threads: one still held by a server past the bound cannot keep the process from exiting."""
        if not payloads:
            return []
        n, bound = len(payloads), self.batch_bound_s(len(payloads))
        if bound_s is not None:
            bound = min(bound, float(bound_s))
        results: List[Optional[CallResult]] = [None] * n
        todo = iter(range(n))
        lock, over = threading.Lock(), threading.Event()

        def work():
            while not over.is_set():
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                results[i] = self.post(path, payloads[i])

        threads = [threading.Thread(target=work, daemon=True, name=f"{self.where}-call-{k}")
                   for k in range(min(self.max_concurrent, n))]
        deadline = time.monotonic() + bound
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        over.set()   # a thread still in a call starts no other
        return [r if r is not None else
                CallResult(error_kind="timeout", error=f"{self.where}: no answer within the batch's bound {bound:g} s "
                                                       f"(a server that answers too slowly)", latency_s=bound)
                for r in list(results)]

    def get(self, path: str, timeout_s: Optional[float] = None) -> CallResult:
        """One GET of ``<first url><path>`` (health probes), no retry."""
        url, t0 = self.urls[0] + path, time.monotonic()
        try:
            r = self._session.get(url, timeout=timeout_s or self.timeout_s)
        except requests.Timeout:
            return CallResult(error_kind="timeout", error=f"{url}: no answer", latency_s=time.monotonic() - t0)
        except requests.RequestException as e:
            return CallResult(error_kind="unreachable", error=f"{url}: {type(e).__name__}: {e}",
                              latency_s=time.monotonic() - t0)
        if r.status_code != 200:
            return CallResult(error_kind="http", error=f"{url}: HTTP {r.status_code}", latency_s=time.monotonic() - t0)
        try:
            body = r.json()
        except ValueError:
            body = r.text
        return CallResult(body=body, latency_s=time.monotonic() - t0, attempts=1)

    def close(self) -> None:
        """Close the connection pool."""
        self._session.close()

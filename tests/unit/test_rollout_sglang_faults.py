"""SGLangEngine failure paths that a real SGLang server cannot produce on demand, plus input validation.

FAULT INJECTOR: ``FaultServer`` below is a tiny local HTTP server (stdlib ``http.server``) — NOT SGLang. It
answers ``/generate`` with whatever a test scripts: a delay (slow server), HTTP 503, a non-JSON body, a reply
with a missing/wrong field, or a stale ``weight_version``. Well-formed replies copy SGLang 0.5.23's format
(``meta_info.output_token_logprobs = [[logprob, token_id, null], ...]``); the real-server tests in
``test_sglang_server.py`` check that format against a real server. The server records every request so the
tests can count retries and inspect what the engine sent.

Run: OMP_NUM_THREADS=1 pytest tests/unit/test_rollout_sglang_faults.py
"""
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.rollout.base import (
    EngineUnavailableError,
    MalformedResponseError,
    RolloutError,
    SamplingParams,
    StaleRolloutError,
    WeightSyncError,
)
from megatron_rl.rollout.sglang_engine import RetryPolicy, SGLangEngine

FAST_RETRY = RetryPolicy(max_attempts=3, backoff_initial=0.05, backoff_max=0.2)


def good_reply(body, version="v0"):
    """A well-formed SGLang-style reply to ``body`` (responses depend on the request, prompt-major order)."""
    prompts = body["input_ids"]
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    n = body["sampling_params"].get("n", 1)
    m = body["sampling_params"]["max_new_tokens"]
    out = []
    for p in prompts:
        for s in range(n):
            ids = [(sum(p) + 7 * s + j) % 50 for j in range(m)]
            lps = [[-0.1 * (j + 1), t, None] for j, t in enumerate(ids)]
            out.append({"text": "", "output_ids": ids,
                        "meta_info": {"finish_reason": {"type": "length", "length": m}, "prompt_tokens": len(p),
                                      "weight_version": version, "output_token_logprobs": lps}})
    if len(out) == 1 and not isinstance(body["input_ids"][0], list):
        return out[0]
    return out


class FaultServer:
    """Scriptable fault-injecting HTTP server on 127.0.0.1 (see the module docstring)."""

    def __init__(self):
        self.requests = []  # (path, body) per request received
        self.script = []    # per /generate call: a callable(body) -> (status, body_bytes, delay_s); last repeats
        self.version = "v0"
        self.update_script = []  # per /update_weights_from_disk call: (status, reply); afterwards success
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status, data, ctype="application/json"):
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self):
                srv.requests.append((self.path, None))
                if self.path == "/health":
                    self._send(200, b"")
                elif self.path == "/get_model_info":
                    self._send(200, json.dumps({"weight_version": srv.version}).encode())
                else:
                    self._send(404, b'{"detail":"Not Found"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
                srv.requests.append((self.path, body))
                if self.path == "/update_weights_from_disk":
                    k = sum(1 for p, _ in srv.requests if p == "/update_weights_from_disk") - 1
                    if k < len(srv.update_script):
                        status, reply = srv.update_script[k]
                        return self._send(status, json.dumps(reply).encode())
                    srv.version = body["weight_version"]
                    return self._send(200, json.dumps({"success": True, "message": "ok"}).encode())
                k = sum(1 for p, _ in srv.requests if p == "/generate") - 1
                action = srv.script[min(k, len(srv.script) - 1)]
                status, data, delay = action(body)
                time.sleep(delay)
                self._send(status, data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def generate_calls(self):
        return [b for p, b in self.requests if p == "/generate"]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def ok(version="v0", delay=0.0):
    return lambda body: (200, json.dumps(good_reply(body, version)).encode(), delay)


def mutate(fn):
    """A well-formed reply passed through ``fn(reply) -> reply``."""
    def action(body):
        return 200, json.dumps(fn(good_reply(body))).encode(), 0.0
    return action


@pytest.fixture
def fault():
    s = FaultServer()
    yield s
    s.close()


SP = SamplingParams(temperature=1.0, max_new_tokens=3)


def test_well_formed_reply_is_parsed_prompt_major(fault):
    fault.script = [ok()]
    prompts = [[1, 2], [3, 4, 5], [6]]
    rs = SGLangEngine(fault.url, retry=FAST_RETRY).generate(prompts, SP, n=2)
    body = fault.generate_calls()[0]
    assert body["input_ids"] == prompts and body["return_logprob"] is True
    assert body["sampling_params"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 3, "n": 2}
    expected = good_reply(body)
    assert [r.prompt_index for r in rs] == [0, 0, 1, 1, 2, 2]
    for r, e in zip(rs, expected):
        assert r.prompt_ids == prompts[r.prompt_index]
        assert r.response_ids == e["output_ids"]
        assert r.rollout_log_probs == [x[0] for x in e["meta_info"]["output_token_logprobs"]]
        assert r.finish_reason == "length" and r.weight_version == "v0" and r.source == fault.url


def test_multiple_servers_split_the_batch_and_keep_order():
    a, b = FaultServer(), FaultServer()
    try:
        for s in (a, b):
            s.script = [ok()]
        eng = SGLangEngine([a.url, b.url], retry=FAST_RETRY)
        prompts = [[i, i + 1] for i in range(5)]
        rs = eng.generate(prompts, SP, n=1)
        assert [r.prompt_ids for r in rs] == prompts
        sent = a.generate_calls() + b.generate_calls()
        assert sorted(map(len, (c["input_ids"] for c in sent))) == [2, 3]
        assert sorted(p for c in sent for p in c["input_ids"]) == prompts
        rs2 = eng.generate(prompts[:1], SP, n=1)  # round-robin: the next single-chunk call goes to the other one
        assert len(a.generate_calls()) + len(b.generate_calls()) == 3 and rs2[0].prompt_ids == prompts[0]
        assert {r.source for r in rs} == {a.url, b.url}
    finally:
        a.close()
        b.close()


def test_503_is_retried_with_backoff_then_succeeds(fault):
    fault.script = [lambda b: (503, b"overloaded", 0.0), lambda b: (503, b"overloaded", 0.0), ok()]
    t0 = time.monotonic()
    rs = SGLangEngine(fault.url, retry=RetryPolicy(max_attempts=3, backoff_initial=0.2, backoff_max=1)).generate(
        [[1, 2]], SP)
    elapsed = time.monotonic() - t0
    assert len(fault.generate_calls()) == 3 and len(rs) == 1
    assert elapsed >= 0.2 + 0.4 - 0.05, "exponential backoff 0.2 s then 0.4 s"


def test_persistent_5xx_gives_clear_error_naming_url_and_last_failure(fault):
    fault.script = [lambda b: (500, b"boom: scheduler died", 0.0)]
    with pytest.raises(EngineUnavailableError) as ei:
        SGLangEngine(fault.url, retry=FAST_RETRY).generate([[1, 2]], SP)
    msg = str(ei.value)
    assert fault.url + "/generate" in msg and "3 attempts" in msg and "HTTP 500" in msg and "scheduler died" in msg
    assert len(fault.generate_calls()) == 3


def test_slow_server_times_out_retries_and_fails_in_bounded_time(fault):
    fault.script = [ok(delay=2.0)]
    eng = SGLangEngine(fault.url, request_timeout=0.3, retry=RetryPolicy(max_attempts=2, backoff_initial=0.1))
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError, match=r"ReadTimeout|timed out") as ei:
        eng.generate([[1, 2]], SP)
    elapsed = time.monotonic() - t0
    assert elapsed < 2 * 0.3 + 0.1 + 1.0, f"took {elapsed:.1f} s"
    assert fault.url in str(ei.value) and len(fault.generate_calls()) == 2


def test_slow_but_within_timeout_succeeds(fault):
    fault.script = [ok(delay=0.3)]
    rs = SGLangEngine(fault.url, request_timeout=5, retry=FAST_RETRY).generate([[1, 2]], SP, n=2)
    assert len(rs) == 2 and len(fault.generate_calls()) == 1


def test_connection_refused_names_url():
    s = FaultServer()
    url = s.url
    s.close()
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="ConnectionError") as ei:
        SGLangEngine(url, retry=FAST_RETRY).generate([[1]], SP)
    assert url in str(ei.value) and time.monotonic() - t0 < 5


def test_non_json_reply_is_malformed(fault):
    fault.script = [lambda b: (200, b"<html>proxy error</html>", 0.0)]
    with pytest.raises(MalformedResponseError, match="not JSON.*proxy error"):
        SGLangEngine(fault.url, retry=FAST_RETRY).generate([[1, 2]], SP)


def test_4xx_is_not_retried(fault):
    fault.script = [lambda b: (400, b'{"error": "input_ids out of vocab"}', 0.0)]
    with pytest.raises(RolloutError, match="HTTP 400.*out of vocab"):
        SGLangEngine(fault.url, retry=FAST_RETRY).generate([[1, 2]], SP)
    assert len(fault.generate_calls()) == 1


def _drop(path):
    def fn(reply):
        obj = reply[0] if isinstance(reply, list) else reply
        *parents, last = path
        for p in parents:
            obj = obj[p]
        del obj[last]
        return reply
    return fn


def _set(path, value):
    def fn(reply):
        obj = reply[0] if isinstance(reply, list) else reply
        *parents, last = path
        for p in parents:
            obj = obj[p]
        obj[last] = value(obj[last]) if callable(value) else value
        return reply
    return fn


@pytest.mark.parametrize("fn, pattern", [
    (_drop(["output_ids"]), r"missing field response\[0\]\.output_ids"),
    (_drop(["meta_info"]), r"missing field response\[0\]\.meta_info"),
    (_drop(["meta_info", "output_token_logprobs"]), r"missing field response\[0\]\.meta_info\.output_token_logprobs"),
    (_drop(["meta_info", "weight_version"]), r"missing field response\[0\]\.meta_info\.weight_version"),
    (_drop(["meta_info", "finish_reason"]), r"missing field response\[0\]\.meta_info\.finish_reason"),
    (_set(["meta_info", "output_token_logprobs"], lambda v: v[:-1]),
     r"output_token_logprobs has 2 entries but response\[0\]\.output_ids has 3"),
    (_set(["meta_info", "output_token_logprobs"], lambda v: [v[0], [v[1][0], v[1][1] + 1, None], v[2]]),
     r"output_token_logprobs\[1\]\[1\] \(token id\)=\d+ != response\[0\]\.output_ids\[1\]"),
    (_set(["meta_info", "output_token_logprobs"], lambda v: [v[0], [None, v[1][1], None], v[2]]),
     r"output_token_logprobs\[1\]\[0\] \(logprob\)=None"),
    (_set(["meta_info", "output_token_logprobs"], lambda v: [v[0], [0.5, v[1][1], None], v[2]]),
     r"output_token_logprobs\[1\]\[0\] \(logprob\)=0.5 is not a log-probability"),
    (_set(["meta_info", "output_token_logprobs"], lambda v: [v[0], 7, v[2]]),
     r"output_token_logprobs\[1\]=7 is not \[logprob, token_id, text\]"),
    (_set(["output_ids"], "abc"), r"field response\[0\]\.output_ids is str"),
    (_set(["meta_info", "prompt_tokens"], 99), r"prompt_tokens=99 != length 2 of prompt 0"),
    (_set(["meta_info", "finish_reason"], {"type": "exploded"}), r"finish_reason.type='exploded'"),
    (lambda r: r[:1], r"expected 2 responses \(1 prompts x n=2\), got 1"),
    (lambda r: {"error": "x"}, r"expected a JSON list of 2 responses, got dict"),
])
def test_malformed_reply_names_the_field_and_server(fault, fn, pattern):
    fault.script = [mutate(fn)]
    with pytest.raises(MalformedResponseError, match=pattern) as ei:
        SGLangEngine(fault.url, retry=FAST_RETRY).generate([[1, 2]], SP, n=2)
    assert fault.url in str(ei.value)
    assert len(fault.generate_calls()) == 1, "malformed replies are not retried"


def test_aborted_request_fails_the_step(fault):
    fault.script = [mutate(_set(["meta_info", "finish_reason"], {"type": "abort", "message": "out of memory"}))]
    with pytest.raises(RolloutError, match="aborted.*out of memory"):
        SGLangEngine(fault.url, retry=FAST_RETRY).generate([[1, 2]], SP, n=2)


def test_stale_weight_version_is_detected(fault):
    fault.script = [ok(version="v1")]
    eng = SGLangEngine(fault.url, retry=FAST_RETRY, weight_version="v2")
    with pytest.raises(StaleRolloutError, match=r"weight_version='v1' but expected 'v2'"):
        eng.generate([[1, 2]], SP)
    # unknown expected version: learned from the first reply; a later change without update_weights is stale
    eng = SGLangEngine(fault.url, retry=FAST_RETRY)
    eng.generate([[1, 2]], SP)
    assert eng.weight_version == "v1"
    fault.script = [ok(version="v3")]
    with pytest.raises(StaleRolloutError, match="'v3' but expected 'v1'"):
        eng.generate([[1, 2]], SP)


def test_mixed_weight_versions_within_a_reply_are_stale(fault):
    def two_segments(reply):
        reply[0]["meta_info"]["weight_versions"] = [{"version": "v0", "start": 0, "end": 1},
                                                    {"version": "v1", "start": 1, "end": 3}]
        return reply
    fault.script = [mutate(two_segments)]
    with pytest.raises(StaleRolloutError, match="weight_versions has segment"):
        SGLangEngine(fault.url, retry=FAST_RETRY).generate([[1, 2]], SP, n=2)


def test_update_weights_sends_path_and_version_and_checks_it(fault, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    fault.script = [ok(version="s7")]
    eng = SGLangEngine(fault.url, retry=FAST_RETRY)
    eng.update_weights(str(tmp_path), "s7")
    posted = [b for p, b in fault.requests if p == "/update_weights_from_disk"]
    assert posted == [{"model_path": str(tmp_path), "weight_version": "s7"}]
    assert eng.weight_version == "s7" and eng.generate([[1]], SP)[0].weight_version == "s7"
    with pytest.raises(WeightSyncError, match="no config.json"):
        eng.update_weights(str(tmp_path / "missing"), "s8")
    assert len([p for p, _ in fault.requests if p == "/update_weights_from_disk"]) == 1


def test_health_and_readiness_deadline(fault):
    eng = SGLangEngine(fault.url)
    assert eng.health() == {fault.url: True}
    eng.wait_until_ready(timeout=2)
    dead = FaultServer()
    dead_url = dead.url
    dead.close()
    eng = SGLangEngine([fault.url, dead_url])
    assert eng.health() == {fault.url: True, dead_url: False}
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError, match=r"not ready after 1 s: \['" + dead_url):
        eng.wait_until_ready(timeout=1, poll=0.2)
    assert time.monotonic() - t0 < 4


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(temperature=math.nan), "temperature=nan"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_k=0), "top_k=0"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(stop_token_ids=(3, -1)), r"stop_token_ids\[1\]=-1"),
])
def test_bad_sampling_params_are_named(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_bad_prompts_rejected_before_any_request(fault):
    fault.script = [ok()]
    eng = SGLangEngine(fault.url, retry=FAST_RETRY, vocab_size=50)
    for prompts, pattern in [([], "non-empty list"), ([[1], []], r"prompt_ids\[1\] must be a non-empty"),
                             ([[1, 50]], r"prompt_ids\[0\]\[1\]=50 .*vocab_size=50"),
                             ([[1, -2]], r"prompt_ids\[0\]\[1\]=-2"), ([[1.5]], r"prompt_ids\[0\]\[0\]=1.5")]:
        with pytest.raises(ValueError, match=pattern):
            eng.generate(prompts, SP)
    with pytest.raises(ValueError, match="n=0"):
        eng.generate([[1]], SP, n=0)
    with pytest.raises(ValueError, match="must start with http"):
        SGLangEngine("127.0.0.1:30000")
    assert fault.generate_calls() == []


BUSY = {"success": False, "num_paused_requests": 0,
        "message": "Weights were updated, but the cache was not flushed because requests are still running or "
                   "queued. Retract or finish them, then call /flush_cache."}


def test_update_weights_retries_while_server_cannot_flush_its_cache(fault, tmp_path):
    """SGLang 0.5.23 answers 400 'cache was not flushed' when a just-finished request is still in its scheduler
    (seen with the real server right after a stop-token finish); the engine must retry until it succeeds."""
    (tmp_path / "config.json").write_text("{}")
    fault.update_script = [(400, BUSY), (400, BUSY)]
    eng = SGLangEngine(fault.url, retry=FAST_RETRY)
    eng.update_weights(str(tmp_path), "v5")
    assert len([p for p, _ in fault.requests if p == "/update_weights_from_disk"]) == 3
    assert eng.weight_version == "v5"


def test_update_weights_gives_up_on_a_real_failure_or_after_the_deadline(fault, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    fault.update_script = [(400, {"success": False, "message": "Failed to get weights iterator: bad file"})]
    eng = SGLangEngine(fault.url, retry=FAST_RETRY)
    with pytest.raises(WeightSyncError, match="did not load .* after 1 attempt.*bad file"):
        eng.update_weights(str(tmp_path), "v5")
    assert eng.weight_version is None
    fault.requests.clear()
    fault.update_script = [(400, BUSY)] * 100
    eng = SGLangEngine(fault.url, retry=FAST_RETRY, weight_sync_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="still busy"):
        eng.update_weights(str(tmp_path), "v6")
    assert time.monotonic() - t0 < 3

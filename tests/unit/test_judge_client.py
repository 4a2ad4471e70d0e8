"""EndpointClient against real local HTTP servers (http.server in threads): round-robin, retries on the next URL,
per-attempt timeouts, the concurrency bound, and named failures (never an exception)."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.tasks.judge_client import EndpointClient


class _Server:
    def __init__(self, mode="ok", delay=0.0):
        self.mode, self.delay, self.hits, self.inflight, self.peak = mode, delay, 0, 0, 0
        lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.hits += 1
                    outer.inflight += 1
                    outer.peak = max(outer.peak, outer.inflight)
                time.sleep(outer.delay)
                with lock:
                    outer.inflight -= 1
                if outer.mode == "500":
                    self.send_response(500); self.end_headers(); self.wfile.write(b"boom"); return
                if outer.mode == "400":
                    self.send_response(400); self.end_headers(); self.wfile.write(b"bad"); return
                data = b"not json" if outer.mode == "garbage" else json.dumps({"echo": body, "port": outer.port}).encode()
                self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
                self.wfile.write(data)

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass   # a client that timed out closed its end

        self.httpd = Quiet(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown(); self.httpd.server_close()


@pytest.fixture
def servers():
    made = []
    def make(**kw):
        s = _Server(**kw); made.append(s); return s
    yield make
    for s in made:
        s.close()


def test_round_robin_order_and_echo(servers):
    a, b = servers(), servers()
    c = EndpointClient([a.url, b.url], timeout_s=5, max_retries=0, max_concurrent=1)
    res = c.post_many("/x", [{"i": i} for i in range(6)])
    assert [r.body["echo"]["i"] for r in res] == list(range(6))
    assert [r.body["port"] for r in res] == [a.port, b.port] * 3
    assert all(r.ok and r.attempts == 1 for r in res)


def test_retry_goes_to_next_url(servers):
    bad, good = servers(mode="500"), servers()
    c = EndpointClient([bad.url, good.url], timeout_s=5, max_retries=1, max_concurrent=1, backoff_s=0)
    r = c.post("/x", {"q": 1})
    assert r.ok and r.attempts == 2 and r.body["port"] == good.port and bad.hits == 1


def test_failures_are_named_not_raised(servers):
    g, f4 = servers(mode="garbage"), servers(mode="400")
    c = EndpointClient([g.url], timeout_s=5, max_retries=1, backoff_s=0)
    r = c.post("/x", {})
    assert r.error_kind == "garbage" and r.attempts == 2 and g.url in r.error
    r = EndpointClient([f4.url], timeout_s=5, max_retries=3, backoff_s=0).post("/x", {})
    assert r.error_kind == "http" and r.attempts == 1 and f4.hits == 1       # a 4xx is not retried
    r = EndpointClient(["http://127.0.0.1:9"], timeout_s=2, max_retries=0).post("/x", {})
    assert r.error_kind == "unreachable" and not r.ok


def test_timeout_bounds_each_attempt(servers):
    slow = servers(delay=1.5)
    c = EndpointClient([slow.url], timeout_s=0.3, max_retries=1, backoff_s=0)
    t0 = time.monotonic()
    r = c.post("/x", {})
    assert r.error_kind == "timeout" and r.attempts == 2
    assert time.monotonic() - t0 < 1.4          # two 0.3 s attempts, not the server's 1.5 s


def test_concurrency_bound(servers):
    s = servers(delay=0.2)
    res = EndpointClient([s.url], timeout_s=5, max_concurrent=3).post_many("/x", [{}] * 9)
    assert all(r.ok for r in res) and s.peak == 3


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="reward.judge"):
        EndpointClient([], where="reward.judge")
    with pytest.raises(ValueError, match="max_concurrent=0"):
        EndpointClient(["http://x"], max_concurrent=0, where="reward.judge")


def test_trickling_server_is_cut_at_the_batch_bound():
    """A server that sends one byte per 0.2 s never trips a read timeout of 0.5 s; the batch still returns."""
    import socket
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            c.recv(65536)
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            while not stop.is_set():
                try:
                    c.sendall(b" ")
                except OSError:
                    break
                time.sleep(0.2)
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        c = EndpointClient([f"http://127.0.0.1:{srv.getsockname()[1]}"], timeout_s=0.5, max_retries=0)
        t0 = time.monotonic()
        r = c.post_many("/x", [{}])
        assert time.monotonic() - t0 < c.batch_bound_s(1) + 1.0 and c.batch_bound_s(1) == 1.5
        assert r[0].error_kind == "timeout" and "bound" in r[0].error
    finally:
        stop.set(); srv.close()


def test_headers_are_sent(servers):
    seen = {}

    s = servers()
    orig = s.httpd.RequestHandlerClass.do_POST

    def do_post(self):
        seen["auth"] = self.headers.get("Authorization")
        orig(self)
    s.httpd.RequestHandlerClass.do_POST = do_post
    assert EndpointClient([s.url], headers={"Authorization": "Bearer k"}).post("/x", {}).ok
    assert seen["auth"] == "Bearer k"

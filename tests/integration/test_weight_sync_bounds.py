"""Every weight-sync wait ends within ``rollout.weight_sync_timeout_s``; the trainer's address for the servers.

* A server that answers ``/update_weights_from_disk`` (or ``/weights_checker``) late — a small HTTP stub that
  sleeps, the one fault a real server cannot produce on demand — makes the sync fail within the configured
  bound (retries included), naming the server and the bound; after a failed disk load the engine refuses to
  generate (as after a failed in-memory sync).
* The loop's engine gets ``rollout.weight_sync_timeout_s``.
* ``master_address_for``: the address of the interface that routes to a remote server (reference:
  ``ip -4 route get``), never a loopback alias; 127.0.0.1 for servers on loopback.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_weight_sync_bounds.py -q``
"""
import json
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.rollout.base import SamplingParams, WeightSyncError
from megatron_rl.rollout.sglang_engine import RetryPolicy, SGLangEngine
from megatron_rl.weight_sync.transport import master_address_for

SLEEP_S = 30.0  # how late the stub answers the slow endpoints


class _LateServer(BaseHTTPRequestHandler):
    """Answers /get_model_info and /health at once, /update_weights_from_disk and /weights_checker after
    SLEEP_S seconds (then as a real server would)."""

    def log_message(self, *args):
        pass

    def _reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self):
        self.server.calls.append(self.path)
        self._reply({"weight_version": "step-0"})

    def do_POST(self):
        self.server.calls.append(self.path)
        n = int(self.headers.get("content-length") or 0)
        self.rfile.read(n)
        if self.path in ("/update_weights_from_disk", "/weights_checker"):
            time.sleep(SLEEP_S)
        self._reply({"success": True, "message": "Success."})


@pytest.fixture()
def late_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _LateServer)
    httpd.daemon_threads = True
    httpd.calls = []
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _hf_dir(tmp_path):
    d = tmp_path / "export"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


@pytest.mark.timeout(120)
def test_disk_load_ends_within_the_bound_and_invalidates(late_server, tmp_path):
    url = f"http://127.0.0.1:{late_server.server_address[1]}"
    bound = 2.0
    eng = SGLangEngine(url, weight_sync_timeout=bound, retry=RetryPolicy(max_attempts=4, backoff_initial=0.5))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"update_weights_from_disk.*weight_sync_timeout_s=2"):
        eng.update_weights(_hf_dir(tmp_path), "step-1")
    took = time.monotonic() - t0
    assert took < bound + 1.0, took  # retries included
    assert late_server.calls.count("/update_weights_from_disk") == 1
    with pytest.raises(WeightSyncError, match="will not generate"):
        eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))


@pytest.mark.timeout(120)
def test_weights_checker_ends_within_the_bound(late_server):
    url = f"http://127.0.0.1:{late_server.server_address[1]}"
    eng = SGLangEngine(url, weight_sync_timeout=2.0, retry=RetryPolicy(max_attempts=4, backoff_initial=0.5))
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"weights_checker"):
        eng.weight_checksums(["model.norm.weight"])
    assert time.monotonic() - t0 < 3.0


def test_loop_engine_gets_the_configured_bound():
    from megatron_rl.plan import load_job_config
    from megatron_rl.plan import job_engine as build_engine

    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_job_config(os.path.join(root, "configs", "qwen2.5_7b_1x8.yaml"), ["rollout.engine=sglang", "rollout.sglang_urls=[http://127.0.0.1:9]",
                                 "rollout.sglang_launch=false", "rollout.weight_sync_timeout_s=7.5"], world_size=8)
    engine, server = build_engine(cfg)
    assert server is None and engine.weight_sync_timeout == 7.5
    engine.close()


def _route_src(dst):
    out = subprocess.run(["ip", "-4", "route", "get", dst], capture_output=True, text=True).stdout.split()
    return out[out.index("src") + 1]


def test_master_address_routes_to_the_server():
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (ip) is not installed: no reference for the routing source address")
    default = subprocess.run(["ip", "-4", "route", "show", "default"], capture_output=True, text=True).stdout.split()
    if "via" not in default:
        pytest.skip("this machine has no default IPv4 route (no remote server address to route to)")
    remote = default[default.index("via") + 1]
    got = master_address_for([f"http://{remote}:30000"], None)
    assert got == _route_src(remote) and not got.startswith("127."), got
    assert master_address_for(["http://127.0.0.1:30000", "http://localhost:30001"], None) == "127.0.0.1"
    assert master_address_for([f"http://{remote}:30000"], "10.9.8.7") == "10.9.8.7"

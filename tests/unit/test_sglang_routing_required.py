"""``actor.routing_replay: r3`` with SGLang servers: the engine is refused when it is built (``rollout.factory``)
if a server does not capture routes, naming the server, the flag and the config key -- not after server
start-up and a whole rollout phase, at the first log-prob pass.

The servers here are stdlib HTTP stand-ins answering ``/server_info`` as SGLang 0.5.23 does (its
``enable_return_routed_experts`` and ``model_path`` fields); ``tests/integration/test_routing_sglang.py`` runs a
real server with the flag.
"""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.rollout.base import RolloutError
from megatron_rl.plan import job_engine as build_engine
from megatron_rl.testing.jobs import named_job, setting


class InfoServer:
    """Answers GET /server_info with ``info``; counts /generate calls (none may come)."""

    def __init__(self, info):
        self.generate_calls = 0
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                data = json.dumps(info).encode() if self.path == "/server_info" else b'{"detail":"Not Found"}'
                self.send_response(200 if self.path == "/server_info" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                srv.generate_calls += 1
                self.send_response(500)
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def moe_dir(tiny_hf_model):
    return tiny_hf_model("qwen3_moe", seed=3)


def test_r3_refuses_a_server_without_routed_experts_at_construction(moe_dir):
    capturing = InfoServer({"enable_return_routed_experts": True, "model_path": moe_dir})
    plain = InfoServer({"enable_return_routed_experts": False, "model_path": moe_dir})
    try:
        engine, _ = build_engine(named_job("sglang_actor", setting("rollout.sglang_urls", [capturing.url]),
                                           "rollout.max_retries=0", "actor.routing_replay=r3", hf=moe_dir))  # accepted
        assert engine._routing_for(capturing.url) is not None
        with pytest.raises(RolloutError) as err:
            build_engine(named_job("sglang_actor", setting("rollout.sglang_urls", [plain.url]), "rollout.max_retries=0",
                                   "actor.routing_replay=r3", hf=moe_dir))
        msg = str(err.value)
        assert plain.url in msg and "--enable-return-routed-experts" in msg and "actor.routing_replay" in msg
        assert plain.generate_calls == 0
        engine, _ = build_engine(named_job("sglang_actor", setting("rollout.sglang_urls", [plain.url]),
                                           "rollout.max_retries=0", "actor.routing_replay=none", hf=moe_dir))
        # without r3 nothing is required
        assert engine.capture_routing is None
    finally:
        capturing.close()
        plain.close()

"""Launcher failure paths with a REAL SGLang server process: the server fails to start (bad checkpoint), the
server is not ready before the deadline, bad arguments. Each error must be clear (exit code / log tail) and
arrive in bounded time; the process group must be gone afterwards. (The server-killed-mid-run test is the last
test of test_sglang_server.py, which reuses that module's server.)
Skipped (with the reason) only if sglang is not importable by the server interpreter.
Run: OMP_NUM_THREADS=1 pytest tests/integration/test_sglang_server_failures.py
"""
import json
import time

import pytest

from megatron_rl.rollout.sglang_server import ServerLaunchError, launch_sglang_server, sglang_available
from megatron_rl.testing.sglang_script import group_gone

_OK, _REASON = sglang_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=_REASON), pytest.mark.slow, pytest.mark.timeout(900)]


def test_bad_checkpoint_fails_launch_with_exit_code_and_log_tail(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"],
                                                 "model_type": "no_such_model"}))
    t0 = time.monotonic()
    with pytest.raises(ServerLaunchError, match=r"exited with code -?\d+ before becoming ready") as ei:
        launch_sglang_server(str(bad), device="cpu", log_path=str(tmp_path / "bad.log"), ready_timeout=600)
    assert "no_such_model" in str(ei.value) or "NoSuchModel" in str(ei.value), "log tail must be included"
    assert time.monotonic() - t0 < 300


def test_readiness_deadline_terminates_the_process_group(tmp_path, tiny_hf_model):
    model = tiny_hf_model("llama", seed=1)
    handle = launch_sglang_server(model, device="cpu", log_path=str(tmp_path / "s.log"), wait=False)
    try:
        with pytest.raises(ServerLaunchError, match=r"not ready after 1 s .*Log .*s\.log tail"):
            handle.wait_until_ready(timeout=1)
    finally:
        t0 = time.monotonic()
        handle.terminate(timeout=10)
    assert time.monotonic() - t0 < 30
    assert not handle.alive() and group_gone(handle.pid)


def test_launch_rejects_bad_arguments_before_starting(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        launch_sglang_server(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="device='tpu'"):
        launch_sglang_server(str(tmp_path), device="tpu")

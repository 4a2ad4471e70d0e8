"""launch/sglang_server.sh for real: the CPU development mode serves a tiny offline model, answers /health and
/generate with log-probs, and SIGTERM to the script's pid (the server, via exec) stops the server and its
scheduler / detokenizer children. Those children are forked from the server after it imported sglang
(``megatron_rl/platform/sglang_cpu/sitecustomize.py``): by the time the server is ready they used less CPU
together than the server itself (spawned, each imports sglang again: ~2x the server's).

Skipped (with the reason) when sglang is not importable by $MEGATRON_RL_SGLANG_PYTHON (or this interpreter);
start-up takes 20-90 s on 2 shared cores.
Run: OMP_NUM_THREADS=1 MEGATRON_RL_SGLANG_PYTHON=/path/to/sglang/python pytest tests/integration/test_launch_sglang_cpu.py
"""
import os
import signal
import subprocess
import time

import pytest

from megatron_rl.rollout.sglang_server import find_free_port, sglang_available

requests = pytest.importorskip("requests")
pytest.importorskip("transformers")

from megatron_rl.testing.sglang_script import start_server_script, wait_healthy  # noqa: E402

_OK, _REASON = sglang_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=_REASON), pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _children(pid):
    try:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    except OSError:
        return []
    return [int(x) for x in out.split()]


def _cpu_s(pid):
    """User + system CPU seconds of ``pid`` so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_cpu_server_via_launch_script(tmp_path, dense_model):
    port = find_free_port()
    log = tmp_path / "server.log"
    p = start_server_script(ROOT, dense_model, port, log)
    url = f"http://127.0.0.1:{port}"
    children = []
    try:
        wait_healthy(p, url, log, timeout=600, poll=2)
        # the script exec'ed the server: the pid we hold is python -m sglang.launch_server
        cmdline = open(f"/proc/{p.pid}/cmdline", "rb").read().split(b"\0")
        assert b"sglang.launch_server" in cmdline and b"--device" in cmdline
        env_of_server = dict(kv.split(b"=", 1) for kv in open(f"/proc/{p.pid}/environ", "rb").read().split(b"\0") if b"=" in kv)
        assert env_of_server[b"SGLANG_USE_CPU_ENGINE"] == b"1"
        children = _children(p.pid)
        assert children, "expected scheduler / detokenizer child processes"
        server_cpu, children_cpu = _cpu_s(p.pid), sum(map(_cpu_s, children))
        assert children_cpu < server_cpu, (f"the scheduler / detokenizer used {children_cpu:.1f} CPU-s by start-up, "
                                           f"the server {server_cpu:.1f}: were they spawned (sglang imported again)?")
        r = requests.post(url + "/generate", json={"input_ids": [5, 6, 7], "return_logprob": True,
                                                    "sampling_params": {"max_new_tokens": 3, "temperature": 1.0}},
                          timeout=120)
        assert r.status_code == 200, r.text
        lps = r.json()["meta_info"]["output_token_logprobs"]
        assert len(lps) == 3 and all(lp[0] <= 0.0 for lp in lps)
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)
    deadline = time.time() + 30
    while any(_alive(c) for c in children) and time.time() < deadline:
        time.sleep(0.5)
    survivors = [c for c in children if _alive(c)]
    for c in survivors:  # do not leak processes even when the assertion fails
        try:
            os.kill(c, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not survivors, "children survived SIGTERM to the server pid"

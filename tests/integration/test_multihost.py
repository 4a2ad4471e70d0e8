"""Several hosts on one machine, for real (issue 21, item 6): network namespaces with their own addresses
(``megatron_rl.testing.netns``), each with its own hostname and /etc/hosts laid out as on a default Debian host
(the other hosts' names resolve to their addresses, the host's own name to 127.0.1.1).

* ``test_two_hosts_torchrun_matches_one_host``: ``launch/torchrun.sh --nnodes 2`` on two hosts (1 rank each, c10d
  rendezvous at host 0's name) trains the tiny copy task with the embedded engine; its metrics equal those
  of the same job as 2 ranks on one host (launch/torchrun.sh outside the namespaces, same seed).
* ``test_sglang_server_on_its_own_host``: an SGLang server started with ``launch/sglang_server.sh`` on host 2,
  the trainer on hosts 0 and 1, ``rollout.weight_sync=distributed``: the servers reach trainer rank 0 at its
  host address (found by the master-address function, not configured), both steps run, step 2's rollouts come
  from the synced weights, and step 1's mismatch KL equals HF transformers' fp32 recompute.

gloo finds its interface through ``GLOO_SOCKET_IFNAME=eth0`` (each host's own name resolves to 127.0.1.1).
Skipped with the reason where network namespaces cannot be made (no iproute2, not root).
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from megatron_rl.rollout.sglang_server import find_free_port, sglang_available, sglang_python
from megatron_rl.testing.netns import NetnsHosts, netns_unavailable
from tests.integration.test_slurm_real import CONFIG, TINY, metric_differences, read_metrics
from tests.integration.test_slurm_real import tiny_reference  # noqa: F401  (a fixture)
from tests.integration.test_train_loop_sglang import _assert_step1_kl_matches_hf_fp32

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_NO_NETNS = netns_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_NO_NETNS is not None, reason=str(_NO_NETNS))]
_HOST_ENV = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
#: ``python -S -c _PROBE URL TIMEOUT``: poll URL every 0.5 s until it answers 200 (exit 0) or TIMEOUT s pass (exit 1)
_PROBE = """import sys, time, urllib.request
url, deadline, last = sys.argv[1], time.monotonic() + float(sys.argv[2]), None
while time.monotonic() < deadline:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=5) as r:
            if r.status == 200:
                sys.exit(0)
            last = r.status
    except OSError as e:
        last = e
    time.sleep(0.5)
sys.exit(f"{url}: no 200 within {sys.argv[2]} s (last: {last})")
"""


def _train_on_hosts(hosts, tmp, overrides, timeout, meanwhile=lambda: None, check=True):
    """launch/torchrun.sh --nnodes 2 on hosts 0 and 1 (c10d rendezvous at host 0), ``meanwhile()`` called while
    it runs; returns the run's metrics and directory. ``check``: host 0's launcher checks the job's config first
    (host 1's check would be the same one: CHECK=0 there)."""
    run = tmp / "run"
    rdzv = f"{hosts.hostname(0)}:{find_free_port()}"   # as on a cluster: the first node's name
    procs = []
    for i in (0, 1):
        log = open(tmp / f"node{i}.out", "w")
        procs.append(hosts.popen(i, ["bash", os.path.join(ROOT, "launch", "torchrun.sh"), "--nnodes", "2",
                                     "--nproc-per-node", "1", "--rdzv-endpoint", rdzv, "--rdzv-id", "mh",
                                     "--log-dir", str(tmp / f"logs{i}"), "--config", CONFIG, *TINY,
                                     f"trainer.run_dir={run}", *overrides],
                                 env=dict(_HOST_ENV, CHECK="1" if check and i == 0 else "0"), cwd=ROOT, stdout=log,
                                 stderr=subprocess.STDOUT))
        log.close()
    deadline = time.monotonic() + timeout
    try:
        meanwhile()
    except BaseException:
        hosts.stop_processes()
        raise
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            hosts.stop_processes()
            pytest.fail(f"2-host job not done after {timeout} s:\n{_outs(tmp)}")
        time.sleep(1)
    assert [p.returncode for p in procs] == [0, 0], _outs(tmp)
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2], _outs(tmp)
    return metrics, run


def _outs(tmp):
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(tmp.glob("node*.out")))


@pytest.mark.timeout(1200)
def test_two_hosts_torchrun_matches_one_host(tmp_path, tiny_reference):
    with NetnsHosts(2) as hosts:   # the reference job runs (unless another test made it already) beside this one
        got, _ = _train_on_hosts(hosts, tmp_path, [f"actor.load_hf={tiny_reference.model}"], timeout=600,
                                 meanwhile=tiny_reference.metrics)
    ref = tiny_reference.metrics()
    assert not metric_differences(got, ref), metric_differences(got, ref)


@pytest.mark.timeout(1200)
@pytest.mark.skipif(not sglang_available()[0], reason=sglang_available()[1])
def test_sglang_server_on_its_own_host(tmp_path, tiny_reference):
    model = tiny_reference.model
    port = find_free_port()
    with NetnsHosts(3) as hosts:
        url = f"http://{hosts.addr(2)}:{port}"
        slog = tmp_path / "server.log"
        server = hosts.popen(2, ["bash", os.path.join(ROOT, "launch", "sglang_server.sh"), "--model", model,
                                 "--device", "cpu", "--host", "0.0.0.0", "--port", str(port), "--log", str(slog),
                                 "--", "--random-seed", "0"],
                             env=dict(_HOST_ENV, MEGATRON_RL_SGLANG_PYTHON=sglang_python()), cwd=ROOT)
        # readiness, probed from host 0 (the trainer's side of the bridge) by one interpreter that polls /health
        # itself (stdlib only), while this loop watches the server process
        probe = hosts.popen(0, [sys.executable, "-S", "-c", _PROBE, f"{url}/health", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while probe.poll() is None:
            assert server.poll() is None, f"server exited {server.returncode}:\n{slog.read_text()[-3000:]}"
            time.sleep(1)
        assert probe.returncode == 0, f"server not ready:\n{probe.stdout.read()}\n{slog.read_text()[-3000:]}"
        metrics, run = _train_on_hosts(hosts, tmp_path, [
            f"actor.load_hf={model}", "rollout.engine=sglang", f'rollout.sglang_urls=["{url}"]',
            "rollout.weight_sync=distributed", "trainer.dump_rollouts=true"], timeout=700,
            check=False)   # the launcher's config check is the first test's (it has no part in this one's claims)
        server_text = slog.read_text()
    with open(run / "rollouts.jsonl") as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    assert {r["weight_version"] for r in recs if r["step"] == 2} == {"step-1"}
    assert metrics[0]["weight_sync/verified"] == 1 or metrics[1]["weight_sync/verified"] == 1
    used = set(re.findall(r"init custom process group: master_address=([^,\s]+)", server_text))
    assert used and used <= {hosts.addr(0), hosts.addr(1)}, used   # a trainer host's own address, not loopback
    _assert_step1_kl_matches_hf_fp32(model, metrics, recs)

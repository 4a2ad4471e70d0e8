"""Processes the project starts do not inherit the launcher's rendezvous variables (issue 21, item 1).

Reference for "what the launcher adds": the environment torchrun itself gives a worker (a real
``torch.distributed.run`` of a script that dumps ``os.environ``), compared with the parent's. Then the real
children: an SGLang server from ``launch_sglang_server`` and from ``launch/sglang_server.sh`` (their
``/proc/<pid>/environ`` read right after start; stopped by pid before they are ready) and a reward worker.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.parallel.child_env import child_environment, launcher_variables

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(300)

#: What torchrun adds that is not rendezvous: the locale Python sets and NCCL's error-handling switch.
_BENIGN = {"LC_CTYPE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS"}

#: A trainer rank's environment under torchrun inside a Slurm step (the variables the issue measured).
_LAUNCHER = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
             "ROLE_RANK": "1", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511",
             "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x", "SLURM_PROCID": "0",
             "SLURM_JOB_ID": "7", "SLURM_NODELIST": "n[1-2]", "PMI_RANK": "0", "PMIX_RANK": "0"}


def _environ_of(pid: int, timeout: float = 120.0) -> dict:
    """``/proc/<pid>/environ`` once the process runs ``sglang.launch_server`` or the reward worker (after exec)."""
    deadline = time.monotonic() + timeout
    while True:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        if cmd.split(b"\0")[1:3] in ([b"-m", b"sglang.launch_server"], [b"-m", b"megatron_rl.tasks.reward_worker"]):
            break   # exec'd into the server / worker itself (not the bash or child_env.py stage before it)
        assert time.monotonic() < deadline, f"pid {pid} still runs {cmd!r} after {timeout} s"
        time.sleep(0.05)
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def test_strips_everything_torchrun_adds(tmp_path):
    script = tmp_path / "dump.py"
    script.write_text("import json, os, sys\njson.dump(dict(os.environ), open(sys.argv[1], 'w'))\n")
    out = tmp_path / "env.json"
    parent = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                        str(script), str(out)], env=parent, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    worker = json.loads(out.read_text())
    added = set(worker) - set(parent)
    assert {"RANK", "MASTER_ADDR", "TORCHELASTIC_USE_AGENT_STORE"} <= added   # the reference is real torchrun
    kept = set(child_environment(base=worker)) & added
    assert kept <= _BENIGN, f"launcher variables a child would inherit: {sorted(kept - _BENIGN)}"
    assert child_environment({"MASTER_PORT": "1"}, base=worker)["MASTER_PORT"] == "1"   # explicit extras win
    assert set(launcher_variables(worker)) == added - _BENIGN


def test_launch_sglang_server_gets_a_clean_environment(tmp_path, monkeypatch, dense_model):
    from megatron_rl.rollout.sglang_server import find_free_port, launch_sglang_server
    model = dense_model
    for k, v in _LAUNCHER.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MY_SETTING", "kept")
    server = launch_sglang_server(str(model), port=find_free_port(), device="cpu", wait=False,
                                  python=sys.executable, env={"EXTRA_FOR_SERVER": "1"})
    try:
        env = _environ_of(server.pid)
    finally:
        server.terminate(timeout=5)
    assert not launcher_variables(env), f"server inherited {launcher_variables(env)}"
    assert env["MY_SETTING"] == "kept" and env["EXTRA_FOR_SERVER"] == "1" and env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_sglang_server_script_finds_venv_and_cleans_environment(tmp_path, dense_model):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_SGLANG_PYTHON"}
    dry = subprocess.run(["bash", os.path.join(ROOT, "launch", "sglang_server.sh"), "--model", "/m", "--device",
                          "cpu"], env=dict(env, DRY_RUN="1"), capture_output=True, text=True, timeout=30)
    venv = os.path.join(ROOT, ".venv", "bin", "python")
    expected = venv if os.access(venv, os.X_OK) else "python3"
    assert f" {expected} -m sglang.launch_server " in dry.stdout, dry.stdout + dry.stderr

    model = dense_model
    p = subprocess.Popen(["bash", os.path.join(ROOT, "launch", "sglang_server.sh"), "--model", str(model),
                          "--device", "cpu", "--port", "1", "--log", str(tmp_path / "s.log")],
                         env=dict(env, **_LAUNCHER, MEGATRON_RL_SGLANG_PYTHON=sys.executable),
                         start_new_session=True)
    try:
        got = _environ_of(p.pid)
        cmd = open(f"/proc/{p.pid}/cmdline", "rb").read()
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    assert b"sglang.launch_server" in cmd            # exec'd: the script's pid is the server's
    assert not launcher_variables(got), f"server inherited {launcher_variables(got)}"
    assert got["SGLANG_USE_CPU_ENGINE"] == "1"


def test_reward_worker_gets_a_clean_environment(monkeypatch):
    from megatron_rl.tasks.reward_pool import _Worker

    for k, v in _LAUNCHER.items():
        monkeypatch.setenv(k, v)
    w = _Worker()
    try:
        env = _environ_of(w.proc.pid)
    finally:
        w.kill()
    assert not launcher_variables(env), f"reward worker inherited {launcher_variables(env)}"
    assert env["OMP_NUM_THREADS"] == "1"

"""SGLang servers for tests: started the way a user does (``bash launch/sglang_server.sh``) and waited for until
healthy, or through ``launch_sglang_server`` for the length of a module fixture (``served``), or shared by the
tests of a module or session fixture and started again when a test killed it (``SharedServer``).

``group_gone`` checks, independently of a server handle, that none of a process group is left. Used by the tests of
the launch script itself and of jobs that talk to an external server. The script execs ``python -m
sglang.launch_server``, so the returned ``Popen``'s pid is the server's.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import requests

from megatron_rl.rollout.sglang_server import SGLangServerHandle, group_members, launch_sglang_server, sglang_python
from megatron_rl.testing import processes


def start_server_script(root: str, model: str | os.PathLike, port: int, log: str | os.PathLike,
                        new_session: bool = False) -> subprocess.Popen:
    """``bash ROOT/launch/sglang_server.sh --model MODEL --device cpu --port PORT --log LOG -- --random-seed 0``
    (``OMP_NUM_THREADS=1``; in a new session with ``new_session``)."""
    env = dict(os.environ, MEGATRON_RL_SGLANG_PYTHON=sglang_python(), OMP_NUM_THREADS="1")
    return subprocess.Popen(["bash", os.path.join(root, "launch", "sglang_server.sh"), "--model", str(model),
                             "--device", "cpu", "--port", str(port), "--log", str(log), "--", "--random-seed", "0"],
                            env=env, cwd=root, start_new_session=new_session)


def wait_healthy(proc: subprocess.Popen, url: str, log, timeout: float, poll: float) -> None:
    """Poll ``url``/health every ``poll`` s until it answers 200; ``AssertionError`` (with the log's tail) if the
    server exits or is not ready within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"server not ready after {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(poll)


def group_gone(pgid: int) -> bool:
    """No live process left in the group (from /proc, then a signal-0 probe of each survivor)."""
    for pid in group_members(pgid):
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            pass
    return True


def served(model_dir: str | os.PathLike, log_dir: str | os.PathLike, **launch: Any) -> Iterator:
    """For a fixture (``yield from served(...)``): a CPU server for ``model_dir`` (``launch_sglang_server`` with
    ``launch``; its log in ``log_dir/server.log``), its handle yielded, terminated afterwards."""
    handle = launch_sglang_server(str(model_dir), device="cpu", log_path=str(Path(log_dir) / "server.log"), **launch)
    try:
        yield handle
    finally:
        handle.terminate()


class SharedServer:
    """A CPU server for ``model_dir`` shared by the tests of a fixture: started by the first test that asks for it
    (``get``), started again when an earlier test killed it, terminated by ``close``. While open (``with``), its
    processes belong to the fixture, not to the test that happened to start it (``processes.shared``). A test that
    changes its weights leaves them for the next one: each user loads the weights it needs first."""

    def __init__(self, model_dir: str | os.PathLike, log_dir: str | os.PathLike, **launch: Any):
        #: the HF directory served
        self.model_dir = str(model_dir)
        #: where each start's log goes (``server<N>.log``)
        self.log_dir = Path(log_dir)
        #: ``launch_sglang_server`` keyword arguments (``device="cpu"`` always)
        self.launch = launch
        #: the current server (None before the first ``get``)
        self.handle: SGLangServerHandle | None = None
        #: how many servers were started
        self.starts = 0

    def get(self) -> SGLangServerHandle:
        """The live server, started (again) if there is none."""
        if self.handle is None or not self.handle.alive():
            if self.handle is not None:
                self.handle.terminate()
            log = self.log_dir / f"server{self.starts}.log"
            self.starts += 1
            self.handle = launch_sglang_server(self.model_dir, device="cpu", log_path=str(log), **self.launch)
        return self.handle

    def job_overrides(self) -> tuple:
        """A job's overrides that make it use this (live) server instead of launching one."""
        return "rollout.sglang_launch=false", f'rollout.sglang_urls=["{self.get().url}"]'

    def close(self) -> None:
        if self.handle is not None:
            self.handle.terminate()
            self.handle = None

    def __enter__(self) -> "SharedServer":
        self._shared = processes.shared(lambda: [self.handle.pid] if self.handle is not None else [])
        self._shared.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            self._shared.__exit__(None, None, None)


def server_checksums(url: str) -> list:
    """A server's per-tensor checksums, one dict per TP rank (``/weights_checker``)."""
    r = requests.post(url + "/weights_checker", json={"action": "checksum"}, timeout=120).json()
    assert r["success"], r
    return [x["checksums"] for x in r["ranks"]]


def load_from_disk(url: str, path: str, version: str) -> None:
    """Make the server load the HF directory ``path`` as ``version`` (``/update_weights_from_disk``)."""
    r = requests.post(url + "/update_weights_from_disk", json={"model_path": path, "weight_version": version},
                      timeout=300).json()
    assert r["success"], r

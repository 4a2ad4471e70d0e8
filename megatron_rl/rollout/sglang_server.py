"""Start and stop a local SGLang server process (``python -m sglang.launch_server``) for rollouts and tests.

``launch_sglang_server(model_dir, port, device, extra_args)`` starts the server on 127.0.0.1 in its own process
group (the server forks scheduler / detokenizer children), captures its output to a log file, waits until
``GET /health`` answers 200, and returns an ``SGLangServerHandle``. The handle terminates the whole group by
its id (SIGTERM, then SIGKILL) — never by process name — and works as a context manager. Every error includes
the tail of the server log.

On ``device="cpu"`` it sets ``SGLANG_USE_CPU_ENGINE=1`` (mandatory on CPU) and prepends the import-only
stand-ins of ``megatron_rl/platform/sglang_cpu`` (``sgl_kernel``, text-only ``torchvision``) to the server's
``PYTHONPATH`` — only for this subprocess. The server's environment is ``child_environment()``: the trainer's
without the launcher's rendezvous variables (under torchrun the server otherwise waits forever at "Init parallel
begin"); ``env`` is applied on top.

The server's interpreter is ``$MEGATRON_RL_SGLANG_PYTHON`` if set (sglang installed in a separate venv), else
the current one. For an MoE checkpoint it adds ``--enable-return-routed-experts`` (the server returns each
token's routed experts when a request asks: MoE routing replay R3; ``return_routed_experts`` overrides).
Usage::

    with launch_sglang_server("/tmp/tiny", port=find_free_port(), device="cpu") as server:
        engine = SGLangEngine(server.url)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import requests

from megatron_rl.convert.storage import read_hf_config
from megatron_rl.parallel.child_env import child_environment
from megatron_rl.parallel.ports import find_free_port
from megatron_rl.rollout.sglang_routing import ROUTED_EXPERTS_FLAG, hf_config_is_moe
from megatron_rl.weight_sync.server_loader import SERVER_FLAGS

#: Directory holding the CPU-only import stand-ins (prepended to the server's PYTHONPATH on CPU).
CPU_STANDIN_DIR = str(Path(__file__).resolve().parent.parent / "platform" / "sglang_cpu")
#: ``--mem-fraction-static`` by device (launch/sglang_server.sh has the same defaults; tests/integration/test_launch.py
#: holds them equal). On CPU SGLang sizes the KV cache as ``available_after_load - (1 - f) * available_before_load``
#: of *host* memory: with f = 0.05, another process allocating ~1 GB while the model loads left "no memory for the
#: KV cache" (seen in CI with two test workers). f = 0.3 tolerates a 30 % swing; the pool itself is capped below.
MEM_FRACTION_STATIC = {"cpu": 0.3, "cuda": 0.85}
#: ``--mem-fraction-static`` of a server sharing its GPU with a trainer rank (``rollout.sglang_launch``; the same
#: as launch/slurm.sbatch's colocated servers): the rest is the trainer's
COLOCATED_CUDA_MEM_FRACTION = 0.4
#: ``--max-total-tokens`` on CPU when the caller sets none: the KV pool a tiny model needs (a few MB), not 30 % of RAM
CPU_MAX_TOTAL_TOKENS = 65536


class ServerLaunchError(RuntimeError):
    """The SGLang server exited or did not become ready; the message ends with the log tail."""


def sglang_python() -> str:
    """The interpreter used to run the server: ``$MEGATRON_RL_SGLANG_PYTHON`` or ``sys.executable``."""
    return os.environ.get("MEGATRON_RL_SGLANG_PYTHON") or sys.executable


def sglang_available(python: str | None = None) -> tuple[bool, str]:
    """Whether ``sglang`` is importable by ``python`` (default ``sglang_python()``): ``(ok, reason)``."""
    python = python or sglang_python()
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        import importlib.util

        ok = importlib.util.find_spec("sglang") is not None
    else:
        try:
            ok = subprocess.run([python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"],
                                capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, f"cannot run {python}: {e}"
    if ok:
        return True, ""
    return False, (f"sglang is not installed for {python} (install it with tools/install_sglang_cpu.sh, or point "
                   "MEGATRON_RL_SGLANG_PYTHON at an interpreter that has it)")


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid`` (Linux ``/proc``; elsewhere: ``[pgid]`` if it exists)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


@dataclass
class SGLangServerHandle:
    """A running SGLang server started by ``launch_sglang_server``."""

    #: The server process (leader of its own process group).
    process: subprocess.Popen
    #: Base URL, e.g. ``http://127.0.0.1:30000``.
    url: str
    #: TCP port.
    port: int
    #: File receiving the server's stdout and stderr.
    log_path: str
    #: The model directory it serves.
    model_dir: str
    #: The full command line.
    command: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """Process id of the server (also its process-group id)."""
        return self.process.pid

    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        return _tail(self.log_path, lines)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)  # the group we created with start_new_session=True
        except ProcessLookupError:
            pass

    def _wait_group_gone(self, timeout: float) -> list[int]:
        """Wait until no live process is left in the server's group; return the survivors (empty if none)."""
        deadline = time.monotonic() + timeout
        while True:
            left = group_members(self.process.pid)
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server's process group immediately (fault injection in tests) and wait for it to go."""
        self._signal_group(signal.SIGKILL)
        self.process.wait(timeout=30)
        self._wait_group_gone(30)

    def terminate(self, timeout: float = 20.0) -> int | None:
        """Stop the server's process group: SIGTERM, wait up to ``timeout`` s, then SIGKILL. Returns the exit code."""
        if self.alive():
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        # children (scheduler, detokenizer) may outlive the leader; the group id is still ours
        if group_members(self.process.pid):
            self._signal_group(signal.SIGKILL)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._wait_group_gone(10)
        return self.process.returncode

    def wait_until_ready(self, timeout: float) -> None:
        """Poll ``/health`` until 200; raise ``ServerLaunchError`` (with the log tail) if the process exits or
        ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        last = "no reply yet"
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerLaunchError(f"SGLang server (pid {self.pid}, {self.url}) exited with code {code} "
                                        f"before becoming ready. Log {self.log_path} tail:\n{self.log_tail()}")
            try:
                r = requests.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except (requests.ConnectionError, requests.Timeout) as e:
                last = type(e).__name__
            if time.monotonic() >= deadline:
                raise ServerLaunchError(f"SGLang server (pid {self.pid}, {self.url}) not ready after {timeout:.0f} s "
                                        f"(last /health: {last}). Log {self.log_path} tail:\n{self.log_tail()}")
            time.sleep(0.5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.terminate()


def launch_sglang_server(model_dir: str, port: int | None = None, device: str = "cpu",
                         extra_args: Sequence[str] = (), *, python: str | None = None, host: str = "127.0.0.1",
                         dtype: str = "bfloat16", mem_fraction_static: float | None = None,
                         max_total_tokens: int | None = None, log_path: str | None = None,
                         ready_timeout: float = 300.0, env: dict[str, str] | None = None,
                         wait: bool = True, return_routed_experts: bool | None = None,
                         delta_loader: bool = False) -> SGLangServerHandle:
    """Start ``python -m sglang.launch_server`` serving ``model_dir`` and (by default) wait until it is ready.

    Args:
        model_dir: HF checkpoint directory (config.json, safetensors, tokenizer).
        port: TCP port; default: a free one.
        device: ``"cpu"`` (adds ``--device cpu --sleep-on-idle``, ``SGLANG_USE_CPU_ENGINE=1`` and the import
            stand-ins) or ``"cuda"``.
        extra_args: more ``launch_server`` flags (e.g. ``["--random-seed", "0"]``).
        python: interpreter that has sglang (default ``sglang_python()``).
        host: bind address (127.0.0.1 by default).
        dtype: ``--dtype`` (bfloat16, as served in production).
        mem_fraction_static: ``--mem-fraction-static`` (share of memory for weights + KV cache); None:
            ``MEM_FRACTION_STATIC[device]``.
        max_total_tokens: ``--max-total-tokens`` cap on the KV-cache pool; None: ``CPU_MAX_TOTAL_TOKENS`` on CPU,
            SGLang's own sizing on CUDA.
        log_path: where to write the server's output (default: a new temp file).
        ready_timeout: seconds to wait for ``/health``.
        env: extra environment variables for the server (on top of ``child_environment()``).
        wait: wait for readiness before returning.
        return_routed_experts: add ``--enable-return-routed-experts`` (capture MoE routing for R3; on CPU the
            ``sitecustomize`` stand-in lets its host buffer be allocated). None: when ``config.json`` is MoE.
        delta_loader: register the delta-sync loader (``rollout.weight_sync_delta``; ``SERVER_FLAGS``).

    Raises:
        FileNotFoundError: ``model_dir`` has no config.json.
        ServerLaunchError: the server exited or was not ready in time (includes the log tail); the process
            group is terminated first.
    """
    model_dir = os.path.abspath(model_dir)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"launch_sglang_server: {model_dir} is not an HF model directory (no config.json)")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"launch_sglang_server: device={device!r} must be 'cpu' or 'cuda'")
    port = port or find_free_port(host)
    python = python or sglang_python()
    if mem_fraction_static is None:
        mem_fraction_static = MEM_FRACTION_STATIC[device]
    if max_total_tokens is None and device == "cpu":
        max_total_tokens = CPU_MAX_TOTAL_TOKENS
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", host, "--port", str(port),
           "--skip-server-warmup", "--dtype", dtype, "--mem-fraction-static", str(mem_fraction_static)]
    if max_total_tokens is not None:
        if int(max_total_tokens) < 1:
            raise ValueError(f"launch_sglang_server: max_total_tokens={max_total_tokens!r} must be >= 1")
        cmd += ["--max-total-tokens", str(int(max_total_tokens))]
    if device == "cpu":
        # an idle CPU scheduler polls its sockets in a busy loop (most of a core); asleep it wakes on a request
        cmd += ["--device", "cpu", "--sleep-on-idle"]
    if return_routed_experts is None:
        return_routed_experts = hf_config_is_moe(read_hf_config(model_dir))
    if return_routed_experts and ROUTED_EXPERTS_FLAG not in extra_args:
        cmd.append(ROUTED_EXPERTS_FLAG)
    if delta_loader:  # our delta-sync loader (off by default: a custom loader turns off SGLang's fast CUDA load)
        cmd += list(SERVER_FLAGS)
    cmd += list(extra_args)

    server_env = child_environment()  # without torchrun's / Slurm's rendezvous variables (it hangs with them)
    server_env.setdefault("OMP_NUM_THREADS", "1")
    if device == "cpu":
        server_env["SGLANG_USE_CPU_ENGINE"] = "1"
        server_env["PYTHONPATH"] = os.pathsep.join(p for p in (CPU_STANDIN_DIR, server_env.get("PYTHONPATH")) if p)
    server_env.update(env or {})

    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"sglang_{port}_", suffix=".log")
        os.close(fd)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=server_env, start_new_session=True)
    handle = SGLangServerHandle(process=proc, url=f"http://{host}:{port}", port=port, log_path=log_path,
                                model_dir=model_dir, command=cmd)
    if wait:
        try:
            handle.wait_until_ready(ready_timeout)
        except BaseException:
            handle.terminate(timeout=5)
            raise
    return handle

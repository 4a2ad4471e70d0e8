"""Several hosts on one machine for tests: Linux network namespaces joined by a bridge, each with its own address.

``NetnsHosts(n)`` creates ``n`` namespaces (unique names ``mrl<id>h<i>``), a bridge ``mrl<id>br`` in the root
namespace and one veth pair per host (the host's end is ``eth0``, address ``10.<a>.<b>.<i+1>/24``, loopback up).
A host reaches the others only through its ``eth0`` address — as on a cluster. Each host has its own hostname
(its namespace name, set in a UTS namespace per command) and its own ``/etc/hosts`` (``ip netns exec`` mounts
``/etc/netns/<name>/hosts``) laid out as on a default Debian/Ubuntu host: the other hosts' names resolve to their
addresses, the host's own name to ``127.0.1.1`` — the trap a multi-host launch must avoid (a process that
advertises its own hostname's address is unreachable from the other hosts; gloo needs ``GLOO_SOCKET_IFNAME=eth0``).
``popen(i, argv)`` starts a process inside host ``i`` (own process group, tracked); ``close()`` stops the tracked
processes by pid and deletes the namespaces and the bridge. ``netns_unavailable()`` returns the reason a test
must skip (no ``ip`` command, not root, or the kernel refuses namespaces / veth / bridges), or None.

Usage::

    with NetnsHosts(3) as hosts:
        p = hosts.popen(0, ["python", "-m", "http.server", "--bind", hosts.addr(0)])
        hosts.run(1, ["curl", f"http://{hosts.addr(0)}:8000/"])
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from typing import Optional, Sequence

from megatron_rl.parallel.child_env import child_environment

__all__ = ["NetnsHosts", "netns_unavailable"]

#: ``ip netns exec NAME`` bind-mounts the files of ``/etc/netns/NAME/`` over ``/etc`` (iproute2 convention).
_ETC_NETNS = "/etc/netns"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def netns_unavailable() -> Optional[str]:
    """Why several namespaced hosts cannot be made here (None when they can): tries a namespace and a veth."""
    if not shutil.which("ip"):
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    try:
        with NetnsHosts(1):
            pass
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return f"network namespaces / veth / bridge not usable here: {e}"
    return None


class NetnsHosts:
    """``n`` network-namespace hosts on one bridge (see the module docstring)."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"NetnsHosts: n={n} must be >= 1")
        self.n = n
        self.id = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        self.names = [f"mrl{self.id}h{i}" for i in range(n)]
        self.bridge = f"mrl{self.id}br"
        a, b = random.randrange(16, 250), random.randrange(0, 250)
        self._prefix = f"10.{a}.{b}"
        self.procs: list[subprocess.Popen] = []
        self._made_ns: list[str] = []
        self._made_bridge = False

    def hostname(self, i: int) -> str:
        """Host ``i``'s name (resolves to its address on the other hosts, to 127.0.1.1 on itself)."""
        return self.names[i]

    def addr(self, i: int) -> str:
        """Host ``i``'s address."""
        return f"{self._prefix}.{i + 1}"

    def open(self) -> "NetnsHosts":
        """Create the bridge, the namespaces and their veth links (everything is removed again on failure)."""
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made_bridge = True
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                self._made_ns.append(ns)
                outer = f"mrl{self.id}v{i}"
                _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            for i, ns in enumerate(self.names):
                etc = os.path.join(_ETC_NETNS, ns)
                os.makedirs(etc, exist_ok=True)
                others = "".join(f"{self.addr(j)} {other}\n" for j, other in enumerate(self.names) if j != i)
                with open(os.path.join(etc, "hosts"), "w") as fh:
                    fh.write(f"127.0.0.1 localhost\n127.0.1.1 {ns}\n{others}")
        except BaseException:
            self.close()
            raise
        return self

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``i`` (its network namespace, hostname and /etc/hosts)."""
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.names[i], *argv]

    def popen(self, i: int, argv: Sequence[str], env: Optional[dict] = None, **kw) -> subprocess.Popen:
        """Start ``argv`` inside host ``i`` in its own process group (stopped by ``close``). ``env`` is added to
        ``child_environment()`` (no launcher variables of the caller leak in)."""
        p = subprocess.Popen(self.command(i, argv), env=child_environment(env), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], timeout: float = 60, env: Optional[dict] = None
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``i`` to completion (bounded by ``timeout``)."""
        return subprocess.run(self.command(i, argv), env=child_environment(env), capture_output=True, text=True,
                              timeout=timeout)

    def stop_processes(self, grace: float = 10.0) -> None:
        """SIGTERM every tracked process group, SIGKILL what is left after ``grace`` seconds."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)   # the group may outlive its leader (servers fork children)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()

    def close(self) -> None:
        """Stop the tracked processes, delete the namespaces (their veth ends go with them) and the bridge."""
        self.stop_processes()
        for ns in reversed(self._made_ns):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(os.path.join(_ETC_NETNS, ns), ignore_errors=True)
        self._made_ns.clear()
        if self._made_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._made_bridge = False

    def __enter__(self) -> "NetnsHosts":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

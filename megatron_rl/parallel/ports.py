"""Free TCP ports for the processes a job starts or connects (SGLang servers, weight-update groups' stores).

The one rule: ports are drawn below the kernel's ephemeral range, where only an explicit bind takes a port.
"""
from __future__ import annotations

import random
import socket

__all__ = ["find_free_port"]

#: where ``find_free_port`` looks first: below the kernel's ephemeral range, which ``bind(port 0)`` and ``connect()``
#: draw from (a port picked there and bound seconds later can be taken meanwhile by any process's gloo listener,
#: store or outgoing connection), and below SGLang's own pick for its scheduler (22000-29999)
_PORT_RANGE = (10000, 21999)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (SGLang also uses a few ports above it), drawn at random below
    the ephemeral range (``_PORT_RANGE``) where only an explicit bind takes a port; from the kernel (port 0) when
    that range is unusable here."""
    low, high = _PORT_RANGE[0], min(_PORT_RANGE[1], _ephemeral_low() - 5)
    if high - low >= 1000:
        for port in random.sample(range(low, high + 1), 64):
            if all(_port_free(host, port + d) for d in range(4)):
                return port
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port < 60000 and all(_port_free(host, port + d) for d in range(1, 4)):
            return port
    raise RuntimeError("could not find a free TCP port")


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False

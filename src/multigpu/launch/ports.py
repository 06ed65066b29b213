"""Ports: find a free one, and refuse a taken one before any process starts.

Why: a fixed rendezvous port that another job holds makes torch fail deep inside the agent (or, with
c10d, join the other job's store). Checking first turns that into one clear line.
"""

from __future__ import annotations

import errno
import random
import socket

from multigpu.errors import LaunchError
from multigpu.fileio import Folder

#: Where :func:`free_port` looks first: below the kernel's ephemeral range, from here up.
LOW_PORT = 20000


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now, for a store that is bound a few seconds later (``--simulate-nodes``' node 0).

    Drawn below the kernel's ephemeral range (``ip_local_port_range``), where the kernel hands no port to
    anybody else - not as a connection's own port, not for a bind to port 0 - so only a process that names
    this very port can take it in between. A port the OS picks (port 0) was taken by another launch's
    connections in that window once in a CI run. Where the range cannot be read: the OS's pick."""
    low = _ephemeral_low()
    if low > LOW_PORT + 1000:
        draw = random.SystemRandom()
        for _ in range(64):
            port = draw.randrange(LOW_PORT, low)
            if port_is_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        text = Folder("/proc/sys/net/ipv4").load_text("ip_local_port_range", limit=100)
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def port_is_free(port: int, host: str = "") -> bool:
    """Can a server listen on ``port``? SO_REUSEADDR like torch's TCPStore, so TIME_WAIT is not 'taken'."""
    families = [(socket.AF_INET, host or "0.0.0.0")]
    if socket.has_ipv6 and not host:
        families.append((socket.AF_INET6, "::"))
    for family, addr in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((addr, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return False
                if exc.errno == errno.EACCES:
                    raise LaunchError(f"port {port} needs root privileges to listen on (ports below 1024 do).",
                                      "use a port from 1024 to 65535, e.g. --master-port 29500.") from None
                if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    continue
                raise
    return True


def require_free_port(port: int, flag: str = "--master-port") -> None:
    if not 0 < port < 65536:
        raise LaunchError(f"{flag} {port} is not a valid port.", "use a port between 1024 and 65535.")
    if not port_is_free(port):
        raise LaunchError(
            f"{flag} {port} is already in use on this machine (another job or rendezvous holds it).",
            f"on one machine drop {flag} and a free port is chosen for you; otherwise pick another port.",
        )

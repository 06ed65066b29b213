"""Ports: find a free one, and refuse a taken one before any process starts.

Why: a fixed rendezvous port that another job holds makes torch fail deep inside the agent (or, with
c10d, join the other job's store). Checking first turns that into one clear line.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from typing import Iterator

from multigpu.errors import LaunchError


def reserve_port() -> tuple[int, socket.socket]:
    """A free port that nobody else is given while the returned socket stays open, for a store bound to it
    later: rank 0's (torch's agent picks its port: :func:`store_ports_held`), ``--simulate-nodes``' node 0's.

    The socket is bound (to port 0: the kernel picks) with SO_REUSEADDR on IPv6 and IPv4 at once (dual
    stack; IPv4 alone where there is no IPv6) and never listens. The kernel then gives that port to no
    connection and to no bind to port 0, and a bind without SO_REUSEADDR fails; the store that names it
    (torch's TCPStore sets SO_REUSEADDR) still binds and listens. A port picked and let go instead (torch's
    ``get_free_port``) was taken by another launch's connection in a CI run."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((address, 0))
        except OSError:
            sock.close()
            if family == socket.AF_INET:
                raise
            continue
        return sock.getsockname()[1], sock
    raise OSError("no socket to hold a port with")


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """:func:`reserve_port`'s port, held until the block ends."""
    port, sock = reserve_port()
    with sock:
        yield port


#: The ports torch's agent picked through :func:`_pick` while launches run: closed when the last one ends.
_held: list[socket.socket] = []


def _pick() -> int:
    port, sock = reserve_port()
    _held.append(sock)
    return port


def _release_held() -> None:
    while _held:
        with contextlib.suppress(OSError):  # never instead of the launch's own outcome
            _held.pop().close()


def store_ports_held() -> contextlib.AbstractContextManager[None]:
    """While torch's agent runs in this block, the ports it picks for rank 0's store (once per rendezvous
    round: ``get_free_port`` in torch.distributed.elastic.rendezvous.api) are :func:`reserve_port`'s, held
    until the last launch of this process running such a block has ended; torch's own function comes back
    then (``torch_agent.swapped``: launches in several threads may end in any order). A torch without that
    function picks its ports its own way."""
    from torch.distributed.elastic.rendezvous import api

    from multigpu.launch.torch_agent import swapped

    return swapped(api, "get_free_port", _pick, on_last_exit=_release_held)


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
                    raise LaunchError(
                        f"port {port} needs root privileges to listen on (ports below 1024 do).",
                        "use a port from 1024 to 65535, e.g. --master-port 29500.",
                    ) from None
                if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    continue
                raise
    return True


def require_free_port(port: int, flag: str = "--master-port") -> None:
    if not 0 < port < 65536:
        raise LaunchError(
            f"{flag} {port} is not a valid port.", "use a port between 1024 and 65535."
        )
    if not port_is_free(port):
        raise LaunchError(
            f"{flag} {port} is already in use on this machine (another job or rendezvous holds it).",
            f"on one machine drop {flag} and a free port is chosen for you; otherwise pick another port.",
        )

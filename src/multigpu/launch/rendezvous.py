"""Where the workers of every node meet: the rendezvous a ``multigpu run`` command line asks for.

Static (``--master-addr/--master-port``, SpeechBrain's multi-GPU guide's recipe) when every node is
numbered in advance, c10d (torchrun's default) otherwise - and on one machine a c10d store on
``localhost:0``, so that two launches never clash on a port. Every bad combination is refused here,
before a process starts, with the flag to change.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from multigpu import validate
from multigpu.errors import LaunchError
from multigpu.launch.ports import require_free_port

DEFAULT_RDZV_TIMEOUT_S = 900


@dataclass(frozen=True)
class Rendezvous:
    backend: str  # "c10d" or "static"
    endpoint: str
    run_id: str
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    timeout_s: int = DEFAULT_RDZV_TIMEOUT_S

    def configs(self) -> dict[str, Any]:
        if self.backend == "static":
            return {"rank": self.node_rank, "timeout": self.timeout_s}
        return {"join_timeout": self.timeout_s}


def parse_nnodes(text: str) -> tuple[int, int]:
    lo, sep, hi = str(text).partition(":")
    if validate.is_digits(lo[:12]) and validate.is_digits((hi if sep else lo)[:12]):
        min_nodes, max_nodes = int(lo[:12]), int((hi if sep else lo)[:12])
    else:
        raise LaunchError(
            f"--nnodes {text!r} is not a number or MIN:MAX.", "write --nnodes 2 or --nnodes 1:4."
        ) from None
    if not 0 < min_nodes <= max_nodes:
        raise LaunchError(
            f"--nnodes {text!r}: need 0 < MIN <= MAX.", "write --nnodes 2 or --nnodes 1:4."
        )
    validate.count(max_nodes, "--nnodes", LaunchError, high=validate.MAX_NODES)
    return min_nodes, max_nodes


def require_resolvable(host: str, flag: str, timeout_s: float = 10.0) -> None:
    """Fail in seconds, not after the rendezvous timeout, when ``host`` is not a name this machine knows.

    The lookup runs in a thread with a deadline: a resolver that hangs (an unreachable DNS server) is
    reported too instead of blocking the launch."""
    import concurrent.futures
    import socket

    name = host.strip("[]")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    answered = False
    try:
        pool.submit(socket.getaddrinfo, name, None).result(timeout=timeout_s)
        answered = True
    except concurrent.futures.TimeoutError:
        raise LaunchError(
            f"{flag} {host}: looking the name up took more than {timeout_s:.0f} s.",
            "check the machine's DNS, or give the first node's IP address.",
        ) from None
    except (OSError, UnicodeError) as exc:
        raise LaunchError(
            f"{flag} {host} is not a host this machine can resolve ({exc.__class__.__name__}).",
            "give the first node's IP address or a name in /etc/hosts (the same on every node).",
        ) from None
    # the thread ends with the lookup (the fork server is forked from a launcher with no other thread)
    finally:
        pool.shutdown(wait=answered)


def plan_rendezvous(
    nnodes: str = "1",
    node_rank: int = 0,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    rdzv_endpoint: Optional[str] = None,
    rdzv_id: Optional[str] = None,
    timeout_s: int = DEFAULT_RDZV_TIMEOUT_S,
) -> Rendezvous:
    """Static rendezvous for ``--master-addr/--master-port`` (SpeechBrain's multi-GPU guide's recipe), c10d otherwise."""
    min_nodes, max_nodes = parse_nnodes(nnodes)
    for flag, text in (("--master-addr", master_addr), ("--rdzv-id", rdzv_id)):
        if text is not None:
            validate.plain_text(
                text,
                flag,
                LaunchError,
                allow_space=False,
                pattern=r"[\w.:\[\]%-]{1,255}",
                example="host1 or 10.0.0.1",
            )
    if rdzv_endpoint:
        if master_port is not None or master_addr is not None:
            raise LaunchError(
                "--rdzv-endpoint and --master-addr/--master-port both name the rendezvous.",
                "give only one of them.",
            )
        host, _, port = rdzv_endpoint.rpartition(":")
        if port == "0" and max_nodes == 1 and host in ("localhost", "127.0.0.1"):
            # torchrun's single-machine spelling (--rdzv-endpoint=localhost:0): a free port, as we do anyway.
            return Rendezvous(
                "c10d", "localhost:0", rdzv_id or uuid.uuid4().hex[:12], 1, 1, 0, timeout_s
            )
        if (
            not host
            or not validate.is_digits(port)
            or not 0 < int(port[:6]) < 65536
            or re.search(r"[\s\x00-\x1f]", host)
        ):
            raise LaunchError(
                f"--rdzv-endpoint {rdzv_endpoint!r} is not HOST:PORT.",
                "write --rdzv-endpoint node1:29400.",
            )
        return Rendezvous(
            "c10d", rdzv_endpoint, rdzv_id or "multigpu", min_nodes, max_nodes, 0, timeout_s
        )
    if min_nodes != max_nodes:
        raise LaunchError(
            f"--nnodes {nnodes} is elastic, which needs a c10d rendezvous.",
            "add --rdzv-endpoint HOST:PORT (the first node's address) instead of --master-addr/--master-port.",
        )
    if not 0 <= node_rank < max_nodes:
        raise LaunchError(
            f"--node-rank {node_rank} is outside 0..{max_nodes - 1} for --nnodes {max_nodes}.",
            "number the machines 0, 1, ... and give node 0's address as --master-addr.",
        )
    if max_nodes == 1 and master_port is None:
        # One machine: let the agent's store bind port 0, so concurrent launches never clash.
        return Rendezvous(
            "c10d", "localhost:0", rdzv_id or uuid.uuid4().hex[:12], 1, 1, 0, timeout_s
        )
    if max_nodes > 1 and (master_addr is None or master_port is None):
        missing = "--master-addr" if master_addr is None else "--master-port"
        raise LaunchError(
            f"--nnodes {max_nodes} needs {missing}.",
            "give every node the same --master-addr (node 0's address) and --master-port, "
            "or use --rdzv-endpoint HOST:PORT.",
        )
    addr = master_addr or "127.0.0.1"
    if master_port is None:  # one machine returned above, several were refused
        raise LaunchError(
            "no --master-port for a static rendezvous.", "give --master-port (node 0's free port)."
        )
    if node_rank == 0:
        require_free_port(int(master_port))  # node 0 hosts the store: refuse a taken port now
    return Rendezvous(
        "static",
        f"{addr}:{master_port}",
        rdzv_id or "multigpu",
        max_nodes,
        max_nodes,
        node_rank,
        timeout_s,
    )

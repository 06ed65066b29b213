"""``multigpu run --simulate-nodes N``: rehearse an N-node job on one machine before paying for a cluster.

Each simulated node is a real ``multigpu run --nnodes N --node-rank i`` agent with a static
rendezvous on loopback, so the multi-node code paths (node ranks, global ranks r x procs + l, a store
hosted by node 0, several agents that must all agree) run for real. GPUs, if any, are split evenly
between the simulated nodes. When one node fails, the others are stopped; Ctrl-C stops them all.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

from multigpu.errors import LaunchError
from multigpu.launch.ports import free_port


def node_commands(nodes: int, run_args: Sequence[str], visible_gpus: int, gpus_flag: Optional[str],
                  python: str = sys.executable) -> list[list[str]]:
    """One ``multigpu run`` command line per simulated node (``run_args``: the flags and the target)."""
    if nodes < 2:
        raise LaunchError(f"--simulate-nodes {nodes} must be at least 2.", "use --simulate-nodes 2 or more.")
    port = free_port()
    commands = []
    per_node = visible_gpus // nodes if visible_gpus and gpus_flag is None else 0
    if visible_gpus and gpus_flag is None and per_node == 0:
        raise LaunchError(f"{visible_gpus} GPU(s) cannot be split across {nodes} simulated nodes.",
                          "simulate fewer nodes, or pass --cpu to rehearse with CPU processes.")
    for rank in range(nodes):
        gpus = ["--gpus", f"{rank * per_node}-{(rank + 1) * per_node - 1}"] if per_node else []
        commands.append([python, "-m", "multigpu", "run", "--nnodes", str(nodes), "--node-rank", str(rank),
                         "--master-addr", "127.0.0.1", "--master-port", str(port), *gpus, *run_args])
    return commands


def run_nodes(commands: Sequence[Sequence[str]], poll_s: float = 0.1) -> int:
    """Start every node's agent (node 0 first); return 0, or the status of the first node that failed."""
    procs: list[subprocess.Popen] = []
    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for command in commands:
            procs.append(subprocess.Popen(list(command), start_new_session=True))
            time.sleep(0.2)  # node 0 opens the store first; the others would wait for it anyway
        failed: Optional[int] = None
        while True:
            codes = [p.poll() for p in procs]
            if stop:
                failed = 128 + stop[0]
                break
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                node, failed = bad[0]
                print(f"multigpu: simulated node {node} failed (exit {failed}); stopping the others.", file=sys.stderr,
                      flush=True)
                break
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
        _stop(procs, signal.SIGTERM if not stop else stop[0])
        return failed
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(procs, signal.SIGKILL, grace_s=0)


def _stop(procs: Sequence[subprocess.Popen], sig: int, grace_s: float = 30.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

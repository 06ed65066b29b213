"""``multigpu run --simulate-nodes N``: rehearse an N-node job on one machine before paying for a cluster.

Each simulated node is a real ``multigpu run --nnodes N --node-rank i`` agent with a static
rendezvous on loopback, so the multi-node code paths (node ranks, global ranks r x procs + l, a store
hosted by node 0, several agents that must all agree) run for real. With ``--max-restarts`` the nodes meet
in a c10d rendezvous instead (``--rdzv-endpoint``): a restart must bring every node's workers into a new
round, which a static rendezvous cannot (the restarted node's workers would wait for the others' old ones).
GPUs, if any, are split evenly between the simulated nodes. When one node fails, the others are stopped;
Ctrl-C stops them all.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Optional, Sequence

from multigpu import validate
from multigpu.distributed.job import JOB_VAR, job_env
from multigpu.errors import LaunchError
from multigpu.launch.children import Children
from multigpu.launch.devices import parse_gpu_ids
from multigpu.launch.flags import RunFlags
from multigpu.launch.ports import reserved_port

#: Set for the launchers of the simulated nodes: every node is started here, nobody has to start the others.


def node_commands(
    nodes: int,
    flags: RunFlags,
    target: Sequence[str],
    visible_gpus: int,
    gpus_flag: Optional[str],
    python: str = sys.executable,
    *,
    port: int,
) -> list[list[str]]:
    """One ``multigpu run`` command line per simulated node (``flags``: the launcher's flags without
    nodes and GPUs), meeting at ``port`` on loopback. The GPUs - the ones named by ``gpus_flag``, else every
    visible one - are split evenly between the nodes."""
    validate.count(
        nodes,
        "--simulate-nodes",
        LaunchError,
        low=2,
        high=validate.MAX_SIMULATED_NODES,
        hint=f"use 2 to {validate.MAX_SIMULATED_NODES} simulated nodes.",
    )
    ids = parse_gpu_ids(gpus_flag) if gpus_flag is not None else list(range(visible_gpus))
    if ids and len(ids) % nodes:
        raise LaunchError(
            f"{len(ids)} GPU(s) cannot be split evenly across {nodes} simulated nodes.",
            "name a multiple of the node count with --gpus, or pass --cpu to rehearse with CPU processes.",
        )
    per_node = len(ids) // nodes
    commands = []
    restarts = flags.max_restarts not in (None, 0, "0")
    for rank in range(nodes):
        mine = ids[rank * per_node : (rank + 1) * per_node]
        gpus = ",".join(str(i) for i in mine) if mine else None
        # a restart must bring every node's workers to a new round: c10d's rendezvous does, static not
        if restarts:
            node = flags.replace(
                nnodes=nodes,
                rdzv_endpoint=f"127.0.0.1:{port}",
                rdzv_id=f"simulated-{port}",
                gpus=gpus,
            )
        else:
            node = flags.replace(
                nnodes=nodes, node_rank=rank, master_addr="127.0.0.1", master_port=port, gpus=gpus
            )
        commands.append(node.to_argv(target, python))
    return commands


def simulate(
    nodes: int,
    command: Sequence[str],
    flags: RunFlags,
    *,
    visible: Sequence[str],
    gpus: Optional[str],
    clashing: dict[str, Any],
) -> int:
    """``multigpu run --simulate-nodes N``: refuse the real multi-node flags, then run N local agents, each
    a ``multigpu run`` with ``flags`` (every launch flag of this line) and its node's own."""
    given = [flag for flag, value in clashing.items() if value]
    if given:
        raise LaunchError(
            f"--simulate-nodes chooses the nodes itself; drop {given[0]}.",
            "use either --simulate-nodes N or the real multi-node flags.",
        )
    validate.count(nodes, "--simulate-nodes", LaunchError, low=2, high=validate.MAX_SIMULATED_NODES)
    if flags.nproc is not None:
        validate.count(
            flags.nproc * nodes,
            f"--simulate-nodes {nodes} x --nproc",
            LaunchError,
            hint=f"all simulated nodes run on this machine: keep the total at most {validate.MAX_PROCS_PER_NODE}.",
        )
    flags = flags.replace(simulate_nodes=None, gpus=None)
    with reserved_port() as port:  # held for node 0's store: nobody else is given it meanwhile
        return run_nodes(
            node_commands(nodes, flags, command, 0 if flags.cpu else len(visible), gpus, port=port)
        )


def run_nodes(commands: Sequence[Sequence[str]], poll_s: float = 0.1, grace_s: float = 30.0) -> int:
    """Start every node's agent (node 0 first); return 0, or the status of the first node that failed
    (the others are stopped), or 128 + the stop signal received (forwarded to every node)."""
    failed: list[int] = []

    def ended(node: int, code: int) -> bool:
        if code == 0 or children.received or failed:
            return False
        print(
            f"multigpu: simulated node {node} failed (exit {code}); stopping the others.",
            file=sys.stderr,
            flush=True,
        )
        failed.append(code)
        return True

    with Children((signal.SIGINT, signal.SIGTERM), grace_s, poll_s) as children:
        # the nodes' launchers: "we start the other nodes", not "you"
        env = {**os.environ, **job_env(os.environ.get(JOB_VAR), simulated_node=True)}
        for command in commands:
            children.start(command, env)
            time.sleep(0.2)  # node 0 opens the store first; the others would wait for it anyway
        children.watch(ended)
    if children.received:
        return 128 + children.received[0]
    return failed[0] if failed else 0

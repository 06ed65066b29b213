"""Two real "machines": Linux network namespaces joined by a veth pair, each with its own hostname
and hosts file, running `multigpu run --nnodes 2` - with static and with c10d rendezvous.

Network safety: the fixture adds an `unreachable` route for the test subnet on the host before it
creates anything, uses only addresses inside that subnet (and loopback), and removes everything
afterwards, also on failure (tests/infra/twonodes.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import PY, SCRIPTS, child_env, multigpu

pytestmark = [pytest.mark.infra, pytest.mark.timeout(300)]

if os.geteuid() != 0 or not sys.platform.startswith("linux"):
    pytest.skip("network namespaces need root on Linux", allow_module_level=True)

from infra.twonodes import TwoNodes, cleanup_stale, missing_requirements  # noqa: E402

if missing_requirements():
    pytest.skip(f"cannot build two nodes here: {missing_requirements()}", allow_module_level=True)


@pytest.fixture
def nodes():
    cleanup_stale()  # leftovers of a test process that was SIGKILLed
    with TwoNodes() as two:
        yield two


def _launch(nodes, per_node_args: dict, script_args: list[str], timeout: float = 180) -> dict:
    """Start `multigpu run` on node a and b with their own flags; wait for both; return their results."""
    procs = {}
    for node in ("a", "b"):
        argv = [PY, "-m", "multigpu", "run", *per_node_args[node], *script_args]
        procs[node] = nodes.popen(node, argv, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
    results = {}
    for node, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        results[node] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def _rendezvous(kind: str, nodes, nproc: int = 1) -> dict:
    if kind == "static":
        common = ["--nnodes", "2", "--master-addr", nodes.addr_a, "--master-port", "29500", "--rdzv-timeout", "60"]
        return {"a": [*common, "--node-rank", "0", "--nproc", str(nproc)],
                "b": [*common, "--node-rank", "1", "--nproc", str(nproc)]}
    common = ["--nnodes", "2", "--rdzv-endpoint", f"{nodes.addr_a}:29400", "--rdzv-id", "twonodes",
              "--rdzv-timeout", "60", "--nproc", str(nproc)]
    return {"a": common, "b": common}


@pytest.mark.parametrize("kind", ["static", "c10d"])
def test_two_nodes_train_like_one_node(nodes, tmp_path, kind):
    out = tmp_path / "two.pt"
    results = _launch(nodes, _rendezvous(kind, nodes, nproc=2),
                      [str(SCRIPTS / "equivalence.py"), str(out), "--batch", "2", "--global-batch", "8"])
    for node, result in results.items():
        assert result.returncode == 0, f"node {node}:\n{result.stderr[-3000:]}"
    single = tmp_path / "one.pt"
    multigpu("run", "--nproc", "1", str(SCRIPTS / "equivalence.py"), str(single), "--batch", "8", "--global-batch", "8",
             check=True)
    a, b = torch.load(out, weights_only=True), torch.load(single, weights_only=True)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert "node 0 of 2, world size 4" in results["a"].stderr or "node 0 of 2" in results["a"].stderr


def test_global_ranks_follow_node_times_procs_plus_local_rank_across_real_hosts(nodes, tmp_path):
    results = _launch(nodes, _rendezvous("static", nodes, nproc=2), [str(SCRIPTS / "allreduce.py")])
    records = []
    for result in results.values():
        assert result.returncode == 0, result.stderr
        records += [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    by_rank = {r["rank"]: r for r in records}
    assert sorted(by_rank) == [0, 1, 2, 3]
    for rank, record in by_rank.items():
        assert rank == record["node_rank"] * 2 + record["local_rank"]
        assert record["sum"] == 10.0 and record["world_size"] == 4


def test_nodes_that_disagree_on_sizes_fail_with_a_clear_error(nodes):
    flags = _rendezvous("static", nodes)
    flags["a"] = [*flags["a"][:-2], "--nproc", "2"]  # node a starts 2 processes, node b 1
    results = _launch(nodes, flags, [str(SCRIPTS / "allreduce.py")], timeout=120)
    for result in results.values():
        assert result.returncode != 0
    text = results["a"].stderr + results["b"].stderr
    assert "every node must start the same number of processes" in text

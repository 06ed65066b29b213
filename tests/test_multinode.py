"""Two real "machines": Linux network namespaces joined by a veth pair, each with its own hostname
and hosts file, running `multigpu run --nnodes 2` - with static and with c10d rendezvous.

Network safety: the fixture adds an `unreachable` route for the test subnet on the host before it
creates anything, uses only addresses inside that subnet (and loopback), and removes everything
afterwards, also on failure (tests/infra/twonodes.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import PY, REPO, SCRIPTS, child_env, multigpu

# Two launchers (one per node) per test, each within --rdzv-timeout of the other; 300 s for a busy machine.
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
        procs[node] = nodes.popen(
            node, argv, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    results = {}
    for node, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        results[node] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def _rendezvous(kind: str, nodes, nproc: int = 1) -> dict:
    if kind == "static":
        common = [
            "--nnodes",
            "2",
            "--master-addr",
            nodes.addr_a,
            "--master-port",
            "29500",
            "--rdzv-timeout",
            "60",
        ]
        return {
            "a": [*common, "--node-rank", "0", "--nproc", str(nproc)],
            "b": [*common, "--node-rank", "1", "--nproc", str(nproc)],
        }
    common = [
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"{nodes.addr_a}:29400",
        "--rdzv-id",
        "twonodes",
        "--rdzv-timeout",
        "60",
        "--nproc",
        str(nproc),
    ]
    return {"a": common, "b": common}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """equivalence.py on one process with the global batch: the reference of both rendezvous kinds (one launch)."""
    single = tmp_path_factory.mktemp("single") / "one.pt"
    multigpu(
        "run",
        "--nproc",
        "1",
        str(SCRIPTS / "equivalence.py"),
        str(single),
        "--batch",
        "8",
        "--global-batch",
        "8",
        check=True,
    )
    return torch.load(single, weights_only=True)


@pytest.mark.parametrize("kind", ["static", "c10d"])
def test_two_nodes_train_like_one_node(nodes, tmp_path, kind, one_process):
    out = tmp_path / "two.pt"
    results = _launch(
        nodes,
        _rendezvous(kind, nodes, nproc=2),
        [str(SCRIPTS / "equivalence.py"), str(out), "--batch", "2", "--global-batch", "8"],
    )
    for node, result in results.items():
        assert result.returncode == 0, f"node {node}:\n{result.stderr[-3000:]}"
    a, b = torch.load(out, weights_only=True), one_process
    # float64: only the order of float sums differs (the bound: tests/scripts/equivalence.py)
    assert max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"]) < 1e-7
    assert (a["losses"] - b["losses"]).abs().max().item() < 1e-7
    assert (
        "node 0 of 2, world size 4" in results["a"].stderr or "node 0 of 2" in results["a"].stderr
    )


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


# ------------------------------------------------------------------ multigpu doctor on two nodes


def _doctor(nodes, per_node: dict, env_b: dict | None = None, timeout: float = 120) -> dict:
    procs = {}
    for node in ("a", "b"):
        env = child_env(env_b if node == "b" else None)
        procs[node] = nodes.popen(
            node,
            [PY, "-m", "multigpu", "doctor", "--sizes", "1,8", *per_node[node]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for node, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        results[node] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def _doctor_flags(nodes, out_a, out_b=None, port_b: int = 29500, rdzv_timeout: int = 20) -> dict:
    common = ["--nnodes", "2", "--master-addr", nodes.addr_a, "--rdzv-timeout", str(rdzv_timeout)]
    return {
        "a": [*common, "--master-port", "29500", "--node-rank", "0", "--out", str(out_a)],
        "b": [
            *common,
            "--master-port",
            str(port_b),
            "--node-rank",
            "1",
            "--out",
            str(out_b or out_a),
        ],
    }


def test_doctor_passes_two_healthy_nodes(nodes, tmp_path):
    results = _doctor(nodes, _doctor_flags(nodes, tmp_path))
    assert results["a"].returncode == 0 and results["b"].returncode == 0, (
        results["a"].stderr + results["b"].stderr
    )
    assert (
        "2 rank(s) on 2 node(s)" in results["a"].stdout
        and "all-reduce 8 MiB   ok" in results["a"].stdout
    )


def test_doctor_names_a_node_with_an_older_package(nodes, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(REPO / "src" / "multigpu", old / "multigpu")
    init = old / "multigpu" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "', '__version__ = "0.0.9-was-'))
    results = _doctor(
        nodes, _doctor_flags(nodes, tmp_path), env_b={"PYTHONPATH": f"{old}{os.pathsep}{SCRIPTS}"}
    )
    assert results["a"].returncode == 1
    assert (
        "multigpu: error: multigpu versions differ" in results["a"].stderr
        and "0.0.9-was-" in results["a"].stderr
    )
    assert "HINT:" in results["a"].stderr


def test_doctor_finds_an_output_folder_that_is_not_shared(nodes, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    results = _doctor(nodes, _doctor_flags(nodes, tmp_path / "a", tmp_path / "b"))
    assert results["a"].returncode == 1
    assert "is not shared: a file written by rank 0" in results["a"].stderr


def test_doctor_with_an_unreachable_port_fails_in_seconds_with_one_line(nodes, tmp_path):
    """Both nodes fail whatever the timing (node b's port has no listener, so node a never sees it join): each
    waits out --rdzv-timeout, 5 s here (20 s cost ~40 s of this test), then says so in one line. 90 s is
    far below doctor's own 300 s limit and above two launcher starts plus 5 s on 2 busy cores (~30 s)."""
    started = time.monotonic()
    results = _doctor(nodes, _doctor_flags(nodes, tmp_path, port_b=29511, rdzv_timeout=5))
    assert time.monotonic() - started < 90
    for node in ("a", "b"):
        assert results[node].returncode != 0
        stderr = results[node].stderr
        assert "multigpu: error:" in stderr and "Traceback" not in stderr
        # no C++ stack traces from c10d's retries: the one line says it
        assert "frame #0" not in stderr
